"""`python -m trainer.report RUN [RUN ...] [-o FILE.html]`: one self-contained page of runs
(trainer/tracking/report.py builds it); without -o, one run's page goes into its own directory.
The full path of the page written is printed."""

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
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        help="the page to write (default: RUN/report.html for one run, the page the run "
        "writes at its end, brought up to date; ./report.html for several)",
    )
    return parser.parse_args(argv)


def default_output(runs: list[Path]) -> Path:
    """Where the page goes without -o: one run's own directory (a metrics.jsonl's folder),
    where the run writes its report; several runs have no one directory: the current one."""
    if len(runs) != 1:
        return Path("report.html")
    run = runs[0]
    return (run if run.is_dir() else run.parent) / "report.html"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    answer_version(argv, "trainer.report")
    args = parse_args(argv)
    runs = [Path(r) for r in args.runs]
    out = Path(args.output) if args.output else default_output(runs)
    try:
        out = build_report(runs, out)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:
        print(f"error: cannot write {out}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
