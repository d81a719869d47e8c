"""`python -m trainer.compare RUN_A RUN_B`: do two runs' records agree? (The comparison:
trainer/checks/compare.py.)"""

from __future__ import annotations

import argparse
import os
import sys

from trainer.checks.compare import (
    EXIT_BAD_INPUT,
    EXIT_DIFFERENT,
    MACHINE_SUFFIXES,
    CompareError,
    compare,
    metrics_file,
    report,
)
from trainer.version import answer_version


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.compare",
        description="Max difference per metric of two runs' metrics.jsonl over their common "
        "steps; exit 0 when all are within tolerance, 1 when not, 2 when not comparable.",
    )
    parser.add_argument("run_a", help="a run directory or its metrics.jsonl")
    parser.add_argument("run_b", help="a run directory or its metrics.jsonl")
    parser.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (1e-5)")
    parser.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance (1e-5)")
    parser.add_argument(
        "--keys", nargs="+", default=[], metavar="GLOB", help="compare only these metrics"
    )
    parser.add_argument(
        "--ignore",
        nargs="+",
        default=[],
        metavar="GLOB",
        help="also leave these out (always left out: metrics whose name ends a segment with "
        f"{', '.join(MACHINE_SUFFIXES)}: timing, throughput, memory, utilization)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    answer_version(argv, "trainer.compare")
    args = parse_args(argv)
    try:
        diffs, only = compare(
            args.run_a,
            args.run_b,
            atol=args.atol,
            rtol=args.rtol,
            keys=args.keys,
            ignore=args.ignore,
        )
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        print(f"first:  {metrics_file(args.run_a)}\nsecond: {metrics_file(args.run_b)}")
        print(report(diffs, only, args.atol, args.rtol), flush=True)
    except BrokenPipeError:  # `| head`: the reader left; the exit code still tells
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if all(d.within for d in diffs) else EXIT_DIFFERENT


if __name__ == "__main__":
    sys.exit(main())
