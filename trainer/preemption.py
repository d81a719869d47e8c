"""SIGTERM (what schedulers send before killing a job) asks the run to stop at the next
optimizer-step boundary, after saving a checkpoint.

Ranks may receive the signal at different moments, so the decision is agreed on at every
step boundary with a one-integer all-reduce on a CPU (gloo) group: it never waits for the GPU.
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
        if info.distributed:
            backend = dist.get_backend()
            self._group = dist.new_group(backend="gloo") if backend != "gloo" else None
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:  # a second SIGTERM: stop now
            sys.exit(128 + signum)
        self.requested = True

    def agreed(self) -> bool:
        """True on every rank once any rank has been asked to stop."""
        if not self.info.distributed:
            return self.requested
        flag = torch.tensor([int(self.requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
