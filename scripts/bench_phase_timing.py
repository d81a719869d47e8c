"""What the always-on phase timing costs (engine/timing.py, trainer/tracking/phases.py).

Two measurements on the real trainer (`model=gpt_small` by default):

1. End to end, interleaved A/B rounds in this process: the same run with the timing off
   (`CUMULUS_PHASE_TIMING=0`, the benchmark's switch) and on, alternating which goes first.
   Per run, over the steps after the first two: the median wall time per step from the
   records (`train/step_time_ms`: time between records, a record every step, so the
   record-time reduction is included) and the median CPU time (user+sys) per step.
   Reported: the median on/off ratio over the rounds, min-max in brackets. On a shared machine
   this ratio moves by several percent run to run; the second measurement bounds the cost
   directly.
2. Directly: how many phase switches a step makes (counted in the run), what one switch and one
   record's `collect` cost (timed over many calls), and so the clock's time per step as a
   fraction of the step.

    python scripts/bench_phase_timing.py [--rounds 5] [--steps 12] [--model gpt_small]
        [--out bench_phase_timing.md]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engine.timing import PhaseClock  # noqa: E402


def one_run(model: str, steps: int, timing: bool, root: Path) -> tuple[float, float, int]:
    """(median wall seconds per step, median CPU seconds per step, clock switches per step) of
    one in-process run, over the steps after the first two."""
    from trainer.api import train

    os.environ["CUMULUS_PHASE_TIMING"] = "1" if timing else "0"
    marks: list[tuple[int, float]] = []  # (switches so far, CPU time) at each step's start
    original = PhaseClock.begin_step

    def marking(self: PhaseClock, step: int) -> None:
        marks.append((self.moves, time.process_time()))
        original(self, step)

    PhaseClock.begin_step = marking  # type: ignore[method-assign]
    try:
        records = train(
            [
                f"model={model}",
                "logger=none",
                "train.micro_batch_size=8",
                "train.grad_accum_steps=2",
                f"train.max_steps={steps}",
                "train.log_every=1",
                "eval.every_steps=0",
                "checkpoint.every_steps=0",
                f"data.path={text_file(root)}",
            ],
            run_dir=Path(tempfile.mkdtemp(dir=root)),
        )
    finally:
        PhaseClock.begin_step = original  # type: ignore[method-assign]
    wall = [r["train/step_time_ms"] / 1000 for r in records if "train/step_time_ms" in r]
    cpu = [b[1] - a[1] for a, b in itertools.pairwise(marks)]
    switches = [b[0] - a[0] for a, b in itertools.pairwise(marks)]
    # (CPU: from one step's start to the next's, so steps 2 to N-1.)
    return statistics.median(wall[2:]), statistics.median(cpu[1:]), int(max(switches))


def text_file(root: Path, n_bytes: int = 2_000_000) -> Path:
    """Some of the stdlib's sources as one file: real text that loads in a blink (all of
    `data.path=stdlib` takes seconds per run)."""
    import sysconfig

    path = root / "text.py"
    if not path.exists():
        blob = b""
        for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            blob += source.read_bytes()
            if len(blob) >= n_bytes:
                break
        path.write_bytes(blob[:n_bytes])
    return path


def switch_cost(calls: int = 200_000) -> tuple[float, float]:
    """Seconds per `switch` and per `collect` (the host clock: CPU runs)."""
    clock = PhaseClock(torch.device("cpu"), enabled=True)
    phases = ("data", "compute", "sync", "optimizer")
    start = time.perf_counter()
    for i in range(calls):
        clock.switch(phases[i & 3])
    per_switch = (time.perf_counter() - start) / calls
    start = time.perf_counter()
    for _ in range(calls // 10):
        clock.collect()
    per_collect = (time.perf_counter() - start) / (calls // 10)
    return per_switch, per_collect


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.4f} [{min(values):.4f}-{max(values):.4f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--model", default="gpt_small")
    parser.add_argument("--out", default="bench_phase_timing.md")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    step_ratio, cpu_ratio, switches, step_s = [], [], 0, []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        one_run(args.model, 4, True, root)  # warm-up: imports, allocator, caches
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            result = {t: one_run(args.model, args.steps, t, root) for t in order}
            (off_step, off_cpu, _), (on_step, on_cpu, switches) = result[False], result[True]
            step_ratio.append(on_step / off_step)
            cpu_ratio.append(on_cpu / off_cpu)
            step_s.append(off_step)
            print(
                f"round {r + 1}: step {off_step * 1e3:.1f} ms off, {on_step * 1e3:.1f} ms on "
                f"({on_step / off_step:.4f}); CPU per step {off_cpu * 1e3:.1f} ms off, "
                f"{on_cpu * 1e3:.1f} ms on ({on_cpu / off_cpu:.4f})",
                flush=True,
            )
    per_switch, per_collect = switch_cost()
    step = statistics.median(step_s)
    direct = switches * per_switch + per_collect
    lines = [
        f"### Phase timing overhead: {args.model}, 1 process, CPU",
        "",
        f"{datetime.date.today()}, torch {torch.__version__}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, load average "
        f"{os.getloadavg()[0]:.1f} at the end. Command:",
        "",
        f"    python scripts/bench_phase_timing.py --rounds {args.rounds} --steps {args.steps} "
        f"--model {args.model}",
        "",
        "| measure | timing on / off, median [min-max] over rounds |",
        "| --- | --- |",
        f"| step time (wall, a record every step), median over steps 3-{args.steps} | "
        f"{spread(step_ratio)} |",
        f"| CPU time (user+sys) per step, median over steps 2-{args.steps - 1} | "
        f"{spread(cpu_ratio)} |",
        "",
        f"Direct cost: {switches} phase switches per step (micro 8 x accum 2) at "
        f"{per_switch * 1e6:.2f} us each, plus {per_collect * 1e6:.2f} us to collect a record's "
        f"times: {direct * 1e6:.1f} us per step, {direct / step:.5%} of the {step * 1e3:.0f} ms "
        "step.",
    ]
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
