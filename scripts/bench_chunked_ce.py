"""Peak memory and time of the loss layer: plain logits + F.cross_entropy vs the chunked loss.

    python scripts/bench_chunked_ce.py [--tokens 8192] [--vocab 50257] [--width 768]
        [--chunk auto|N] [--precision fp32|bf16] [--compile]
        [--modes plain,in-graph,chunked] [--rounds N] [--append docs/benchmarks.md]

One forward + backward of the output layer and the loss (hidden states and weight are
leaves) at GPT-2-small shapes, each mode in a fresh process so the peaks do not mix. Peak
memory is the CUDA allocator's on a GPU, else the process's peak RSS above what it held just
before the loss (inputs allocated; not measured with `--compile` on a CPU, where the RSS's high
mark is the compiling run's). Time is the best of `--repeats` runs (after a first run
that compiles, with `--compile`).

Modes: `plain` is the output layer (compiled with `--compile`, as the model's graph used to
end at the logits) followed by an eager fp32 copy of the logits and `F.cross_entropy`: the
task's plain path before issue #61. `in-graph` is `PlainCrossEntropy`, the output layer and
the loss in one function (one compiled graph with `--compile`): the plain path now.
`chunked` is the chunked loss, `--chunk` tokens at a time (`auto`: what `task.chunk_size=auto`
takes, from the vocabulary and a CUDA device's memory, 2048 on a CPU), compiled with
`--compile` as inside a compiled model.
`--rounds N` runs every mode in one process, interleaved, and reports CPU-time ratios.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.numerics.chunked_ce import (  # noqa: E402
    PlainCrossEntropy,
    chunk_size_for,
    chunked_cross_entropy,
)

MODES = ("plain", "in-graph", "chunked")


def chunk_of(args: argparse.Namespace, device: torch.device) -> int:
    if args.chunk == "auto":
        return chunk_size_for(args.vocab, device)  # what task.chunk_size=auto takes
    return int(args.chunk)


def loss_layer(args: argparse.Namespace, device: torch.device) -> Any:
    """(hidden, weight, targets) -> loss of `args.mode`, compiled where `--compile` says."""
    compiled = torch.compile if args.compile else (lambda fn: fn)
    if args.mode == "plain":
        head = compiled(F.linear)

        def plain(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> Any:
            logits = head(hidden, weight).float()  # (N, V): eager, outside the graph
            return F.cross_entropy(logits, targets, reduction="sum")

        return plain
    if args.mode == "in-graph":
        loss = PlainCrossEntropy()

        def in_graph(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> Any:
            return loss(hidden, functools.partial(F.linear, weight=weight), targets)

        return compiled(in_graph)
    chunk = chunk_of(args, device)

    def chunked(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> Any:
        return chunked_cross_entropy(hidden, weight, targets, chunk_size=chunk)

    return compiled(chunked)


def mib(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:,.0f}"


def rss_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(args: argparse.Namespace) -> dict[str, float]:
    """One mode, in this process: time of the best repeat, peak memory of the first."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.tokens, args.width, device=device, generator=g).requires_grad_()
    weight = torch.randn(args.vocab, args.width, device=device, generator=g) * 0.02
    weight.requires_grad_()
    targets = torch.randint(args.vocab, (args.tokens,), device=device, generator=g)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32

    loss_fn = loss_layer(args, device)

    def step() -> float:
        with torch.autocast(device.type, dtype=dtype, enabled=args.precision == "bf16"):
            loss = loss_fn(hidden, weight, targets)
        loss.backward()
        hidden.grad = weight.grad = None
        return float(loss)

    if args.compile:
        step()  # compiles: neither timed nor in the peak
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = rss_peak_mb()
    loss = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20 - base
    else:
        peak = float("nan") if args.compile else rss_peak_mb() - base
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"loss": loss, "peak_mb": peak, "seconds": min(times)}


def interleaved(args: argparse.Namespace) -> list[str]:
    """`--rounds N`: every mode in this process, rounds alternating their order; the median
    over rounds of each mode's CPU time (user + system, steadier than wall time on a shared
    machine) divided by the first mode's in the same round, min-max in brackets."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.tokens, args.width, device=device, generator=g).requires_grad_()
    weight = (
        torch.randn(args.vocab, args.width, device=device, generator=g) * 0.02
    ).requires_grad_()
    targets = torch.randint(args.vocab, (args.tokens,), device=device, generator=g)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    modes = args.modes.split(",")
    layers = {m: loss_layer(argparse.Namespace(**{**vars(args), "mode": m}), device) for m in modes}

    def step(mode: str) -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=args.precision == "bf16"):
            loss = layers[mode](hidden, weight, targets)
        loss.backward()
        hidden.grad = weight.grad = None

    for mode in modes:
        step(mode)  # compiles
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            start = time.process_time()
            step(mode)
            cpu[mode].append(time.process_time() - start)
    first = cpu[modes[0]]
    lines = [
        f"| loss layer | CPU time, median (s) | vs {modes[0]}, median [min-max] over rounds |",
        "| --- | ---: | ---: |",
    ]
    for mode, seconds in cpu.items():
        ratios = [a / b for a, b in zip(seconds, first)]
        lines.append(
            f"| {mode} | {statistics.median(seconds):.3f} | {statistics.median(ratios):.2f}x "
            f"[{min(ratios):.2f}-{max(ratios):.2f}] |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8 * 1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--chunk", default="auto", help="tokens per chunk, or auto")
    parser.add_argument("--compile", action="store_true", help="torch.compile each loss layer")
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES)
    )
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--rounds", type=int, help="all modes in one process, interleaved: CPU-time ratios"
    )
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--append", type=Path, help="append the table to this markdown file")
    args = parser.parse_args()
    if args.rounds:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        chunk = chunk_of(args, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        title = (
            f"### Loss layer, interleaved: {args.tokens} tokens x vocab {args.vocab} x width "
            f"{args.width}, {args.precision}, chunk {args.chunk} = {chunk}"
            f"{', compiled' if args.compile else ''}, {args.rounds} rounds ({device}, torch "
            f"{torch.__version__})"
        )
        text = "\n".join([title, "", *interleaved(args), ""])
        print(text)
        if args.append:
            with args.append.open("a") as f:
                f.write("\n" + text)
        return
    if args.mode:  # a child: one mode, JSON on the last line
        print(json.dumps(measure(args)))
        return
    argv = [a for a in sys.argv[1:] if not a.startswith("--append")]
    if args.append:
        argv = [a for a in argv if a != str(args.append)]
    results = {}
    for mode in args.modes.split(","):
        out = subprocess.run(
            [sys.executable, __file__, *argv, "--mode", mode],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        results[mode] = json.loads(out.splitlines()[-1])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    chunk = chunk_of(args, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    first = next(iter(results.values()))
    spread = max(abs(r["loss"] - first["loss"]) for r in results.values()) / abs(first["loss"])
    lines = [
        f"### Loss layer: {args.tokens} tokens x vocab {args.vocab} x width {args.width}, "
        f"{args.precision}, chunk {args.chunk} = {chunk}"
        f"{', compiled' if args.compile else ''} ({device}, {platform.machine()}, torch "
        f"{torch.__version__})",
        "",
        "| loss layer | peak extra memory (MiB) | forward + backward (s) | loss | time vs "
        f"{next(iter(results))} |",
        "| --- | ---: | ---: | ---: | ---: |",
        *(
            f"| {m} | {mib(r['peak_mb'])} | {r['seconds']:.2f} | {r['loss']:.6f} | "
            f"{r['seconds'] / first['seconds']:.2f}x |"
            for m, r in results.items()
        ),
        "",
        f"Largest loss relative difference between the modes: {spread:.1e}.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.append:
        with args.append.open("a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
