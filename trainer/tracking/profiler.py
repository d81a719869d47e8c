"""`profile=torch`: torch.profiler over optimizer steps `profile.steps=[FIRST, LAST]`.

The profiler's schedule steps once per optimizer step (the fit loop calls `begin` before each
step), with one warm-up step before FIRST when there is one. While it records, the phase clock
(engine/timing.py) opens `record_function` spans for each step, each phase and each micro-batch.
Each profiled rank writes its own gzipped Chrome trace, `RUN_DIR/profile/rank<R>.trace.json.gz`,
and its top operators, `rank<R>.ops.json`, to the run directory itself: no collective, so a slow
writer cannot trip a collective's timeout. At the end of the run rank 0 merges the traces into
`timeline.json.gz` (trainer/tracking/timeline.py) and the summary gets a table of the top
operators per rank. Profiled steps (and the warm-up) are flagged in their record
(`time/profiled`) and left out of throughput and MFU.

`profile.memory=true` (CUDA): the allocator's history is recorded from the start (Python
stacks, the last `profile.memory_entries` events) and a snapshot is dumped on out-of-memory
(`memory_rank<R>_oom.pickle`) and after the profiled steps (`memory_rank<R>.pickle`); open them
at https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.distributed import DistInfo
from engine.timing import PHASES, PhaseClock
from trainer.config.errors import ConfigError
from trainer.config.schema import ProfileCfg
from trainer.tracking.timeline import merge_traces

PROFILE_DIR = "profile"
TIMELINE = "timeline.json.gz"
TOP_OPERATORS = 10
# How long rank 0 waits at the end of the run for the other ranks' traces to appear.
MERGE_WAIT_S = 60.0


# What kineto (torch.profiler's library) writes to stderr, from C++, where tracing starts and
# stops: `USDT:2026-11-28 05:11:54 9019:9019 SyncActivityProfilerHandler.cpp:52] profiler_start`.
KINETO_MARK = re.compile(rb"^USDT:[^\n]*\] profiler_(start|stop)\s*$")


@contextlib.contextmanager
def kineto_marks_dropped() -> Iterator[None]:
    """Around the profiler's start, step and stop: kineto's start and stop lines, which every
    profiled run would print, are left out; whatever else reaches stderr (file descriptor 2)
    meanwhile is written after it, as it came."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines = caught.read().splitlines(keepends=True)
            kept = b"".join(line for line in lines if not KINETO_MARK.match(line))
            if kept:
                os.write(2, kept)


def trace_file(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.trace.json.gz"


def ops_file(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.ops.json"


def is_trainer_span(name: str) -> bool:
    """A span the trainer opened (a step, a phase, a micro-batch), not an operator."""
    head = name.split(" ", 1)[0]
    return head in PHASES or head in ("step", "micro-batch") or name.startswith("ProfilerStep")


class NoProfiler:
    """`profile=none`: nothing is traced."""

    recording = False

    def begin(self, step: int) -> float:
        del step
        return 0.0

    def on_error(self, exc: BaseException) -> None:
        del exc

    def close(self, wait_s: float = MERGE_WAIT_S) -> None:
        del wait_s

    def summary(self) -> list[str]:
        return []


class TorchProfiler(NoProfiler):
    """See the module docstring.

    Args:
        cfg: `profile.*`.
        run_dir: the run directory (traces go to its `profile/`).
        info: where this rank runs.
        clock: the step's phase clock (its spans mark steps, phases and micro-batches).
        max_steps: the run's last step: a window that ends after it is clipped there (one
            that starts after it is refused with the config, trainer/config/schema.py).
    """

    def __init__(
        self,
        cfg: ProfileCfg,
        run_dir: Path,
        info: DistInfo,
        clock: PhaseClock,
        max_steps: int | None = None,
    ) -> None:
        self.first, self.last = cfg.steps
        if max_steps is not None and self.last > max_steps >= self.first:
            if info.is_main and cfg.kind == "torch":
                print(
                    f"profile.steps=[{self.first}, {self.last}] ends after the run's last step "
                    f"(train.max_steps={max_steps}): steps {self.first}-{max_steps} are profiled",
                    flush=True,
                )
            self.last = max_steps
        self.ranks = list(range(info.world_size)) if cfg.ranks is None else sorted(cfg.ranks)
        self.info, self.clock = info, clock
        self.folder = run_dir / PROFILE_DIR
        self.tracing = cfg.kind == "torch"
        self.here = self.tracing and info.rank in self.ranks
        self.cuda = info.device.type == "cuda"
        self.prof: Any = None
        self.done = False
        self.recording = False  # the step about to run is traced (its warm-up included)
        self.memory = cfg.memory and self.cuda
        self.lines: list[str] = []
        if self.here or self.memory:
            self.folder.mkdir(parents=True, exist_ok=True)
        if self.memory:
            self._record_memory(cfg.memory_entries)

    # ---- the schedule ----
    def begin(self, step: int) -> float:
        """Before optimizer step `step`: start, step or stop the profiler. Returns the seconds
        spent writing the trace after the last step, which the caller leaves out of the
        throughput (the profiled steps' own time is left out with them)."""
        if not self.here or self.done:
            return 0.0
        spent = 0.0
        if self.prof is None and self.first - 1 <= step <= self.last:
            self._start(step, warmup=int(step < self.first))
        elif self.prof is not None:
            started = time.perf_counter()
            with kineto_marks_dropped():
                self.prof.step()  # one schedule step per optimizer step
            if step > self.last:
                self._stop()
                spent = time.perf_counter() - started
        self.recording = self.prof is not None
        self.clock.trace(self.recording)
        return spent

    def _start(self, step: int, warmup: int) -> None:
        """Trace from step `step` (a warm-up step first when `warmup`) to the last."""
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        active = self.last - step + 1 - warmup  # fewer when resumed inside the window
        with warnings.catch_warnings():  # no step before the window to warm up on: said here
            warnings.filterwarnings("ignore", "Profiler won't be using warmup")
            self.prof = profile(
                activities=activities,
                schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1),
                on_trace_ready=self._write,
                record_shapes=True,
            )
        with kineto_marks_dropped():
            self.prof.start()
        self.prof.add_metadata_json("cumulus", json.dumps(self._metadata()))  # once started

    def _stop(self) -> None:
        if self.prof is not None:
            with kineto_marks_dropped():
                self.prof.stop()  # writes the trace if the window was cut short
            self.prof = None
        self.clock.trace(False)
        self.recording, self.done = False, True
        if self.memory:
            self._dump_memory(self.folder / f"memory_rank{self.info.rank}.pickle")

    def _metadata(self) -> dict[str, Any]:
        import socket

        return {
            "rank": self.info.rank,
            "world_size": self.info.world_size,
            "host": socket.gethostname(),
            "steps": [self.first, self.last],
        }

    # ---- what each rank writes (never through a collective) ----
    def _write(self, prof: Any) -> None:
        rank = self.info.rank
        path = trace_file(self.folder, rank)
        tmp = path.with_name(f".{path.name}.tmp.gz")
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, path)  # whole or absent: rank 0 merges only finished files
        ops = self._top_operators(prof)
        tmp_ops = ops_file(self.folder, rank).with_suffix(".tmp")
        tmp_ops.write_text(json.dumps(ops), encoding="utf-8")
        os.replace(tmp_ops, ops_file(self.folder, rank))

    def _top_operators(self, prof: Any) -> dict[str, Any]:
        """The operators with the most self time (device time on CUDA) in the window."""

        def self_time(e: Any) -> float:  # microseconds
            return e.self_device_time_total if self.cuda else e.self_cpu_time_total

        events = [e for e in prof.key_averages() if not is_trainer_span(e.key)]
        total = sum(self_time(e) for e in events) or 1.0
        top = sorted(events, key=self_time, reverse=True)[:TOP_OPERATORS]
        return {
            "rank": self.info.rank,
            "time": "device" if self.cuda else "CPU",
            "total_s": total / 1e6,
            "operators": [
                {
                    "name": e.key,
                    "self_s": self_time(e) / 1e6,
                    "share": self_time(e) / total,
                    "calls": e.count,
                }
                for e in top
            ],
        }

    # ---- CUDA memory ----
    def _record_memory(self, entries: int) -> None:
        torch.cuda.memory._record_memory_history(max_entries=entries, stacks="python")
        observe = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if observe is not None:
            observe(self._on_oom)

    def _on_oom(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        del device, alloc, device_alloc, device_free
        self._dump_memory(self.folder / f"memory_rank{self.info.rank}_oom.pickle")

    def _dump_memory(self, path: Path) -> None:
        try:
            torch.cuda.memory._dump_snapshot(str(path))
            print(f"[rank {self.info.rank}] CUDA memory snapshot: {path}", file=sys.stderr)
        except Exception as exc:  # a diagnostic: never the reason a run fails
            print(f"WARNING: memory snapshot {path} not written ({exc})", file=sys.stderr)

    def on_error(self, exc: BaseException) -> None:
        """The run failed with `exc`: an out-of-memory error gets its snapshot (when the
        allocator's own observer did not already write one)."""
        oom = self.folder / f"memory_rank{self.info.rank}_oom.pickle"
        if self.memory and isinstance(exc, torch.OutOfMemoryError) and not oom.exists():
            self._dump_memory(oom)

    # ---- the end of the run ----
    def close(self, wait_s: float = MERGE_WAIT_S) -> None:
        """Stop (a window the run ended inside is written as it is); rank 0 merges every
        profiled rank's trace into timeline.json.gz and reads their top operators."""
        if self.prof is not None:
            self._stop()
        if self.memory:
            torch.cuda.memory._record_memory_history(enabled=None)
        # Traces exist once a rank has begun the window (its warm-up step included).
        if not self.info.is_main or not self.tracing or self.clock.step < self.first - 1:
            return
        traces = self._wait_for_traces(wait_s)
        if not traces:
            return
        try:
            merged = merge_traces(traces, self.folder / TIMELINE)
        except (OSError, ValueError) as exc:
            print(f"WARNING: {self.folder / TIMELINE} not written ({exc})", file=sys.stderr)
            return
        missing = sorted(set(self.ranks) - set(traces))
        self.lines = [
            f"  profile: steps {self.first}-{self.last} of rank(s) "
            f"{_ranks(sorted(traces))}: {merged} (one process per rank; open it in "
            "Perfetto, ui.perfetto.dev)"
            + (f"; no trace from rank(s) {_ranks(missing)}" if missing else ""),
            *operator_table(self.folder, sorted(traces)),
        ]

    def _wait_for_traces(self, wait_s: float) -> dict[int, Path]:
        """The profiled ranks' trace files, waiting up to `wait_s` for late writers."""
        deadline = time.monotonic() + wait_s
        while True:
            found = {r: trace_file(self.folder, r) for r in self.ranks}
            found = {r: p for r, p in found.items() if p.is_file()}
            if len(found) == len(self.ranks) or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    def summary(self) -> list[str]:
        return self.lines


def operator_table(folder: Path, ranks: list[int], per_rank: int = 3) -> list[str]:
    """A short table of each rank's top operators by self time."""
    rows: list[tuple[str, str, str, str]] = []
    unit = "CPU"
    for rank in ranks:
        try:
            ops = json.loads(ops_file(folder, rank).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        unit = ops.get("time", unit)
        for i, op in enumerate(ops["operators"][:per_rank]):
            name = op["name"] if len(op["name"]) <= 48 else op["name"][:47] + "…"
            rows.append(
                (
                    str(rank) if i == 0 else "",
                    name,
                    f"{op['self_s'] * 1e3:.1f} ms",
                    f"{op['share']:.0%}",
                )
            )
    if not rows:
        return []
    width = max(len("operator"), *(len(r[1]) for r in rows))
    head = f"    {'rank':<5} {'operator':<{width}} {'self ' + unit:>10} {'share':>6}"
    return [head] + [f"    {a:<5} {b:<{width}} {c:>10} {d:>6}" for a, b, c, d in rows]


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))


def build_profiler(
    cfg: ProfileCfg, run_dir: Path, info: DistInfo, clock: PhaseClock, max_steps: int | None = None
) -> Any:
    """The run's profiler: `TorchProfiler` for profile=torch or profile.memory=true; a window
    past `max_steps` is clipped at it."""
    bad = [r for r in cfg.ranks or [] if r >= info.world_size]
    if bad:
        raise ConfigError(
            "profile.ranks",
            f"rank(s) {_ranks(bad)} do not exist in a world of {info.world_size} "
            f"(valid: 0-{info.world_size - 1}, or null for every rank)",
        )
    if cfg.memory and info.device.type != "cuda" and info.is_main:
        print(
            "WARNING: profile.memory=true records CUDA memory; this run has no CUDA device, "
            "so no memory snapshot will be written",
            file=sys.stderr,
        )
    if cfg.kind == "none" and not (cfg.memory and info.device.type == "cuda"):
        return NoProfiler()
    return TorchProfiler(cfg, run_dir, info, clock, max_steps)
