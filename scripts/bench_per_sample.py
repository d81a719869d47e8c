"""Cost of per-sample gradient work on CPU: `callbacks=[noise_scale]` and `step=dp_sgd`.

    python scripts/bench_per_sample.py [--rounds 7] [--steps 10] [--threads 1]

1. noise scale: `AccumulateStep` on the default model (gpt_small, 1.85M parameters, micro 16
   x accum 2 of 128 tokens, as `make train`) with and without the `NoiseScale` callback.
2. DP-SGD: cumulus's `DPSGDStep` against Opacus's `GradSampleModule` + `DPOptimizer` on the
   same MLP (64-256-256-10, a digits-sized classifier), the same batch of 64 and the same
   clipping bound and noise multiplier; also the noise-free updates' largest difference
   (Opacus clips by C/(‖g‖+1e-6), cumulus by exactly C/‖g‖), and cumulus at micro 16 x
   accum 4 (the same update in four pieces).

Rounds alternate which variant goes first; each figure is the median step time over rounds
(min-max in brackets). Prints a Markdown section for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.callbacks import CallbackList
from engine.callbacks.noise_scale import NoiseScale
from engine.distributed import DistInfo
from engine.numerics.precision import Precision
from engine.step import StepContext
from engine.steps.accumulate import AccumulateStep
from engine.steps.dp_sgd import DPSGDStep
from engine.tasks import CausalLMTask, ClassificationTask
from trainer.models.gpt import GPT


def ctx_for(model: nn.Module, task: object, callbacks: CallbackList, lr: float) -> StepContext:
    ctx = StepContext(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        scheduler=None,
        task=task,  # type: ignore[arg-type]
        precision=Precision("fp32", "cpu"),
        dist=DistInfo(),
        clip_grad_norm=1.0,
        callbacks=callbacks,
    )
    callbacks.setup(ctx)
    return ctx


def timed(fn: Callable[[], None], steps: int) -> float:
    """Seconds per call of `fn`, over `steps` calls after one warm-up call."""
    fn()
    TimedNoiseScale.seconds = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def summary(values: list[float]) -> str:
    med, lo, hi = (1e3 * f(values) for f in (statistics.median, min, max))
    return f"{med:.1f} ms ({lo:.1f}-{hi:.1f})"


class TimedNoiseScale(NoiseScale):
    """NoiseScale that adds up the time spent in its per-micro-batch hook: its share of the
    same steps' time is robust to load from other processes, unlike an A/B difference."""

    seconds = 0.0

    def on_after_micro_batch(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        super().on_after_micro_batch(*args, **kwargs)
        type(self).seconds += time.perf_counter() - start


def noise_scale_rounds(rounds: int, steps: int) -> dict[str, list[float]]:
    shape = {"vocab_size": 256, "block_size": 128, "n_layer": 4, "n_head": 6, "n_embd": 192}
    gen = torch.Generator().manual_seed(0)
    window = []
    for _ in range(2):  # micro 16 x accum 2
        ids = torch.randint(0, 256, (16, 129), generator=gen)
        window.append((ids[:, :-1], ids[:, 1:]))
    variants = {}
    for name, callbacks in (("plain", {}), ("noise_scale", {"noise_scale": TimedNoiseScale()})):
        torch.manual_seed(0)
        ctx = ctx_for(GPT(**shape), CausalLMTask(), CallbackList(callbacks), lr=1e-4)
        step = AccumulateStep()
        variants[name] = lambda ctx=ctx, step=step: step(ctx, window)  # type: ignore[misc]
    return interleave(variants, rounds, steps)


def interleave(variants: dict[str, Callable[[], None]], rounds: int, steps: int) -> dict:
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            times[name].append(timed(variants[name], steps))
            if name == "noise_scale":  # the hook's share of these very steps
                SHARES.append(TimedNoiseScale.seconds / (steps * times[name][-1]))
    return times


SHARES: list[float] = []


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def dp_rounds(rounds: int, steps: int, clip: float, sigma: float) -> tuple[dict, float | None]:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 64, generator=gen), torch.randint(0, 10, (64,), generator=gen)

    def cumulus(micro: int, noise: float) -> tuple[nn.Module, Callable[[], None]]:
        model = mlp()
        step = DPSGDStep(max_grad_norm=clip, noise_multiplier=noise)
        step.set_sampling(64, 60000)
        ctx = ctx_for(model, ClassificationTask(), CallbackList(), lr=0.1)
        ctx.clip_grad_norm = None
        window = [(x[i : i + micro], y[i : i + micro]) for i in range(0, 64, micro)]
        return model, lambda: step(ctx, window)

    variants = {"cumulus dp_sgd (64 x 1)": cumulus(64, sigma)[1]}
    variants["cumulus dp_sgd (16 x 4)"] = cumulus(16, sigma)[1]
    try:
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer
    except ImportError:
        print("opacus is not installed: pip install opacus (comparison skipped)", file=sys.stderr)
        return interleave(variants, rounds, steps), None

    def opacus(noise: float) -> tuple[nn.Module, Callable[[], None]]:
        model = GradSampleModule(mlp())
        opt = DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            noise_multiplier=noise,
            max_grad_norm=clip,
            expected_batch_size=64,
        )

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

        return model, step

    variants["opacus 1 x 64"] = opacus(sigma)[1]
    # The same update without noise, one step from the same weights.
    (a, step_a), (b, step_b) = cumulus(64, 0.0), opacus(0.0)
    step_a()
    step_b()
    diff = max(
        (p - q).abs().max().item()
        for p, q in zip(a.parameters(), b._module.parameters())  # type: ignore[union-attr]
    )
    return interleave(variants, rounds, steps), diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ns = noise_scale_rounds(args.rounds, args.steps)
    dp, diff = dp_rounds(args.rounds, 5 * args.steps, clip=1.0, sigma=1.0)
    plain, with_ns = statistics.median(ns["plain"]), statistics.median(ns["noise_scale"])
    ratios = [b / a for a, b in zip(ns["plain"], ns["noise_scale"])]
    load = os.getloadavg()[0]
    lines = [
        f"### Per-sample gradients: noise scale and DP-SGD (CPU, {args.threads} thread(s)), "
        f"{datetime.date.today()}",
        "",
        f"`python scripts/bench_per_sample.py --rounds {args.rounds} --steps {args.steps} "
        f"--threads {args.threads}`; torch {torch.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} cores, 1-minute load average {load:.1f} at the end. Median step "
        "time over interleaved rounds (min-max).",
        "",
        "| what | step time |",
        "| --- | --- |",
        f"| gpt_small, micro 16 x accum 2, AccumulateStep | {summary(ns['plain'])} |",
        f"| the same + `callbacks=[noise_scale]` | {summary(ns['noise_scale'])} |",
    ]
    lines += [f"| MLP 64-256-256-10, batch 64: {k} | {summary(v)} |" for k, v in dp.items()]
    lines += [
        "",
        f"noise_scale overhead: {100 * (with_ns / plain - 1):+.1f}% of the step (median of "
        f"per-round ratios {100 * (statistics.median(ratios) - 1):+.1f}%, range "
        f"{100 * (min(ratios) - 1):+.1f}% to {100 * (max(ratios) - 1):+.1f}%). Time inside "
        f"the callback's per-micro-batch hook, as a share of the same steps' time: "
        f"{100 * statistics.median(SHARES):.2f}% (median; {100 * min(SHARES):.2f}% to "
        f"{100 * max(SHARES):.2f}%; the per-window estimate runs inside that hook, so it is "
        "included).",
    ]
    if diff is not None:
        lines.append(
            f"Noise-free DP-SGD update, cumulus vs Opacus from the same weights: largest "
            f"parameter difference {diff:.1e}."
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
