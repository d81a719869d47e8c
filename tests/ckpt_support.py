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

if TYPE_CHECKING:
    from engine.step import StepContext


class KillOnce(Callback):
    """SIGKILLs its own process right after optimizer step `step` on rank `rank`, once.

    SIGKILL is a crash no Python code can react to (no `finally`, no flush), which is what a
    resume must survive. The marker file makes the rerun of the same command harmless. With
    `wait_for`, it first waits until that path exists (a checkpoint committed by the
    background writer), so the moment of death is deterministic for async saves too.
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
            deadline = time.monotonic() + self.wait_timeout_s
            while not self.wait_for.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"KillOnce: {self.wait_for} never appeared")
                time.sleep(0.01)
        self.marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
