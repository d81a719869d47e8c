"""Peak memory and time of the loss layer: plain logits + F.cross_entropy vs the chunked loss.

    python scripts/bench_chunked_ce.py [--tokens 8192] [--vocab 50257] [--width 768]
        [--chunk 2048] [--precision fp32|bf16] [--append docs/benchmarks.md]

One forward + backward of the output layer and the loss (hidden states and weight are
leaves) at GPT-2-small shapes, each mode in a fresh process so the peaks do not mix. Peak
memory is the CUDA allocator's on a GPU, else the process's peak RSS above what it held just
before the loss (inputs allocated). Time is the best of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.numerics.chunked_ce import chunked_cross_entropy  # noqa: E402


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

    def step() -> float:
        with torch.autocast(device.type, dtype=dtype, enabled=args.precision == "bf16"):
            if args.mode == "plain":
                logits = F.linear(hidden, weight).float()  # (N, V)
                loss = F.cross_entropy(logits, targets, reduction="sum")
            else:
                loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=args.chunk)
        loss.backward()
        hidden.grad = weight.grad = None
        return float(loss)

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
        peak = rss_peak_mb() - base
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"loss": loss, "peak_mb": peak, "seconds": min(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8 * 1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--mode", choices=["plain", "chunked"], help=argparse.SUPPRESS)
    parser.add_argument("--append", type=Path, help="append the table to this markdown file")
    args = parser.parse_args()
    if args.mode:  # a child: one mode, JSON on the last line
        print(json.dumps(measure(args)))
        return
    argv = [a for a in sys.argv[1:] if not a.startswith("--append")]
    if args.append:
        argv = [a for a in argv if a != str(args.append)]
    results = {}
    for mode in ("plain", "chunked"):
        out = subprocess.run(
            [sys.executable, __file__, *argv, "--mode", mode],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        results[mode] = json.loads(out.splitlines()[-1])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    plain, chunked = results["plain"], results["chunked"]
    lines = [
        f"### Chunked cross-entropy vs plain: {args.tokens} tokens x vocab {args.vocab} x "
        f"width {args.width}, {args.precision}, chunk {args.chunk} ({device}, "
        f"{platform.machine()}, torch {torch.__version__})",
        "",
        "| loss layer | peak extra memory (MiB) | forward + backward (s) | loss |",
        "| --- | ---: | ---: | ---: |",
        *(
            f"| {m} | {r['peak_mb']:,.0f} | {r['seconds']:.2f} | {r['loss']:.6f} |"
            for m, r in results.items()
        ),
        "",
        f"Chunked / plain: memory {chunked['peak_mb'] / plain['peak_mb']:.3f}x, time "
        f"{chunked['seconds'] / plain['seconds']:.2f}x; loss relative difference "
        f"{abs(chunked['loss'] - plain['loss']) / abs(plain['loss']):.1e}.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.append:
        with args.append.open("a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
