"""Mixture of experts on CPU: the step time of each `moe.balance` mode, and the batched
expert compute against a per-expert masked loop.

    python scripts/bench_moe.py [--rounds 8] [--threads 1]

1. Step time: the engine's accumulation step (`AccumulateStep`, as the trainer calls it) on
   gpt_small's shapes (4 layers, width 192, block 128) with 8 experts of 384 units, top-2
   (the active width of the dense model's 768-unit MLP), a window of 2 micro-batches of 8
   rows, SGD. Modes: `global` (the routing pass; also `global-full`, the pass without its
   stop after the last router), `micro`, `none`, and the dense model. CPU time (user+sys) per
   step, rounds interleaving the modes, the first 2 rounds dropped; median over rounds,
   min-max in brackets, and each mode's ratio to `micro`.
2. Expert compute, forward and backward of one mixture layer on 2048 tokens: the sort by
   expert (engine/moe/routing.py: one gather, each expert on its contiguous slice, one
   scatter-add) against Hugging Face Mixtral's loop (each expert finds its tokens with a mask,
   gathers and scatters them itself). Tokens per CPU second, the same rounds.

Prints a Markdown section for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.distributed import DistInfo
from engine.moe.balance import BalanceCfg, BalancedTask
from engine.numerics.precision import Precision
from engine.step import StepContext
from engine.steps.accumulate import AccumulateStep
from engine.tasks import CausalLMTask
from trainer.models.gpt import GPT
from trainer.models.moe import MoE, MoEConfig

MOE = {"experts": 8, "top_k": 2, "hidden": 384}
MODES = ("global", "global-full", "micro", "none", "dense")
DROPPED = 2  # warm-up rounds


def context(mode: str) -> StepContext:
    torch.manual_seed(0)
    dense = mode == "dense"
    model = GPT(block_size=128, n_layer=4, n_head=6, n_embd=192, moe=None if dense else MOE)
    task: object = CausalLMTask()
    if not dense:
        balance = BalanceCfg(mode.split("-")[0], stop_early=not mode.endswith("-full"))
        task = BalancedTask(task, model.routers(), balance, DistInfo())
    return StepContext(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
        scheduler=None,
        task=task,  # type: ignore[arg-type]
        precision=Precision("fp32", "cpu"),
        dist=DistInfo(),
        clip_grad_norm=None,
    )


def cpu_seconds(fn: Callable[[], object]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def step_times(rounds: int) -> dict[str, list[float]]:
    g = torch.Generator().manual_seed(0)
    window = [
        (torch.randint(0, 256, (8, 128), generator=g), torch.randint(0, 256, (8, 128), generator=g))
        for _ in range(2)
    ]
    ctxs, step = {m: context(m) for m in MODES}, AccumulateStep()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode in MODES:
            times[mode].append(cpu_seconds(lambda c=ctxs[mode]: step(c, window)))
    return {m: t[DROPPED:] for m, t in times.items()}


def masked_loop(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Hugging Face Mixtral's expert loop: a mask per expert, its tokens gathered and
    scattered back by the expert itself."""
    weights, experts = moe.router(x)
    out = torch.zeros_like(x)
    hit = F.one_hot(experts, moe.router.num_experts).permute(2, 1, 0)  # (E, k, N)
    ex = moe.experts
    for e in range(moe.router.num_experts):
        slot, token = torch.where(hit[e])
        h = F.gelu(x[token] @ ex.fc[e] + ex.fc_bias[e]) @ ex.proj[e] + ex.proj_bias[e]
        out.index_add_(0, token, h * weights[token, slot, None])
    return out


def compute_rates(rounds: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    moe = MoE(192, MoEConfig(**MOE), bias=True, dropout=0.0)
    moe.init_weights(4)
    x = torch.randn(1, 2048, 192)
    ways = {
        "sorted by expert": lambda: moe(x).sum().backward(),
        "masked loop (HF Mixtral)": lambda: masked_loop(moe, x[0]).sum().backward(),
    }
    with torch.no_grad():
        assert torch.allclose(moe(x)[0], masked_loop(moe, x[0]), atol=1e-5)
    rates: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            rates[name].append(2048 / cpu_seconds(fn))
    return {w: r[DROPPED:] for w, r in rates.items()}


def spread(values: list[float], digits: int = 3) -> str:
    return (
        f"{statistics.median(values):.{digits}f} "
        f"[{min(values):.{digits}f}-{max(values):.{digits}f}]"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    times = step_times(args.rounds)
    rates = compute_rates(args.rounds)
    micro = statistics.median(times["micro"])
    today = datetime.date.today().isoformat()
    print(f"### Mixture of experts: step time by `moe.balance` (CPU, {today})\n")
    print(
        f"torch {torch.__version__}, {platform.machine()}, {args.threads} thread(s), "
        f"{args.rounds - DROPPED} rounds after {DROPPED} warm-up; gpt_small shapes, 8 experts "
        "x 384 units, top-2; 2 micro-batches of 8 x 128 tokens. CPU seconds per step, median "
        "[min-max].\n"
    )
    print("| mode | CPU s / step | ratio to micro |\n| --- | --- | --- |")
    for mode in MODES:
        ratio = statistics.median(times[mode]) / micro
        print(f"| {mode} | {spread(times[mode])} | {ratio:.2f} |")
    print("\n| expert compute, 2048 tokens, forward + backward | tokens / CPU s |\n| --- | --- |")
    for name, r in rates.items():
        print(f"| {name} | {spread(r, 0)} |")


if __name__ == "__main__":
    main()
