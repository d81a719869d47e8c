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
   expert (engine/moe/routing.py: one gather, every expert on its contiguous slice in one
   grouped product per weight, engine/moe/grouped.py, one scatter-add) against Hugging Face
   Mixtral's loop (each expert finds its tokens with a mask, gathers and scatters them
   itself). Tokens per CPU second, the same rounds.

Prints a Markdown section for docs/benchmarks.md.

    python scripts/bench_moe.py --ep [--rounds 8] [--threads 1]

3. Expert parallelism on 2 ranks (torchrun, gloo): the same model and window on each rank
   (its own tokens), `moe.balance=global`, under `dist.ep=1` (DDP: every expert on each rank)
   and `dist.ep=2` (4 experts of every layer on each rank, tokens sent all-to-all), rounds
   interleaving the two. Per step: wall seconds (both ranks start it together), CPU seconds,
   and the bytes each rank sends and receives in the all-to-alls (the rows for another
   rank's experts; `torch.distributed.all_to_all_single` counted), beside the planner's
   formula under uniform routing (trainer/planning/, docs/plan.md).

    python scripts/bench_moe.py --compile [--rounds 8] [--threads 1]

4. torch.compile (issue #65): gpt_tiny's shapes (2 layers, width 32, block 64) with 4 experts
   of 64 units, top-2, the default `moe.balance=global` (its routing pass runs the whole
   forward without a graph, as the trainer's does under compile), a window of 2 micro-batches
   of 8 rows, SGD, fp32. The same weights eager and compiled (inductor, torch.compile's
   default mode, in place as `train.compile=true` does). The compiled model's first step and
   a no-grad forward (an evaluation's) are its warm-up (wall and CPU seconds, inductor
   compiling in this process, its C++ compiler's included); then rounds interleave an eager
   and a compiled step, each on a new window (new routing: other counts per expert), each
   followed by an evaluation forward. Tokens per CPU second, median [min-max] over the
   rounds after the first 2.
   Dynamo's own counters say what compiled: graphs during and after the warm-up, graph
   breaks, and its recompile-limit warnings.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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


class AllToAllBytes:
    """Within: the bytes this rank sends to and receives from other ranks in
    `torch.distributed.all_to_all_single` (its own split, kept, is not counted)."""

    def __init__(self) -> None:
        self.sent = self.received = 0

    def __enter__(self) -> AllToAllBytes:
        self.original = dist.all_to_all_single

        def counted(out: Any, x: Any, out_splits: Any = None, in_splits: Any = None, **kw: Any):
            group = kw.get("group")
            me = dist.get_rank(group)
            self.sent += _leaving(x, in_splits, me, dist.get_world_size(group))
            self.received += _leaving(out, out_splits, me, dist.get_world_size(group))
            return self.original(out, x, out_splits, in_splits, **kw)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_to_all_single = self.original


def _leaving(t: torch.Tensor, splits: list[int] | None, me: int, size: int) -> int:
    rows = t.shape[0]
    row = t.numel() * t.element_size() // rows if rows else 0
    kept = splits[me] if splits else rows // size
    return (rows - kept) * row


def ep_context(ep: int, info: DistInfo) -> StepContext:
    """The bench's mixture on this rank, laid out with `dist.ep=ep` over the 2 ranks."""
    from engine.moe.balance import balanced
    from engine.parallel.dims import ParallelDims

    torch.manual_seed(0)
    model = GPT(block_size=128, n_layer=4, n_head=6, n_embd=192, moe=MOE)
    parallel = ParallelDims(ep=ep).build(info)
    wrapped = parallel.apply(model)
    balance = BalanceCfg("global", stop_early=not parallel.shards_parameters)
    task = balanced(CausalLMTask(), model.routers(), balance, info, parallel.dp_group)
    return StepContext(
        model=wrapped,
        optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
        scheduler=None,
        task=task,
        precision=Precision("fp32", "cpu"),
        dist=info,
        parallel=parallel,
        clip_grad_norm=None,
    )


def ep_worker(rounds: int, threads: int) -> None:
    """One of the 2 ranks of `--ep` (launched by torchrun); rank 0 prints the section."""
    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    info = DistInfo(dist.get_rank(), dist.get_world_size())
    g = torch.Generator().manual_seed(info.rank)
    window = [
        (torch.randint(0, 256, (8, 128), generator=g), torch.randint(0, 256, (8, 128), generator=g))
        for _ in range(2)
    ]
    ctxs, step = {ep: ep_context(ep, info) for ep in (1, 2)}, AccumulateStep()
    wall: dict[int, list[float]] = {1: [], 2: []}
    cpu: dict[int, list[float]] = {1: [], 2: []}
    moved: dict[int, tuple[int, int]] = {}
    for _ in range(rounds):
        for ep, ctx in ctxs.items():
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            with AllToAllBytes() as counted:
                step(ctx, window)
            dist.barrier()
            wall[ep].append(time.perf_counter() - start)
            cpu[ep].append(time.process_time() - start_cpu)
            moved[ep] = (counted.sent, counted.received)
    figures = [(wall[ep][DROPPED:], cpu[ep][DROPPED:], moved[ep]) for ep in (1, 2)]
    everyone: list[Any] = [None, None]
    dist.all_gather_object(everyone, figures)
    dist.destroy_process_group()
    if info.rank == 0:
        print_ep(everyone, rounds, threads)


def print_ep(everyone: list[Any], rounds: int, threads: int) -> None:
    # The planner's figure (uniform routing): tokens x k x width x 4 bytes x 2 (dispatch and
    # combine) x 3 passes (the routing pass's forward, the forward, the backward) x layers x
    # (ep - 1) / ep of the rows leaving.
    tokens, width, layers = 2 * 8 * 128, 192, 4
    uniform = tokens * MOE["top_k"] * width * 4 * 2 * 3 * layers // 2
    today = datetime.date.today().isoformat()
    print(f"### Mixture of experts: expert parallelism on 2 ranks (CPU, gloo, {today})\n")
    print(
        f"torch {torch.__version__}, {platform.machine()}, {threads} thread(s) per rank, "
        f"{rounds - DROPPED} rounds after {DROPPED} warm-up, dist.ep=1 and 2 interleaved; "
        "gpt_small shapes, 8 experts x 384 units, top-2, moe.balance=global; each rank 2 "
        "micro-batches of 8 x 128 tokens. Per step, median [min-max] over rounds (wall: the "
        "slower rank's; CPU: the mean of the ranks'); all-to-all MiB each rank sends / receives "
        "(the routed rows for another rank's experts, and the expert counts).\n"
    )
    print(
        "| layout | wall s / step | CPU s / step | all-to-all MiB sent / received, rank 0; rank 1 "
        "| planned (uniform routing) |\n| --- | --- | --- | --- | --- |"
    )
    for i, ep in enumerate((1, 2)):
        walls = [max(w) for w in zip(*(rank[i][0] for rank in everyone))]
        cpus = [statistics.mean(c) for c in zip(*(rank[i][1] for rank in everyone))]
        moved = [rank[i][2] for rank in everyone]
        mib = "; ".join(f"{s / 2**20:.3f} / {r / 2**20:.3f}" for s, r in moved)
        planned = f"{uniform / 2**20:.3f}" if ep == 2 else "0"
        print(f"| dist.ep={ep} | {spread(walls)} | {spread(cpus)} | {mib} | {planned} |")


def launch_ep(rounds: int, threads: int) -> None:
    """`--ep`: this script again on 2 ranks (torchrun, gloo), as workers."""
    import os
    import subprocess

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    worker = [__file__, "--ep-worker", "--rounds", str(rounds), "--threads", str(threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run([*torchrun, "--nproc_per_node=2", *worker], check=True, env=env)


# ---- 4. torch.compile

TINY_MOE = {"experts": 4, "top_k": 2, "hidden": 64}  # issue #65's run, on gpt_tiny
TINY_ROWS, TINY_BLOCK = 8, 64


def tiny_context() -> StepContext:
    """gpt_tiny with TINY_MOE, `moe.balance=global`, SGD: the same weights every call."""
    torch.manual_seed(0)
    model = GPT(block_size=TINY_BLOCK, n_layer=2, n_head=2, n_embd=32, moe=TINY_MOE)
    # Under compile the routing pass runs the whole forward (trainer/run/extensions/moe.py).
    balance = BalanceCfg("global", stop_early=False)
    task = BalancedTask(CausalLMTask(), model.routers(), balance, DistInfo())
    return StepContext(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
        scheduler=None,
        task=task,  # type: ignore[arg-type]
        precision=Precision("fp32", "cpu"),
        dist=DistInfo(),
        clip_grad_norm=None,
    )


def cpu_with_children() -> float:
    """CPU seconds of this process and of its children waited for (inductor's C++ compiler)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


class RecompileWarnings(logging.Handler):
    """Within: dynamo's warnings that a frame hit its recompile limit (it then runs the frame
    eagerly)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "recompile_limit" in record.getMessage():
            self.messages.append(record.getMessage().splitlines()[0])

    def __enter__(self) -> RecompileWarnings:
        logging.getLogger("torch._dynamo").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("torch._dynamo").removeHandler(self)


def compile_figures(rounds: int) -> dict[str, Any]:
    """Section 4's figures: tokens per CPU second eager and compiled, the warm-up, dynamo's
    counts of graphs and breaks, and the recompile warnings."""
    import torch._dynamo
    import torch._inductor.config

    g = torch.Generator().manual_seed(0)

    def window() -> list[tuple[torch.Tensor, torch.Tensor]]:  # a new routing each time
        shape = (TINY_ROWS, TINY_BLOCK)
        return [
            (torch.randint(0, 256, shape, generator=g), torch.randint(0, 256, shape, generator=g))
            for _ in range(2)
        ]

    def step(ctx: StepContext, w: list[Any]) -> None:
        AccumulateStep()(ctx, w)
        with torch.no_grad():  # an evaluation's forward
            ctx.model(w[0][0])

    torch._dynamo.reset()
    # Inductor compiles in this process, so that the warm-up's CPU seconds are all counted
    # (its worker processes would hide them); the wall time suffers on a shared machine.
    torch._inductor.config.compile_threads = 1
    counters = torch._dynamo.utils.counters
    counters.clear()
    eager, compiled = tiny_context(), tiny_context()
    compiled.model.compile()
    tokens = 2 * TINY_ROWS * TINY_BLOCK
    rates: dict[str, list[float]] = {"eager": [], "compiled": []}
    with RecompileWarnings() as warned:
        start, start_cpu = time.perf_counter(), cpu_with_children()
        step(compiled, window())
        warm_up = (time.perf_counter() - start, cpu_with_children() - start_cpu)
        warm_graphs = counters["stats"]["unique_graphs"]
        for _ in range(rounds):
            w = window()
            for name, ctx in (("eager", eager), ("compiled", compiled)):
                rates[name].append(tokens / cpu_seconds(lambda c=ctx, w=w: step(c, w)))
    return {
        "rates": {name: r[DROPPED:] for name, r in rates.items()},
        "warm_up": warm_up,
        "warm_graphs": warm_graphs,
        "later_graphs": counters["stats"]["unique_graphs"] - warm_graphs,
        "breaks": sum(counters["graph_break"].values()),
        "warnings": warned.messages,
    }


def print_compile(figures: dict[str, Any], rounds: int, threads: int) -> None:
    rates = figures["rates"]
    ratio = statistics.median(rates["compiled"]) / statistics.median(rates["eager"])
    today = datetime.date.today().isoformat()
    print(f"### Mixture of experts under torch.compile (CPU, {today})\n")
    print(
        f"torch {torch.__version__}, {platform.machine()}, {threads} thread(s), "
        f"{rounds - DROPPED} rounds after {DROPPED} warm-up, eager and compiled interleaved; "
        "gpt_tiny shapes, 4 experts x 64 units, top-2, moe.balance=global, fp32; 2 "
        f"micro-batches of {TINY_ROWS} x {TINY_BLOCK} tokens per step and an evaluation "
        "forward, a new window (routing) every step. Tokens per CPU second, median "
        "[min-max].\n"
    )
    print("| model | tokens / CPU s | ratio to eager |\n| --- | --- | --- |")
    for name in ("eager", "compiled"):
        r = 1.0 if name == "eager" else ratio
        print(f"| {name} | {spread(rates[name], 0)} | {r:.2f} |")
    warnings = "; ".join(figures["warnings"]) or "none"
    print(
        f"\nCompile warm-up (the first step and evaluation forward): "
        f"{figures['warm_up'][0]:.1f} s wall, {figures['warm_up'][1]:.1f} s CPU, "
        f"{figures['warm_graphs']} graphs. After it: "
        f"{figures['later_graphs']} graphs compiled, {figures['breaks']} graph breaks in "
        f"all, recompile-limit warnings: {warnings}."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ep", action="store_true", help="expert parallelism on 2 ranks")
    parser.add_argument("--compile", action="store_true", help="eager against torch.compile")
    parser.add_argument("--ep-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ep_worker:
        ep_worker(args.rounds, args.threads)
        return
    if args.ep:
        launch_ep(args.rounds, args.threads)
        return
    torch.set_num_threads(args.threads)
    if args.compile:
        print_compile(compile_figures(args.rounds), args.rounds, args.threads)
        return
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
