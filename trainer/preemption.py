"""SIGTERM (what schedulers send before killing a job) asks the run to stop at an
optimizer-step boundary, after saving a checkpoint.

Ranks may receive the signal at different moments, so they agree on it: at each step boundary
every rank starts a one-integer MAX all-reduce of its flag on a CPU (gloo) group and reads the
result of the one it started at the previous boundary. The collective overlaps a whole step
(no stall, no GPU sync), and every rank decides at the same step, one step after the signal.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

import torch
import torch.distributed as dist

from engine.distributed import DistInfo


class StopRequest:
    def __init__(self, info: DistInfo) -> None:
        self.info = info
        self.requested = False
        self._group = None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        if info.distributed:
            backend = dist.get_backend()
            self._group = dist.new_group(backend="gloo") if backend != "gloo" else None
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:  # a second SIGTERM: stop now
            sys.exit(128 + signum)
        self.requested = True

    def agreed(self) -> bool:
        """True on every rank alike once any rank has been asked to stop (one step later)."""
        if not self.info.distributed:
            return self.requested
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

    def close(self) -> None:
        self._collect()  # every rank started the same collectives: finish the last one
        signal.signal(signal.SIGTERM, self._previous)
