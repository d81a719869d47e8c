"""The features that take part in a run, one module each, and the order they take part in
(`EXTENSIONS`): the assembly and the training run's build call each point of
trainer/run/extensions/base.py on every one of them, in this order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from engine.callbacks import Callback
from engine.step import StepContext, StepStrategy
from trainer.run.batch_plan import BatchPlan
from trainer.run.extensions.adapter import Adapters
from trainer.run.extensions.base import Extension
from trainer.run.extensions.float8 import Float8
from trainer.run.extensions.grpo import PolicyRollouts
from trainer.run.extensions.moe import Balancing
from trainer.run.extensions.preference import Preference
from trainer.run.extensions.privacy import Privacy
from trainer.run.extensions.window import WholeWindow
from trainer.run.parts import Parts

EXTENSIONS: tuple[type[Extension], ...] = (
    # On the model as soon as it is built: every later point sees the adapted model (fp8
    # converts its layers, DPO's reference is its base with the adapters off).
    Adapters,
    # Converts the model before the reference is copied from it (a copy is float8 too: at
    # step 1 the two cancel) and before the layout wraps its layers.
    Float8,
    # The reference of the initial policy: copied before the layout, laid out after it.
    Preference,
    # task=grpo's reference (copied before the layout, as DPO's), then its rollouts attached
    # to the laid-out model; its step wraps the configured one before the later points see it.
    PolicyRollouts,
    # Wraps the task the step runs (DPO's too); its records come first among the callbacks:
    # the routing biases move before any other callback sees the finished step.
    Balancing,
    # Chooses step=cached for a loss of the whole window; the task's own records.
    WholeWindow,
    # DP-SGD's step, told its sizes last, once the step is the one that runs.
    Privacy,
)


class Extensions:
    """This run's extensions (one instance of each of `EXTENSIONS`), called point by point."""

    def __init__(self, extensions: list[Extension]) -> None:
        self.extensions = extensions

    @classmethod
    def of_run(cls, *more: Extension) -> Extensions:
        """One of each of `EXTENSIONS`, then `more` (a feature not in the trainer yet)."""
        return cls([*(kind() for kind in EXTENSIONS), *more])

    def __iter__(self) -> Iterator[Extension]:
        return iter(self.extensions)

    def model_built(self, parts: Parts) -> Parts:
        for ext in self:
            parts = ext.model_built(parts)
        return parts

    def before_layout(self, parts: Parts) -> Parts:
        for ext in self:
            parts = ext.before_layout(parts)
        return parts

    def after_layout(self, parts: Parts) -> Parts:
        for ext in self:
            parts = ext.after_layout(parts)
        return parts

    def wrap_task(self, task: Any, parts: Parts) -> Any:
        for ext in self:
            task = ext.wrap_task(task, parts)
        return task

    def prepare_step(
        self, step_fn: StepStrategy, ctx: StepContext, plan: BatchPlan, parts: Parts
    ) -> StepStrategy:
        for ext in self:
            step_fn = ext.prepare_step(step_fn, ctx, plan, parts)
        return step_fn

    def callbacks(
        self, ctx: StepContext, step_fn: StepStrategy, parts: Parts
    ) -> dict[str, Callback]:
        """Every extension's callbacks, in the extensions' order."""
        out: dict[str, Callback] = {}
        for ext in self:
            out |= ext.callbacks(ctx, step_fn, parts)
        return out
