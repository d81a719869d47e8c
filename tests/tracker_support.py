"""Support for tests/test_trackers.py: a callback the trainer loads by `_target_` that breaks
the local MLflow store under a running run, as a full disk or a lost mount would.

Only the standard library and `engine.callbacks` are imported: the trainer's subprocess
imports this module to build the callback.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from engine.callbacks import Callback

if TYPE_CHECKING:
    from engine.step import StepContext


class BreakMlflowStore(Callback):
    """After optimizer step `step`, every MLflow run under `store` loses its `metrics/`
    directory, replaced by a plain file: MLflow's next metric write fails there."""

    def __init__(self, step: int, store: str) -> None:
        self.step = int(step)
        self.store = Path(store)

    def on_after_optimizer_step(self, ctx: StepContext, step: int) -> None:
        if step != self.step:
            return
        for metrics in self.store.glob("*/*/metrics"):
            shutil.rmtree(metrics)
            metrics.write_text("not a directory any more\n")
