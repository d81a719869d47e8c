"""`python -m trainer.report RUN [RUN ...] -o FILE.html`: one self-contained page of runs
(trainer/tracking/report.py builds it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.tracking.report import EXIT_BAD_INPUT, ReportError, build_report
from trainer.version import answer_version


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.report",
        description="One self-contained HTML page of one or more runs: curves (overlaid), "
        "config differences, trainer.compare's table, end summaries.",
    )
    parser.add_argument("runs", nargs="+", help="run directories (or their metrics.jsonl)")
    parser.add_argument("-o", "--output", default="report.html", help="the page to write")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    answer_version(argv, "trainer.report")
    args = parse_args(argv)
    try:
        out = build_report([Path(r) for r in args.runs], Path(args.output))
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:
        print(f"error: cannot write {args.output}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
