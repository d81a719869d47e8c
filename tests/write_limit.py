"""A callback that makes this process's file writes fail from a given step on, as a full disk
or a quota does: `RLIMIT_FSIZE` caps the size of any file the process writes (Python ignores
SIGXFSZ, so the write fails with EFBIG instead of killing it).

Selected with `+callbacks.limit._target_=tests.write_limit.LimitFileSize`. It acts only when
the environment variable `CUMULUS_TEST_FSIZE` (bytes) is set,
so a rerun without it uses the same config and resumes the same checkpoints.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

from engine.callbacks import Callback
from engine.step import StepContext
from tests.ckpt_support import wait_until_committed


class LimitFileSize(Callback):
    """After optimizer step `after_step`, on rank `rank` (None: every rank), files may not grow
    beyond `CUMULUS_TEST_FSIZE` bytes. With `wait_for`, first wait until that checkpoint (an
    earlier one, written by the background writer) is committed whole, so the limit never
    catches it."""

    def __init__(
        self, after_step: int, rank: int | None = None, wait_for: str | None = None
    ) -> None:
        self.after_step = after_step
        self.rank = rank
        self.wait_for = None if wait_for is None else Path(wait_for)

    def on_after_optimizer_step(self, ctx: StepContext, step: int) -> None:
        limit = os.environ.get("CUMULUS_TEST_FSIZE")
        if limit is None or step != self.after_step:
            return
        if self.rank is not None and ctx.dist.rank != self.rank:
            return
        if self.wait_for is not None:
            wait_until_committed(self.wait_for, 60.0, "LimitFileSize")
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), hard))
