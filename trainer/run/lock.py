"""One launch per run directory: a lock file that rank 0 holds for the run's lifetime.

Two launches on one run directory (a SLURM requeue while the old job still runs, a command
submitted twice) would append to the same `metrics.jsonl` and write into the same
`checkpoints/`. The lock is a file created exclusively, holding who took it; a heartbeat
thread touches it every `HEARTBEAT_S`. A lock is stale, and taken over, when its holder is
known to be gone:

- same host, and that pid no longer runs (or runs another program: its start time differs);
- the same torchrun job restarting its workers (`TORCHELASTIC_RUN_ID` equal and
  `TORCHELASTIC_RESTART_COUNT` > 0: the agent stopped the old workers, whose heartbeat
  stops within `HEARTBEAT_S`);
- another host, and no heartbeat for `STALE_AFTER_S` (the holder's node is lost). Ages are
  measured against a file written just now on the same filesystem, so clocks of different
  nodes never compare.

The lock is written complete under a name of its own and hard-linked into place (exclusive
and atomic on local filesystems and NFS), so it is never seen half-written.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from engine.distributed import DistInfo, broadcast_object
from trainer.config.errors import UserError

LOCK_NAME = ".cumulus.lock"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 90.0


class RunDirInUse(UserError):
    """Another live launch holds the run directory."""

    all_ranks = True


def _proc_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), to tell a reused pid apart;
    None where /proc is unavailable or the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the command name


def _pid_alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    now = _proc_start(pid) if start is not None else None
    return now is None or now == start  # unreadable (hidepid): kill() says it exists


def _fs_now(directory: Path) -> float:
    """The current time as the filesystem holding `directory` stamps files."""
    probe = directory / f"{LOCK_NAME}.probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.touch()
        return probe.stat().st_mtime
    except OSError:
        return time.time()
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


class RunLock:
    """The lock of `run_dir`; `acquire` raises `RunDirInUse` naming a live holder."""

    def __init__(self, run_dir: Path, name: str = LOCK_NAME) -> None:
        self.path = run_dir / name
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def describe(self) -> dict[str, Any]:
        pid = os.getpid()
        return {
            "token": self.token,
            "host": socket.gethostname(),
            "pid": pid,
            "pid_start": _proc_start(pid),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "job": os.environ.get("TORCHELASTIC_RUN_ID", ""),
            "command": " ".join(sys.argv)[:500],
        }

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + 3 * HEARTBEAT_S  # for an elastic restart's predecessor
        while True:
            if self._create():
                self._thread = threading.Thread(target=self._beat, name="run-lock", daemon=True)
                self._thread.start()
                return
            holder, age = self._read()
            if age is None:
                continue  # removed this instant: try again
            stale = "unreadable and old" if holder is None else self._stale(holder, age)
            if holder is None and age < STALE_AFTER_S:
                stale = None  # damaged: only its age can tell
            if stale is None:
                if self._restarting(holder) and time.monotonic() < deadline:
                    time.sleep(1.0)  # torchrun stopped it; its heartbeat stops soon
                    continue
                raise RunDirInUse(self._in_use(holder or {}, age)) from None
            if self._take_over(holder):
                print(
                    f"WARNING: took over the lock {self.path} of a launch that is gone ({stale})",
                    file=sys.stderr,
                )

    def _create(self) -> bool:
        """Create the lock, complete, if there is none: written under a name of its own, then
        hard-linked into place (atomic and exclusive, NFS included), so no launch ever reads
        a half-written lock. False if a lock exists."""
        tmp = self.path.with_name(f"{self.path.name}.new-{self.token}")
        try:
            with tmp.open("w") as f:
                json.dump(self.describe(), f)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                return False
            except OSError:  # NFS may report failure for a link it made: count the links
                if tmp.stat().st_nlink != 2:
                    raise
            return True
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()

    def _take_over(self, judged: dict[str, Any] | None) -> bool:
        """Move the stale lock aside, atomically; if what moved is not the lock judged stale
        (another launch took it over meanwhile and holds it now), put it back."""
        aside = self.path.with_name(f"{self.path.name}.stale-{self.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        try:
            moved = json.loads(aside.read_text())
        except (OSError, ValueError):
            moved = None
        same = judged is None or (
            isinstance(moved, dict) and moved.get("token") == judged.get("token")
        )
        if not same:
            with contextlib.suppress(FileExistsError, OSError):
                os.link(aside, self.path)  # back, unless a newer lock exists already
        with contextlib.suppress(OSError):
            aside.unlink()
        return same

    def _read(self) -> tuple[dict[str, Any] | None, float | None]:
        """The holder's description (None if unreadable) and seconds since its heartbeat."""
        try:
            mtime = self.path.stat().st_mtime
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError):
            holder = None
        age = _fs_now(self.path.parent) - mtime
        return (holder if isinstance(holder, dict) else None), age

    @staticmethod
    def _stale(holder: dict[str, Any], age: float | None) -> str | None:
        """Why `holder` is known to be gone, or None if it may be alive."""
        if holder.get("host") == socket.gethostname():  # the pid says it all
            try:
                pid = int(holder.get("pid", -1))
            except (TypeError, ValueError):
                pid = -1
            if pid <= 0 or not _pid_alive(pid, holder.get("pid_start")):
                return f"pid {pid} on this host is no longer running"
            return None
        if age is not None and age > STALE_AFTER_S:
            return f"no heartbeat for {age:.0f} s"
        if RunLock._restarting(holder) and age is not None and age > 2 * HEARTBEAT_S:
            return f"an earlier attempt of torchrun job {holder.get('job')}, stopped"
        return None

    @staticmethod
    def _restarting(holder: dict[str, Any] | None) -> bool:
        """`holder` is an earlier attempt of this torchrun job, which torchrun has stopped
        before restarting the workers (its heartbeat stops within HEARTBEAT_S). A fresh
        launch reusing the job id (a requeue with the same --rdzv_id) has restart count 0."""
        job = os.environ.get("TORCHELASTIC_RUN_ID", "")
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        return bool(holder and job and job != "none" and holder.get("job") == job and restarts > 0)

    def _in_use(self, holder: dict[str, Any], age: float | None) -> str:
        beat = f", last heartbeat {age:.0f} s ago" if age is not None else ""
        job = f", torchrun job {holder['job']}" if holder.get("job") else ""
        return (
            f"run directory {self.path.parent} is in use by another launch: host "
            f"{holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}"
            f"{job}{beat} (lock file {self.path}). Two launches would write the same "
            "metrics.jsonl and checkpoints. Wait for it to finish or stop it (kill "
            f"{holder.get('pid')} on {holder.get('host')}), or give this launch its own "
            "directory (hydra.run.dir=...). A launch that died leaves a lock that frees itself: "
            f"at once on the same host, after {STALE_AFTER_S:.0f} s without heartbeat from "
            "another; delete the lock file only if you are sure the holder is gone."
        )

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                holder = json.loads(self.path.read_text())
            except (OSError, ValueError):
                continue  # a transient error (NFS): beat again next time
            if holder.get("token") != self.token:
                print(
                    f"WARNING: the lock {self.path} is now held by another launch (host "
                    f"{holder.get('host')}, pid {holder.get('pid')}); two launches are writing "
                    "this run directory: stop one of them",
                    file=sys.stderr,
                    flush=True,
                )
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with contextlib.suppress(OSError, ValueError):
            if json.loads(self.path.read_text()).get("token") == self.token:
                self.path.unlink()


@contextlib.contextmanager
def run_dir_lock(run_dir: Path, info: DistInfo, name: str = LOCK_NAME) -> Any:
    """Collective: rank 0 holds the lock of `run_dir` for the duration; every rank raises
    `RunDirInUse` if another live launch holds it. `name`: the lock's file (ft's replica
    groups share the run directory, each holding a lock of its own)."""
    lock = RunLock(run_dir, name) if info.is_main else None
    error = None
    if lock is not None:
        try:
            lock.acquire()
        except RunDirInUse as exc:
            error = str(exc)
        except Exception as exc:  # no rank may be left waiting in the broadcast below
            error = (
                f"could not take the run-directory lock {lock.path}: {exc}. The run directory "
                "must be writable (hydra.run.dir=...)"
            )
    error = broadcast_object(error, info)
    if error is not None:
        raise RunDirInUse(error)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
