"""The points of a run where a feature takes part (`Extension`), each a no-op unless the
feature overrides it. The assembly (trainer/run/assemble.py) and the training run's build
(trainer/run/build.py) call them in this order, for every extension in the order of
`EXTENSIONS` (trainer/run/extensions/__init__.py), and name no feature:

- `model_built(parts) -> parts`: the model is built, on this rank's device (inside the
  planner's fake tensors if any: `parts.building`); nothing is converted or laid out yet.
- `before_layout(parts) -> parts`: the last moment the whole initial model is on each rank.
- `after_layout(parts) -> parts`: the model is laid out over the ranks (`parts.wrapped`;
  trainer/run/layout.py's `parallelize` lays out another module the same way).
- `wrap_task(task, parts) -> task` (training and the planner): the task the step runs.
- `prepare_step(step_fn, ctx, plan, parts) -> step_fn` (training): the step strategy this
  feature needs (another one, or the same one told what it needs to know).
- `callbacks(ctx, step_fn, parts) -> {name: Callback}` (training): this feature's callbacks,
  returned; the build puts every extension's into the run's callbacks in one place.

What refuses what is not a point: the compatibility table (trainer/run/compatibility.py)
is consulted at these moments, before the extensions (a refusal is one row of it). A
feature's own checks of its own settings stay in its module.
"""

from __future__ import annotations

from typing import Any

from engine.callbacks import Callback
from engine.step import StepContext, StepStrategy
from trainer.run.batch_plan import BatchPlan
from trainer.run.parts import Parts


class Extension:
    """A feature's part in a run: override the points it takes part in (module docstring).
    One instance per assembly: state it keeps between its own points is its own."""

    name = ""

    def model_built(self, parts: Parts) -> Parts:
        return parts

    def before_layout(self, parts: Parts) -> Parts:
        return parts

    def after_layout(self, parts: Parts) -> Parts:
        return parts

    def wrap_task(self, task: Any, parts: Parts) -> Any:
        del parts
        return task

    def prepare_step(
        self, step_fn: StepStrategy, ctx: StepContext, plan: BatchPlan, parts: Parts
    ) -> StepStrategy:
        del ctx, plan, parts
        return step_fn

    def callbacks(
        self, ctx: StepContext, step_fn: StepStrategy, parts: Parts
    ) -> dict[str, Callback]:
        del ctx, step_fn, parts
        return {}
