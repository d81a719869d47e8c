"""One launch per run directory: a lock file that rank 0 holds for the run's lifetime.

Two launches on one run directory (a SLURM requeue while the old job still runs, a command
submitted twice) would append to the same `metrics.jsonl` and write into the same
`checkpoints/`. The lock is a file created with `O_EXCL` (atomic on local filesystems and
NFSv3+), holding who took it; a heartbeat thread touches it every `HEARTBEAT_S`. A lock is
stale, and taken over, when its holder is known to be gone:

- same host, and that pid no longer runs (or runs another program: its start time differs);
- the same torchrun job restarting its workers (`TORCHELASTIC_RUN_ID` equal and
  `TORCHELASTIC_RESTART_COUNT` > 0: the agent stopped the old workers first);
- no heartbeat for `STALE_AFTER_S` (the holder's node is lost). Ages are measured against a
  file written just now on the same filesystem, so clocks of different nodes never compare.
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
from trainer.errors import UserError

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
    if start is not None and Path("/proc").is_dir():
        return _proc_start(pid) == start
    return True


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

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_NAME
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
        for _ in range(20):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder, age = self._read()
                if age is None:
                    continue  # removed this instant: try again
                if holder is None and age < STALE_AFTER_S:
                    time.sleep(0.1)  # being written or removed this instant
                    continue
                stale = "unreadable" if holder is None else self._stale(holder, age)
                if stale is None:
                    raise RunDirInUse(self._in_use(holder, age)) from None
                print(
                    f"WARNING: taking over the lock {self.path} of a launch that is gone ({stale})",
                    file=sys.stderr,
                )
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.describe(), f)
                f.flush()
                os.fsync(f.fileno())
            self._thread = threading.Thread(target=self._beat, name="run-lock", daemon=True)
            self._thread.start()
            return
        raise RunDirInUse(f"could not take the lock {self.path}: it keeps changing hands")

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
        if age is not None and age > STALE_AFTER_S:
            return f"no heartbeat for {age:.0f} s"
        job = os.environ.get("TORCHELASTIC_RUN_ID", "")
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if job and holder.get("job") == job and restarts > 0:
            return f"an earlier attempt of this torchrun job {job}"
        if holder.get("host") == socket.gethostname():
            pid = int(holder.get("pid", -1))
            if pid == os.getpid():
                return "this very process"
            if pid <= 0 or not _pid_alive(pid, holder.get("pid_start")):
                return f"pid {pid} on this host is no longer running"
        return None

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
                if holder.get("token") != self.token:
                    print(f"WARNING: the lock {self.path} was taken over", file=sys.stderr)
                    return
                os.utime(self.path)
            except (OSError, ValueError):
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with contextlib.suppress(OSError, ValueError):
            if json.loads(self.path.read_text()).get("token") == self.token:
                self.path.unlink()


@contextlib.contextmanager
def run_dir_lock(run_dir: Path, info: DistInfo) -> Any:
    """Collective: rank 0 holds the lock of `run_dir` for the duration; every rank raises
    `RunDirInUse` if another live launch holds it."""
    lock = RunLock(run_dir) if info.is_main else None
    error = None
    if lock is not None:
        try:
            lock.acquire()
        except RunDirInUse as exc:
            error = str(exc)
    error = broadcast_object(error, info)
    if error is not None:
        raise RunDirInUse(error)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
