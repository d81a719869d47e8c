"""Tasks whose loss is of the whole window (engine/window_task.py): the step they train with,
chosen by itself, what it refuses, and the task's own records (`train/temperature`; a task's
exact item means, engine/step.py's `ItemSums`: task=dpo's `train/reward_*`)."""

from __future__ import annotations

from typing import Any

from engine.callbacks import Callback
from engine.callbacks.item_means import ItemMeans
from engine.step import ItemSums, StepContext, StepStrategy
from engine.steps.accumulate import AccumulateStep
from engine.steps.cached import CachedStep
from engine.window_task import HasMetrics, WindowTask, needs_window_task
from trainer.config.errors import ConfigError
from trainer.config.schema import Config
from trainer.run.batch_plan import AUTO, BatchPlan


class TaskRecords(Callback):
    """The task's own values in each training record (`metrics()`: the learned temperature
    after the step's update). Stateless: the values live in the model's parameters."""

    state_optional = True

    def __init__(self, task: HasMetrics) -> None:
        self.task = task

    def metrics(self) -> dict[str, Any]:
        return self.task.metrics()


def step_for_task(
    step_fn: StepStrategy, ctx: StepContext, cfg: Config, plan: BatchPlan
) -> StepStrategy:
    """`step_fn`, or `step=cached` in place of the default step for a task whose loss is of
    the whole window (one line says so); a step that cannot run the task is refused. When the
    window is one micro-batch on one process, its loss is the window's: the default step
    computes it at once, without the cached step's second pass."""
    task, task_name = ctx.task, f"task `{cfg.task.get('_target_')}`"
    auto = cfg.train.micro_batch_size == AUTO
    one_micro_batch = plan.accum == 1 and ctx.dist.world_size == 1 and not auto
    if not isinstance(task, WindowTask):
        if isinstance(task, ItemSums):  # the task's exact means in each record (task=dpo)
            ctx.callbacks.named["task"] = ItemMeans(task)
        if isinstance(step_fn, CachedStep):
            raise ConfigError("step", needs_window_task(task_name))
        return step_fn
    if type(step_fn) is AccumulateStep and one_micro_batch:
        print(
            f"step=accumulate: the loss of {task_name} is of the whole window, and the window "
            "is one micro-batch on one process: its loss is computed at once",
            flush=True,
        )
    elif type(step_fn) is AccumulateStep:
        step_fn = CachedStep()
        if ctx.dist.is_main:
            print(
                f"step=cached: the loss of {task_name} is of the whole window (every "
                "micro-batch, every rank), so the cached two-pass step runs it "
                "(engine/steps/cached.py): representations first, then each micro-batch "
                "again with the window's gradient",
                flush=True,
            )
    elif not isinstance(step_fn, CachedStep):
        raise ConfigError(
            "step",
            f"the loss of {task_name} is of the whole window; {type(step_fn).__name__} would "
            "see one micro-batch at a time. Use step=cached (chosen by itself when no step is "
            "set)",
        )
    per_micro = [name for name, cb in ctx.callbacks.named.items() if cb.per_micro_batch]
    if per_micro:
        raise ConfigError(
            f"callbacks.{per_micro[0]}",
            "observes every micro-batch's gradient; under step=cached a micro-batch's "
            "gradient is its share of the whole window's loss, not a loss of its own, so its "
            "statistics would not mean what they say. Remove it for this task",
        )
    if isinstance(task, HasMetrics):
        ctx.callbacks.named["task"] = TaskRecords(task)
    return step_fn
