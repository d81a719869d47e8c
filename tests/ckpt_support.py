"""Support for tests/test_checkpoint.py: a callback the trainer loads by `_target_` to die at a
precise moment, and process-tree helpers for launches that must not outlive their test.

Only the standard library and `engine.callbacks` are imported here: the trainer's subprocesses
import this module to build the callback, and that must stay cheap and side-effect free.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from engine.callbacks import Callback
from engine.checkpoint import CheckpointError, verify

if TYPE_CHECKING:
    from engine.step import StepContext


def wait_until_committed(path: Path, timeout_s: float, who: str) -> None:
    """Block until the checkpoint at `path` is complete (its manifest lists every file, each
    present at its size), not merely present: another process is writing it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            verify(path, checksums=False)
            return
        except CheckpointError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{who}: {path} was not committed in {timeout_s} s") from None
            time.sleep(0.01)


class KillOnce(Callback):
    """SIGKILLs its own process right after optimizer step `step` on rank `rank`, once.

    SIGKILL is a crash no Python code can react to (no `finally`, no flush), which is what a
    resume must survive. The marker file makes the rerun of the same command harmless. With
    `wait_for`, it first waits until that checkpoint is committed whole by the
    background writer, so the moment of death is deterministic for async saves too.
    Stateless, so adding it to a run does not change what its checkpoints must hold.
    """

    def __init__(
        self,
        step: int,
        marker: str,
        rank: int = 0,
        wait_for: str | None = None,
        wait_timeout_s: float = 60.0,
    ) -> None:
        self.step = int(step)
        self.marker = Path(marker)
        self.rank = int(rank)
        self.wait_for = Path(wait_for) if wait_for else None
        self.wait_timeout_s = float(wait_timeout_s)

    def on_after_optimizer_step(self, ctx: StepContext, step: int) -> None:
        if step != self.step or int(os.environ.get("RANK", "0")) != self.rank:
            return
        if self.marker.exists():
            return
        if self.wait_for is not None:
            wait_until_committed(self.wait_for, self.wait_timeout_s, "KillOnce")
        self.marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
