"""SIGTERM (what schedulers send before killing a job) asks the run to stop at an
optimizer-step boundary, after saving a checkpoint; so does the loss of the `torchrun`
launcher (`LauncherWatch`).

Ranks may receive the signal at different moments, so they agree on it: at each step boundary
every rank starts a one-integer MAX all-reduce of its flag on a CPU (gloo) group and reads the
result of the one it started at the previous boundary. The collective overlaps a whole step
(no stall, no GPU sync), and every rank decides at the same step, one step after the signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads with the run, not before the config is checked
    from engine.distributed import DistInfo

# The process's parent when it started: under torchrun, the agent. Read at import (the agent
# may be gone before the watch starts), and again in a child this process forks (its parent
# is this process, not ours).
_PARENT = os.getppid()


def _forked() -> None:
    global _PARENT
    _PARENT = os.getppid()


os.register_at_fork(after_in_child=_forked)

POLL_S = 0.2  # how often the parent is looked at
GRACE_S = 5.0  # from noticing to exiting, at the latest
EXIT_ORPHANED = 3


class LauncherWatch:
    """Under torchrun: a worker whose launcher is gone stops by itself.

    kill -9 of the agent leaves its workers running (nothing can tell them: the agent's own
    clean-up never runs), training to the end with no launcher and holding the run directory
    against the user's rerun. A daemon thread looks at the parent pid every POLL_S seconds
    (reparenting changes it; PR_SET_PDEATHSIG would fire when the *thread* that started the
    worker ends, not the agent). When the agent is gone it sets `gone`: the training loop then
    stops at the next step boundary and saves that step, as on SIGTERM (`StopRequest`). A
    worker still alive GRACE_S seconds later (stuck in a collective with a peer that died,
    in start-up, in a long step) exits at once: checkpoints commit by one rename, so the
    newest committed one is whole and the rerun resumes from it.
    """

    def __init__(self, parent: int, grace_s: float = GRACE_S) -> None:
        self.parent, self.grace_s = parent, grace_s
        self.gone = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="launcher-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while os.getppid() == self.parent:
            time.sleep(POLL_S)
        self.gone.set()
        _say(
            f"the torchrun launcher (pid {self.parent}) is gone: stopping at the next step "
            f"boundary after saving it, or in {self.grace_s:g} s at the latest"
        )
        time.sleep(self.grace_s)  # the process normally ends before this
        _say(
            f"still running {self.grace_s:g} s after the launcher was lost: exiting now (the "
            "newest committed checkpoint is intact; rerun to resume from it)"
        )
        os._exit(EXIT_ORPHANED)


def _say(text: str) -> None:
    """One line on stderr, which may be a pipe nobody reads any more (the launcher held it)."""
    with contextlib.suppress(OSError, ValueError):
        print(f"[rank {os.environ.get('RANK', '?')}] {text}", file=sys.stderr, flush=True)


_WATCH: LauncherWatch | None = None


def watch_launcher() -> LauncherWatch | None:
    """Start watching the torchrun launcher (once per process); None outside torchrun."""
    global _WATCH
    if _WATCH is None and "TORCHELASTIC_RUN_ID" in os.environ and _PARENT != 1:
        _WATCH = LauncherWatch(_PARENT)
    return _WATCH


class StopRequest:
    def __init__(self, info: DistInfo) -> None:
        self.info = info
        self.requested = False
        self.watch = watch_launcher()
        self._group = None
        self._pending: tuple[Any, Any] | None = None  # (a collective's work, its flag)
        if info.distributed:
            import torch.distributed as dist

            backend = dist.get_backend()
            self._group = dist.new_group(backend="gloo") if backend != "gloo" else None
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:  # a second SIGTERM: stop now
            sys.exit(128 + signum)
        self.requested = True

    def agreed(self) -> bool:
        """True on every rank alike once any rank has been asked to stop (one step later)."""
        if self.watch is not None and self.watch.gone.is_set():
            self.requested = True
        if not self.info.distributed:
            return self.requested
        import torch
        import torch.distributed as dist

        stop = self._collect()
        flag = torch.tensor([int(self.requested)])
        self._pending = (dist.all_reduce(flag, dist.ReduceOp.MAX, self._group, True), flag)
        return stop

    def _collect(self) -> bool:
        if self._pending is None:
            return False
        work, flag = self._pending
        work.wait()
        self._pending = None
        return bool(flag.item())

    def close(self, collect: bool = True) -> None:
        """`collect`: finish the last flag all-reduce (every rank started the same ones);
        False when a peer hung and never will."""
        if collect:
            self._collect()
        signal.signal(signal.SIGTERM, self._previous)
