"""What fault tolerance (`ft=torchft`, docs/guides/fault-tolerance.md) costs, on this machine.

1. Overhead, no failure: 2 replica groups of 1 process each (ft, a lighthouse on 127.0.0.1),
   their quorum formed during the first forward (the default) and blocking before the step
   (`ft.async_quorum=false`), against 2 DDP ranks under torchrun, the same model and global
   batch; rounds interleaved (which goes first rotates). Per run: the median of
   `train/step_time_ms` over the records after the first 3, and the CPU time (user+sys) of
   every process of the run (the lighthouse's, torchrun's agent's) per step from the 3rd
   record to the last (read from /proc: start-up and the end left out).
2. One failure: the wall time a run loses to one SIGKILL at step `--kill`: the killed
   run's wall time beyond its steps at its own median step time, minus the same of the run
   uninterrupted (both to the same last step; each run's own step time, because the load of
   a shared machine drifts from run to run), also counted in steps:
   - ft: group 1 killed (from outside, when metrics.jsonl shows the step) and started again
     by the bench at once; the live group redoes the step and goes on; group 1 takes its
     state when it is back. Also the records' `ft/lost_s` (the stalled step).
   - torchrun: 2 DDP ranks with `--max-restarts=1` and a checkpoint every `--every` steps;
     rank 1 killed at the same step: the agent restarts both, and they redo the steps since
     the checkpoint.

    python scripts/bench_ft.py [--rounds 3] [--steps 30] [--model gpt_small]
        [--fail-steps 100 --kill 75 --every 50] [--out bench_ft.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
PYTHON = sys.executable

from scripts.bench_phase_timing import text_file  # noqa: E402  (some stdlib sources, one file)


def train_args(args: argparse.Namespace, root: Path, run_dir: Path, steps: int) -> list[str]:
    return [
        f"model={args.model}",
        "logger=none",
        f"data.path={text_file(root)}",
        f"train.micro_batch_size={args.micro}",
        f"train.global_batch_size={args.global_batch}",
        f"train.max_steps={steps}",
        "train.log_every=1",
        "eval.every_steps=0",
        f"hydra.run.dir={run_dir}",
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]  # a line without its newline may be half-written
    return [r for r in map(json.loads, lines) if "train/loss" in r]


class Run:
    """One run's processes (started with `start`), its wall time to the last record and the
    CPU time of all of them."""

    def __init__(self, run_dir: Path, steps: int) -> None:
        self.run_dir, self.steps = run_dir, steps
        self.procs: list[subprocess.Popen] = []
        self.cpu0 = self._children_cpu()
        self.began = time.perf_counter()

    @staticmethod
    def _children_cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    def start(self, cmd: list[str], **env: str) -> subprocess.Popen:
        environ = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", **env}
        log = (self.run_dir.parent / f"{self.run_dir.name}-{len(self.procs)}.log").open("w")
        proc = subprocess.Popen(cmd, cwd=REPO, env=environ, stdout=log, stderr=log)
        self.procs.append(proc)
        return proc

    def wait_step(self, step: int, timeout: float = 1800) -> None:
        deadline = time.monotonic() + timeout
        while not any(r["step"] >= step for r in train_steps(self.run_dir)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.run_dir}: step {step} not reached")
            time.sleep(0.05)

    def tree_cpu(self) -> float:
        """CPU seconds (user+sys) the run's live processes and their children have used."""
        total, seen = 0.0, set()
        todo = [p.pid for p in self.procs if p.poll() is None]
        tick = os.sysconf("SC_CLK_TCK")
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                todo += [
                    int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                ]
            except (OSError, ValueError):
                continue
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        return total

    def steady_cpu(self, first: int) -> float:
        """CPU seconds of every process per step from record `first` to the last (start-up
        and the final save left out)."""
        self.wait_step(first)
        start = self.tree_cpu()
        self.wait_step(self.steps)
        return (self.tree_cpu() - start) / (self.steps - first)

    def finish(self) -> tuple[float, float]:
        """(wall seconds to the last step's record, CPU seconds of every process)."""
        self.wait_step(self.steps)
        wall = time.perf_counter() - self.began
        for proc in self.procs:
            if proc.poll() is None and proc.args[2] == "trainer.lighthouse":
                proc.terminate()
            proc.wait()
        return wall, self._children_cpu() - self.cpu0


def worker_pids(agent: int) -> list[int]:
    """torchrun's workers: the agent's child processes."""
    children = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
    return [int(pid) for pid in children]


def ft_run(
    args: argparse.Namespace,
    root: Path,
    name: str,
    steps: int,
    kill: int | None,
    extra: tuple[str, ...] = (),
) -> Run:
    """2 groups of 1 process and their lighthouse; with `kill`, group 1 is SIGKILLed when
    step `kill` is recorded and started again at once. `extra`: overrides of both groups."""
    run_dir = root / name
    run = Run(run_dir, steps)
    port = free_port()
    lighthouse = [PYTHON, "-m", "trainer.lighthouse", f"--port={port}", "--bind=127.0.0.1"]
    run.start([*lighthouse, "--heartbeat-timeout-s=1", "--join-timeout-s=5"])
    group = [
        PYTHON,
        "-m",
        "trainer.train",
        *train_args(args, root, run_dir, steps),
        f"checkpoint.every_steps={args.every}",
        "ft=torchft",
        f"ft.lighthouse=http://127.0.0.1:{port}",
        "ft.groups=2",
        f"ft.timeout_s={args.timeout}",
        *extra,
    ]
    victim = None
    for g in (0, 1):
        proc = run.start([*group, f"ft.group={g}"])
        victim = proc if g == 1 else victim
    if kill is not None and victim is not None:
        run.wait_step(kill)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        run.start([*group, "ft.group=1"])
    return run


def ddp_run(args: argparse.Namespace, root: Path, name: str, steps: int, kill: int | None) -> Run:
    """2 DDP ranks under torchrun --max-restarts=1; with `kill`, rank 1 is SIGKILLed when step
    `kill` is recorded (the agent restarts both, from the newest checkpoint)."""
    run_dir = root / name
    run = Run(run_dir, steps)
    agent = run.start(
        [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "--max-restarts=1",
            "-m",
            "trainer.train",
            *train_args(args, root, run_dir, steps),
            f"checkpoint.every_steps={args.every}",
        ]
    )
    if kill is not None:
        run.wait_step(kill)
        os.kill(worker_pids(agent.pid)[-1], signal.SIGKILL)
    return run


# The overhead's kinds: DDP, ft with its quorum formed during the first forward (the
# default), ft with every quorum blocking before the step.
KINDS = ("ddp", "ft", "ft_blocking")


def overhead_run(
    args: argparse.Namespace, root: Path, kind: str, r: int
) -> tuple[float, float, float]:
    """(median step ms after the first 3 records, CPU ms per step, ms per step the steps
    waited for the quorum after the first 3 records: `ft/quorum_wait_s`) of one run."""
    name = f"overhead-{kind}-{r}"
    if kind == "ddp":
        run = ddp_run(args, root, name, args.steps, None)
    else:
        blocking = ("ft.async_quorum=false",) if kind == "ft_blocking" else ()
        run = ft_run(args, root, name, args.steps, None, blocking)
    cpu = run.steady_cpu(first=3)
    run.finish()
    records = train_steps(run.run_dir)
    step_ms = statistics.median(rec["train/step_time_ms"] for rec in records[3:])
    waits = [rec.get("ft/quorum_wait_s", 0.0) for rec in (records[2], records[-1])]
    steps = records[-1]["step"] - records[2]["step"]
    return step_ms, cpu * 1000, (waits[1] - waits[0]) / steps * 1000


def overhead(args: argparse.Namespace, root: Path) -> list[str]:
    """Step time and CPU per step, ft (its quorum formed during the forward, and blocking)
    against DDP, interleaved rounds (the order rotates)."""
    ratios: dict[str, list[float]] = {k: [] for k in KINDS[1:]}
    waits: dict[str, list[float]] = {k: [] for k in KINDS[1:]}
    cpu_ratios: dict[str, list[float]] = {k: [] for k in KINDS[1:]}
    lines = []
    for r in range(args.rounds):
        order = KINDS[r % 3 :] + KINDS[: r % 3]
        got = {kind: overhead_run(args, root, kind, r) for kind in order}
        cells = [f"{got['ddp'][0]:.1f}"]
        for kind in KINDS[1:]:
            ratios[kind].append(got[kind][0] / got["ddp"][0])
            cpu_ratios[kind].append(got[kind][1] / got["ddp"][1])
            cells += [f"{got[kind][0]:.1f}", f"{ratios[kind][-1]:.3f}"]
        cells.append(f"{got['ddp'][1]:.0f}")
        for kind in KINDS[1:]:
            cells += [f"{got[kind][1]:.0f}", f"{cpu_ratios[kind][-1]:.3f}"]
        for kind in KINDS[1:]:
            waits[kind].append(got[kind][2])
            cells.append(f"{got[kind][2]:.2f}")
        lines.append(f"| {r + 1} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    head = [
        "| round | DDP step ms | ft step ms | ratio | ft blocking step ms | ratio "
        "| DDP CPU ms/step | ft CPU ms/step | ratio | ft blocking CPU ms/step | ratio "
        "| ft quorum wait ms/step | ft blocking quorum wait ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    tail = (
        f"| median (min-max) | | | {spread(ratios['ft'])} | | {spread(ratios['ft_blocking'])} "
        f"| | | {spread(cpu_ratios['ft'])} | | {spread(cpu_ratios['ft_blocking'])} "
        f"| {spread(waits['ft'], 2)} | {spread(waits['ft_blocking'], 2)} |",
    )
    return [*head, *lines, *tail]


def beyond_steps(run: Run, wall: float) -> tuple[float, float]:
    """(the run's median step time, its wall time beyond `steps` x that median): what the
    run spent on anything but steady steps (start-up, the final save, a restart, redone
    steps), in its own step time, so that a machine whose load drifts from one run to the
    next still compares."""
    median = statistics.median(r["train/step_time_ms"] / 1000 for r in train_steps(run.run_dir))
    return median, wall - run.steps * median


def failure(args: argparse.Namespace, root: Path) -> list[str]:
    """Wall time lost to one kill: ft vs torchrun's restart from a checkpoint. `lost` is the
    killed run's time beyond its steady steps minus the uninterrupted run's (`beyond_steps`),
    also in steps of the killed run."""
    rows = []
    for kind, starter in (("ft", ft_run), ("torchrun", ddp_run)):
        clean_run = starter(args, root, f"fail-{kind}-clean", args.fail_steps, None)
        clean = clean_run.finish()[0]
        killed_run = starter(args, root, f"fail-{kind}-killed", args.fail_steps, args.kill)
        killed = killed_run.finish()[0]
        (_, clean_extra), (step_s, killed_extra) = (
            beyond_steps(clean_run, clean),
            beyond_steps(killed_run, killed),
        )
        lost = killed_extra - clean_extra
        records = train_steps(killed_run.run_dir)
        steps = [r["step"] for r in records]
        lost_s = records[-1].get("ft/lost_s")
        stalled = f"{lost_s:.2f}" if lost_s is not None else "-"
        rows.append(
            f"| {kind} | {clean:.1f} | {killed:.1f} | {step_s:.2f} | {lost:.1f} "
            f"({lost / step_s:.1f} steps) | {stalled} | {len(steps)} records, "
            f"{len(set(steps))} steps |"
        )
        print(rows[-1], flush=True)
    head = [
        "| kind | uninterrupted s | one kill s | its step s | lost s | stalled step s "
        "(ft/lost_s) | metrics.jsonl |",
        "|---|---|---|---|---|---|---|",
    ]
    return [*head, *rows]


def spread(values: list[float], digits: int = 3) -> str:
    median, low, high = statistics.median(values), min(values), max(values)
    return f"{median:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", default="gpt_small")
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--fail-steps", type=int, default=100)
    parser.add_argument("--kill", type=int, default=75)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--only", choices=["overhead", "failure"], default=None)
    parser.add_argument("--out", default="bench_ft.md")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        out = [
            f"{datetime.date.today()}, torch on CPU, OMP_NUM_THREADS=1, {args.model}, micro "
            f"{args.micro}, global batch {args.global_batch}, load average at the start "
            f"{load:.1f}. Command: `python scripts/bench_ft.py {' '.join(sys.argv[1:])}`",
            "",
        ]
        if args.only in (None, "overhead"):
            out += [
                "No failure: 2 groups x 1 process (ft, async and blocking quorums) vs 2 DDP ranks",
                "",
                *overhead(args, root),
                "",
            ]
        if args.only in (None, "failure"):
            out += [
                f"One SIGKILL at step {args.kill} of {args.fail_steps} (checkpoint every "
                f"{args.every} steps)",
                "",
                *failure(args, root),
            ]
    Path(args.out).write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
