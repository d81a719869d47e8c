"""Naming a hung rank: when a collective times out (`dist.timeout_s`), the ranks that arrived
end the job with one paragraph that names the rank(s) that did not join, the collective and
the step, and leave a dump in `RUN_DIR/hang/`.

Every rank runs a `CollectiveWatch` thread. Every `period_s` it publishes where its rank is to
the rendezvous store (`cumulus/watch/pos/<rank>`, only when it changed): the optimizer step and
phase (engine/timing.py's clock), the collective it waits in, and how many collectives it has
issued on each process group (torch's per-group sequence numbers, which count every
collective, DDP's bucketed all-reduces included). A rank stuck outside any collective (asleep,
in a deadlock, in a stalled read) keeps its last position, published before it got stuck.

When a collective times out on a rank that arrived, its exception reaches `explain`: the
collective it waited in comes from torch's flight recorder (gloo and NCCL record every
collective in torch 2.13: its name, group, sequence number and sizes); the ranks of that
group whose published sequence number is below it never issued it. Where the backend records
nothing, cumulus's own sequence numbers (collectives entered through the clock) are compared
instead. The first arrived rank to publish its verdict (`compare_set`) says the paragraph; the
others stay silent. The watch thread of a rank named in the verdict writes its own dump (with
its main thread's stack: where it is stuck) and ends its process, so the job ends within
`dist.timeout_s` plus a few seconds, not when the hung rank wakes up. Checkpoints are committed
by one rename: every one already written stays valid.

NCCL may never raise in the main thread (its watchdog aborts the process instead): there the
watch thread itself declares the verdict when its rank has not moved for `dist.timeout_s`
while other ranks are behind it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.config.errors import UserError

if TYPE_CHECKING:
    from engine.distributed import DistInfo
    from engine.timing import PhaseClock

PREFIX = "cumulus/watch"
DUMP_DIR = "hang"
EXIT_HUNG = 3  # the named rank's own exit status


class RankHung(UserError):
    """A collective timed out because rank(s) did not join. The watch has already printed it
    on the one arrived rank that says it (`printed`): every rank stays `quiet` after."""

    all_ranks = False
    quiet = True

    def __init__(self, message: str, printed: bool) -> None:
        super().__init__(message)
        self.printed = printed


def is_timeout(exc: BaseException) -> bool:
    """A collective that gave up waiting (gloo: "Timed out waiting ... for recv"; NCCL's
    watchdog: "Watchdog caught collective operation timeout")."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).lower()
        if "timed out" in text or "timeout" in text:
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


@dataclass
class Verdict:
    """Who did not join what."""

    missing: list[int]  # the ranks that never issued the collective
    collective: str  # what it was, in words
    group: str  # the process group's name
    seq: int  # its sequence number in that group (or cumulus's own)
    step: int  # the step the arrived rank was in
    where: str  # what the arrived rank was doing, in words
    source: str  # "flight recorder" or "cumulus sequence numbers"


def phase_words(phase: str | None, waiting_in: str | None) -> str:
    """Where a rank is, in the phase clock's names (engine/timing.py), as its timers count it
    and its trace labels it: `phase sync (gradient sync)` inside a collective."""
    if waiting_in:
        return f"phase sync ({waiting_in})"
    return f"phase {phase or 'between steps'}"


def _groups() -> dict[str, Any]:
    """This rank's process groups by name (the default group is "0")."""
    from torch.distributed import distributed_c10d as c10d

    return {name: pg for pg, name in list(c10d._world.pg_names.items())}


def _sequence_numbers() -> dict[str, int]:
    """How many collectives this rank has issued on each of its process groups."""
    out = {}
    for name, pg in _groups().items():
        with contextlib.suppress(Exception):  # a backend without sequence numbers
            out[name] = int(pg._get_sequence_number_for_group())
    return out


def flight_recorder() -> list[dict[str, Any]]:
    """This rank's flight-recorder entries (torch's record of its collectives), oldest first;
    [] where the backend records none."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        entries = json.loads(_dump_fr_trace_json(True, False)).get("entries", [])
    except Exception:
        return []
    return sorted(entries, key=lambda e: e.get("record_id", 0))


def _group_of(entry: dict[str, Any]) -> str:
    group = entry.get("process_group") or ["0"]
    return str(group[0])


def describe_entry(entry: dict[str, Any]) -> str:
    """`gloo:all_reduce (1 tensor, 52 KB)` from a flight-recorder entry."""
    sizes = entry.get("input_sizes") or []
    dtypes = entry.get("input_dtypes") or []
    width = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4}
    nbytes = 0
    for shape, dtype in zip(sizes, dtypes):
        n = 1
        for d in shape:
            n *= int(d)
        nbytes += n * width.get(dtype, 4)
    what = f"{len(sizes)} tensor{'s' if len(sizes) != 1 else ''}, {_bytes(nbytes)}"
    return f"{entry.get('profiling_name', '?')} ({what})"


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


class CollectiveWatch:
    """See the module docstring.

    Args:
        info: where this rank runs (a watch runs only with several ranks).
        run_dir: where `hang/` dumps go.
        timeout_s: `dist.timeout_s`.
        period_s: how often the position is published (default: timeout / 20, 0.5-5 s).
    """

    def __init__(
        self, info: DistInfo, run_dir: Path, timeout_s: float, period_s: float | None = None
    ) -> None:
        import torch.distributed as dist

        self.info, self.run_dir, self.timeout_s = info, run_dir, timeout_s
        self.period_s = period_s or min(max(timeout_s / 20, 0.5), 5.0)
        # Per launch attempt: torchrun's agent keeps its store across restarts.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.store = dist.PrefixStore(
            f"{PREFIX}/{attempt}", dist.distributed_c10d._get_default_store()
        )
        self.backend = str(dist.get_backend())
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.clock: PhaseClock | None = None
        self.newest_checkpoint: Any = None  # a callable giving the newest committed path
        self._published: dict[str, Any] | None = None
        self._moved_at = time.monotonic()
        self._last_fingerprint: Any = None
        self._declared = threading.Lock()
        self._named = False  # this rank has declared a verdict: the thread stays quiet
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name="collective-watch", daemon=True)
        self._thread.start()

    def follow(self, clock: PhaseClock, newest_checkpoint: Any = None) -> None:
        """Publish the run's position from `clock` from now on."""
        self.clock, self.newest_checkpoint = clock, newest_checkpoint

    def stop(self) -> None:
        """End the thread and wait for it. A daemon thread still inside a call into the store's
        C++ client when the interpreter finalizes is ended by pthread_exit as it takes the GIL
        back, whose unwinding through pybind11's noexcept frames aborts the process
        ("terminate called without an active exception", SIGABRT at the end of a run)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(30.0, 3 * self.period_s))

    # ---- the rank's position ----
    def position(self) -> dict[str, Any]:
        clock = self.clock
        return {
            "rank": self.info.rank,
            "host": self.host,
            "pid": self.pid,
            "step": clock.step if clock else 0,
            "phase": (clock.phase or "between steps") if clock else "start-up",
            "waiting_in": (clock.waiting_in or clock.failed_in) if clock else None,
            "seq": clock.seq if clock else 0,
            "groups": _sequence_numbers(),
        }

    def _publish(self, force: bool = False) -> dict[str, Any]:
        pos = self.position()
        fingerprint = (pos["step"], pos["phase"], pos["seq"], tuple(sorted(pos["groups"].items())))
        if fingerprint != self._last_fingerprint:
            self._last_fingerprint, self._moved_at = fingerprint, time.monotonic()
        if force or pos != self._published:
            self.store.set(f"pos/{self.info.rank}", json.dumps({**pos, "time": time.time()}))
            self._published = pos
        return pos

    def positions(self) -> dict[int, dict[str, Any]]:
        """Every rank's last published position (ranks that published none are absent)."""
        keys = [f"pos/{r}" for r in range(self.info.world_size)]
        present = [k for k in keys if self.store.check([k])]
        values = self.store.multi_get(present) if present else []
        out = {}
        for key, value in zip(present, values):
            with contextlib.suppress(ValueError):
                out[int(key.split("/")[1])] = json.loads(value)
        return out

    # ---- the thread ----
    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._publish()
                if self.store.check(["verdict"]):
                    self._obey(json.loads(self.store.get("verdict")))
                elif self._stalled() and not self._named:
                    self._declare_from_thread()
            except Exception:  # the store went away with the job: nothing left to watch
                if self._stop.wait(self.period_s):
                    return

    def _stalled(self) -> bool:
        """This rank has not moved for long enough that its collective must have failed: the
        timeout itself where no exception reaches Python (NCCL's watchdog aborts instead), a
        little later under gloo (whose exception normally comes first)."""
        limit = self.timeout_s + (3 * self.period_s if self.backend == "gloo" else 0.0)
        return time.monotonic() - self._moved_at > limit

    def _declare_from_thread(self) -> None:
        verdict = self.verdict()
        if verdict is None or self.info.rank in verdict.missing:
            return  # nobody is behind this rank, or this rank is the one behind
        self._declare(verdict)
        os._exit(EXIT_HUNG)

    def _obey(self, verdict: dict[str, Any]) -> None:
        """Another rank named the ranks that did not join: if this is one of them, leave a
        dump of where it is stuck and end the process (the job ends now, not when it wakes)."""
        if self.info.rank not in verdict.get("missing", []):
            return
        path = self._dump({"verdict": verdict, "stack": self._main_stack()})
        print(
            f"[rank {self.info.rank}] rank {verdict.get('by')} named this rank as not joining "
            f"{verdict.get('collective')} at step {verdict.get('step')}; exiting (where it was "
            f"stuck: {path})",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_HUNG)

    def _main_stack(self) -> list[str]:
        frame = sys._current_frames().get(self._main or -1)
        return traceback.format_stack(frame) if frame is not None else []

    # ---- the verdict ----
    def verdict(self) -> Verdict | None:
        """Who did not join the collective this rank waits in (None: nobody is behind)."""
        me = self._publish(force=True)
        time.sleep(min(self.period_s, 2.0))  # ranks that arrived last publish it too
        positions = self.positions()
        positions[self.info.rank] = me
        clock = self.clock
        step = clock.step if clock else 0
        where = self._where(clock)
        # torch's sequence numbers: a rank of the group that issued fewer collectives than
        # this one never reached the one this rank waits in. The group of this rank's latest
        # collective is looked at first; the flight recorder names the collective.
        entries = flight_recorder()
        recorded = {(_group_of(e), e.get("collective_seq_id")): e for e in entries}
        latest = _group_of(entries[-1]) if entries else "0"
        for group in sorted(me["groups"], key=lambda g: (g != latest, g)):
            issued = {r: positions.get(r, {}).get("groups", {}).get(group) for r in positions}
            mine = me["groups"][group]
            missing = [r for r in self._ranks_of(group) if (issued.get(r) or 0) < mine]
            if missing:
                seq = min(issued.get(r) or 0 for r in missing) + 1  # the first one not issued
                entry = recorded.get((group, seq))
                what = describe_entry(entry) if entry else f"#{seq}"
                source = "flight recorder" if entry else "torch's sequence numbers"
                return Verdict(missing, what, group, seq, step, where, source)
        waited = (clock.waiting_in or clock.failed_in) if clock is not None else None
        if clock is not None and waited is not None:
            entered = {r: positions[r].get("seq", -1) for r in positions}
            missing = [r for r in range(self.info.world_size) if entered.get(r, -1) < clock.seq]
            if missing:
                what, source = waited, "cumulus sequence numbers"
                return Verdict(missing, what, "0", clock.seq, step, where, source)
        return None

    def _ranks_of(self, group: str) -> list[int]:
        import torch.distributed as dist

        pg = _groups().get(group)
        if pg is None:
            return list(range(self.info.world_size))
        return list(dist.get_process_group_ranks(pg))

    @staticmethod
    def _where(clock: PhaseClock | None) -> str:
        if clock is None:
            return "while the run was being built"
        waited = clock.waiting_in or clock.failed_in  # a collective that timed out: unwound
        return f"in step {clock.step}, {phase_words(clock.phase, waited)}"

    def explain(self, exc: BaseException) -> RankHung | None:
        """The paragraph for a collective that timed out in the main thread (None: not a
        timeout, or nobody is behind this rank: the error stays as it is)."""
        if not is_timeout(exc):
            return None
        try:
            verdict = self.verdict()
        except Exception:
            return None
        if verdict is None or self.info.rank in verdict.missing:
            return None
        paragraph, speaker = self._declare(verdict)
        return RankHung(paragraph, printed=speaker)

    def _declare(self, verdict: Verdict) -> tuple[str, bool]:
        """The first arrived rank to get here says the paragraph; then the hung ranks are
        told (`verdict` in the store) and end, which ends the job. Every arrived rank dumps.
        Returns the paragraph and whether this rank said it."""
        with self._declared:
            self._named = True
            mine = json.dumps(
                {**verdict.__dict__, "by": self.info.rank, "time": time.time()}, default=str
            )
            winner = self.store.compare_set("speaker", "", mine)
            speaker = (winner.decode() if isinstance(winner, bytes) else winner) == mine
            positions = self.positions()
            dump = self._dump(
                {
                    "verdict": verdict.__dict__,
                    "positions": positions,
                    "flight_recorder": flight_recorder(),
                }
            )
            paragraph = self._paragraph(verdict, positions, dump)
            if speaker:  # before the hung rank ends: the launcher then stops everyone
                print(f"error (rank {self.info.rank}): {paragraph}", file=sys.stderr, flush=True)
                self.store.set("verdict", mine)
            return paragraph, speaker

    def _dump(self, content: dict[str, Any]) -> Path:
        folder = self.run_dir / DUMP_DIR
        path = folder / f"rank{self.info.rank}.json"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(
                json.dumps({"rank": self.info.rank, "host": self.host, **content}, default=str),
                encoding="utf-8",
            )
            os.replace(tmp, path)
        except OSError as exc:
            print(f"WARNING: {path} not written ({exc})", file=sys.stderr)
        return path

    def _paragraph(self, v: Verdict, positions: dict[int, dict[str, Any]], dump: Path) -> str:
        def who(r: int) -> str:
            pos = positions.get(r)
            if pos is None:
                return f"rank {r} (never reported where it was)"
            seen = time.time() - float(pos.get("time", time.time()))
            where = phase_words(pos.get("phase"), pos.get("waiting_in"))
            return (
                f"rank {r} (host {pos.get('host')}, pid {pos.get('pid')}: last seen "
                f"{seen:.0f} s ago in step {pos.get('step')}, {where})"
            )

        names = ", ".join(who(r) for r in v.missing)
        plural = len(v.missing) > 1
        group = "the default process group" if v.group == "0" else f"process group {v.group}"
        newest = self.newest_checkpoint() if callable(self.newest_checkpoint) else None
        saved = (
            f"The checkpoints already written are intact; the newest is {newest}, and rerunning "
            "the same command resumes from it."
            if newest is not None
            else "No checkpoint of this run had been committed yet."
        )
        return (
            f"{names} {'were' if plural else 'was'} hung: {'they' if plural else 'it'} did not "
            f"join collective {v.collective}, number {v.seq} of {group} ({v.source}), which "
            f"rank {self.info.rank} entered {v.where} and waited in for dist.timeout_s="
            f"{self.timeout_s:g} s. The job is ending. Where every rank was and this rank's "
            f"record of collectives are in {dump.parent}/ ({dump.name}; the hung rank's own "
            f"file holds its stack). {saved} Find what the hung rank was doing (a stalled data "
            "read, a deadlock in user code, a slow or failing device), or raise dist.timeout_s "
            "if a step can legitimately take longer."
        )


def start_watch(info: DistInfo, run_dir: Path, timeout_s: float) -> CollectiveWatch | None:
    """A watch for a run of several ranks; None on one process (nothing to wait for)."""
    if not info.distributed:
        return None
    try:
        return CollectiveWatch(info, run_dir, timeout_s)
    except Exception as exc:  # no store to publish to (a custom backend): run unwatched
        print(f"WARNING: hung ranks will not be named ({exc})", file=sys.stderr)
        return None
