"""Tasks whose loss is of the whole window (engine/window_task.py) in the run: the step they
train with, chosen by itself (what it refuses is the compatibility table's); and every task's
own records (`train/temperature`; a task's exact item means, engine/item_sums.py's
`ItemSums`: task=dpo's `train/reward_*`)."""

from __future__ import annotations

from typing import Any

from engine.callbacks import Callback
from engine.callbacks.item_means import ItemMeans
from engine.item_sums import ItemSums
from engine.step import StepContext, StepStrategy
from engine.steps.accumulate import AccumulateStep
from engine.steps.cached import CachedStep
from engine.window_task import HasMetrics, WindowTask
from trainer.run.batch_plan import AUTO, BatchPlan
from trainer.run.extensions.base import Extension
from trainer.run.parts import Parts


class TaskRecords(Callback):
    """The task's own values in each training record (`metrics()`: the learned temperature
    after the step's update). Stateless: the values live in the model's parameters."""

    state_optional = True

    def __init__(self, task: HasMetrics) -> None:
        self.task = task

    def metrics(self) -> dict[str, Any]:
        return self.task.metrics()


class WholeWindow(Extension):
    """`step=cached` chosen for a task whose loss is of the whole window; the task's records."""

    name = "window"

    def prepare_step(
        self, step_fn: StepStrategy, ctx: StepContext, plan: BatchPlan, parts: Parts
    ) -> StepStrategy:
        """`step=cached` in place of the default step for a task whose loss is of the whole
        window (one line says so); what cannot run the task is the compatibility table's.
        When the window is one micro-batch on one process, its loss is the window's: the
        default step computes it at once, without the cached step's second pass."""
        task_name = f"task `{parts.cfg.task.get('_target_')}`"
        if not isinstance(ctx.task, WindowTask) or type(step_fn) is not AccumulateStep:
            return step_fn
        auto = parts.cfg.train.micro_batch_size == AUTO
        if plan.accum == 1 and ctx.dist.world_size == 1 and not auto:
            print(
                f"step=accumulate: the loss of {task_name} is of the whole window, and the "
                "window is one micro-batch on one process: its loss is computed at once",
                flush=True,
            )
            return step_fn
        if ctx.dist.is_main:
            print(
                f"step=cached: the loss of {task_name} is of the whole window (every "
                "micro-batch, every rank), so the cached two-pass step runs it "
                "(engine/steps/cached.py): representations first, then each micro-batch "
                "again with the window's gradient",
                flush=True,
            )
        return CachedStep()

    def callbacks(
        self, ctx: StepContext, step_fn: StepStrategy, parts: Parts
    ) -> dict[str, Callback]:
        """The task's own values in each record: a whole-window task's metrics, or the exact
        means of a task's item sums (task=dpo's rewards; the run's own task, also when a
        mixture's balancing wraps it)."""
        del ctx, step_fn
        task = parts.task
        if isinstance(task, WindowTask):
            return {"task": TaskRecords(task)} if isinstance(task, HasMetrics) else {}
        reports = isinstance(task, ItemSums) and task.item_sum_names
        return {"task": ItemMeans(task)} if reports else {}
