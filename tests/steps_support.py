"""Support for tests/test_steps.py: a user-defined step strategy and a crash callback, both
loaded by the trainer from `_target_` (`step._target_=tests.steps_support.CountingStep`).

Only light modules are imported at the top: trainer subprocesses import this module to build
these objects, and that must stay cheap and free of side effects.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from engine.callbacks import Callback
from engine.steps.accumulate import AccumulateStep

if TYPE_CHECKING:
    from engine.step import Batch, StepContext, StepResult


class CountingStep:
    """A user strategy: exact accumulation (delegated to `AccumulateStep`) that records each
    call, so a test can tell the trainer really used it.

    `factor` has no default: if the trainer dropped `+step.factor=...`, building it would fail.
    Calls are recorded in a class attribute, so only in-process runs can read them.
    """

    calls: ClassVar[list[tuple[float, int]]] = []  # (factor, micro-batches in the window)

    def __init__(self, factor: float) -> None:
        self.factor = float(factor)
        self.inner = AccumulateStep()

    def __call__(self, ctx: StepContext, window: Sequence[Batch]) -> StepResult:
        type(self).calls.append((self.factor, len(window)))
        return self.inner(ctx, window)


class KillOnce(Callback):
    """SIGKILLs its own process right after optimizer step `step`, unless `marker` exists.

    SIGKILL is a real crash: no `finally`, no flush, no checkpoint on the way out. The marker
    (created just before dying) makes a rerun of the very same command run through. Stateless,
    so a checkpoint of a run with it resumes in a run without it and vice versa.
    """

    def __init__(self, step: int, marker: str) -> None:
        self.step = int(step)
        self.marker = Path(marker)

    def on_after_optimizer_step(self, ctx: StepContext, step: int) -> None:
        if step != self.step or self.marker.exists():
            return
        self.marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
