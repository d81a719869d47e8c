"""Every rank's phase times, made into what a person reads: the slowest rank's time per phase in
every training record (`time/<phase>_s`, `time/<phase>_rank`, and with several ranks the median
and the fastest), a console line when one rank stays the slowest by a clear margin, and a
per-rank table (`time_by_rank.json`, shown in report.html).

The times arrive already reduced: each rank's `PhaseTimes` ride in the record's own loss
all-reduce (trainer/tracking/records.py), one slot per rank, so this needs no collective of its
own but one gather of the host names at the first record.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
from pathlib import Path
from typing import Any, TextIO

from engine.distributed import DistInfo, all_gather_object
from engine.timing import PHASES, STEP_PHASES, WHEN_USED

TABLE_FILE = "time_by_rank.json"
# A rank is named when its time in a phase is at least MARGIN times the other ranks' median and
# FLOOR_S seconds above it, in STREAK records in a row (one slow record is noise, not a rank).
MARGIN = 1.5
FLOOR_S = 0.01
STREAK = 3
# The phases a straggler shows in, and what each says about the slow rank. `sync` is not one:
# the ranks that wait longest inside collectives are the fast ones.
NAMED = {
    "data": "input: its data loader, storage or preprocessing is slower",
    "compute": "compute: its device is slower, throttled or shared, or it has more work",
    "optimizer": "optimizer: its update is slower",
}


def slowest(values: list[float]) -> tuple[int, float, float]:
    """(rank, its value, the median of the other ranks) for the largest of `values`."""
    rank = max(range(len(values)), key=lambda r: (values[r], -r))
    others = values[:rank] + values[rank + 1 :]
    return rank, values[rank], statistics.median(others) if others else values[rank]


def clearly_slowest(values: list[float]) -> int | None:
    """The rank that is slowest by a clear margin (`MARGIN`, `FLOOR_S`), or None."""
    if len(values) < 2:
        return None
    rank, value, median = slowest(values)
    return rank if value >= MARGIN * median and value - median >= FLOOR_S else None


class PhaseTable:
    """Rank 0's view of every rank's phase times over the run (see the module docstring).

    Args:
        info: where this rank runs.
        run_dir: where `time_by_rank.json` goes (None: not written).
        stream: where the straggler lines go (default: stdout).
    """

    def __init__(
        self, info: DistInfo, run_dir: Path | None = None, stream: TextIO | None = None
    ) -> None:
        self.info, self.run_dir, self.stream = info, run_dir, stream
        self.hosts: list[str] | None = None
        world = info.world_size
        self.seconds = [[0.0] * len(PHASES) for _ in range(world)]
        self.steps = [0] * world
        self.slowest_in = [dict.fromkeys(STEP_PHASES, 0) for _ in range(world)]
        self.records = 0
        self.streaks: dict[str, tuple[int, int]] = {}  # phase -> (rank, records in a row)
        # After the last record (the final evaluation and checkpoint): `close`.
        self.final: dict[str, Any] | None = None

    def gather_hosts(self) -> None:
        """Every rank's host name, once (collective: every rank calls it at the first record)."""
        if self.hosts is None:
            self.hosts = all_gather_object(socket.gethostname(), self.info)

    def record(self, per_rank: list[list[float]]) -> dict[str, Any]:
        """The record's `time/*` keys from every rank's `PhaseTimes.as_list()`; also prints a
        straggler line and rewrites the table (rank 0). Returns {} on other ranks."""
        if not self.info.is_main:
            return {}
        keys: dict[str, Any] = {}
        several = len(per_rank) > 1
        for i, phase in enumerate(PHASES):
            occasional = phase not in STEP_PHASES
            # Step phases per optimizer step; checkpoints and evaluations as the time they took.
            values = [row[i] if occasional else row[i] / max(row[-1], 1.0) for row in per_rank]
            if (occasional or phase in WHEN_USED) and not any(values):
                continue
            rank, value, _ = slowest(values)
            keys[f"time/{phase}_s"] = value
            keys[f"time/{phase}_rank"] = rank
            if several:
                keys[f"time/{phase}_median_s"] = statistics.median(values)
                keys[f"time/{phase}_min_s"] = min(values)
            if not occasional:
                clear = clearly_slowest(values)
                if clear is not None:
                    self.slowest_in[clear][phase] += 1
                self._watch(phase, values)
        for r, row in enumerate(per_rank):
            self.seconds[r] = [a + b for a, b in zip(self.seconds[r], row)]
            self.steps[r] += int(row[-1])
        self.records += 1
        self._write_table()
        return keys

    def close(self, per_rank: list[list[float]]) -> dict[str, Any]:
        """At the end of the run, every rank's phase times since the last record: what came
        after it (the final evaluation and checkpoint, whose time no record holds) as the
        slowest rank's seconds and that rank (`eval_s`, `eval_rank`, ...), folded into the
        totals and written as the table's `final`. Returns {} on other ranks."""
        if not self.info.is_main:
            return {}
        final: dict[str, Any] = {}
        for i, phase in enumerate(PHASES):
            values = [row[i] for row in per_rank]
            if phase not in STEP_PHASES and any(values):
                rank, value, _ = slowest(values)
                final[f"{phase}_s"], final[f"{phase}_rank"] = value, rank
        for r, row in enumerate(per_rank):
            self.seconds[r] = [a + b for a, b in zip(self.seconds[r], row)]
            self.steps[r] += int(row[-1])
        if final or self.records:  # (a finished run rerun keeps its table)
            self.final = final
            self._write_table()
        return final

    def _watch(self, phase: str, values: list[float]) -> None:
        """Count the records in a row in which the same rank is clearly the slowest in `phase`;
        at STREAK, say so once (again only after the streak broke)."""
        if phase not in NAMED:
            return
        rank = clearly_slowest(values)
        before, count = self.streaks.get(phase, (None, 0))
        count = count + 1 if rank is not None and rank == before else int(rank is not None)
        self.streaks[phase] = (rank if rank is not None else -1, count)
        if count == STREAK and rank is not None:
            _, value, median = slowest(values)
            host = self.hosts[rank] if self.hosts else "?"
            print(
                f"slowest rank {rank} ({host}): {phase} {value:.2f} s vs median {median:.2f} s "
                f"per step, {STREAK} records in a row ({NAMED[phase]})",
                file=self.stream or sys.stdout,
                flush=True,
            )

    def table(self) -> dict[str, Any]:
        """What `time_by_rank.json` holds: each rank's mean seconds per step in every step
        phase, its checkpoint and evaluation totals (all of them, the final ones included),
        and in how many records it was the slowest by a clear margin (`clearly_slowest`);
        `final`: the final evaluation's and checkpoint's seconds (slowest rank), which come
        after the last record."""
        ranks = []
        for r, row in enumerate(self.seconds):
            steps = max(self.steps[r], 1)
            ranks.append(
                {
                    "rank": r,
                    "host": self.hosts[r] if self.hosts else None,
                    "mean_s": {p: row[i] / steps for i, p in enumerate(STEP_PHASES)},
                    "total_s": {p: row[PHASES.index(p)] for p in PHASES if p not in STEP_PHASES},
                    "slowest_records": self.slowest_in[r],
                }
            )
        table: dict[str, Any] = {"records": self.records, "steps": max(self.steps)}
        if self.final is not None:
            table["final"] = self.final
        return {**table, "ranks": ranks}

    def _write_table(self) -> None:
        if self.run_dir is None:
            return
        path = self.run_dir / TABLE_FILE
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(json.dumps(self.table(), indent=1), encoding="utf-8")
            os.replace(tmp, path)
        except OSError as exc:  # the table is a convenience: never fail a run over it
            print(f"WARNING: {path} not written ({exc})", file=sys.stderr)
