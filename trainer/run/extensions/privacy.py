"""`step=dp_sgd` in the run: the model checked for per-sample gradients, the step told its
batch and dataset sizes (its privacy accounting), and `train/epsilon` recorded."""

from __future__ import annotations

from engine.callbacks import Callback
from engine.step import StepContext, StepStrategy
from engine.steps.dp_sgd import DPSGDStep, PrivacySpent, check_per_sample_model
from trainer.config.errors import ConfigError
from trainer.run.batch_plan import BatchPlan
from trainer.run.extensions.base import Extension
from trainer.run.parts import Parts


class Privacy(Extension):
    """DP-SGD's step prepared, and its spent privacy recorded (a no-op for any other step)."""

    name = "privacy"

    def prepare_step(
        self, step_fn: StepStrategy, ctx: StepContext, plan: BatchPlan, parts: Parts
    ) -> StepStrategy:
        if not isinstance(step_fn, DPSGDStep):
            return step_fn
        try:
            check_per_sample_model(ctx.model, ctx.parallel)
        except ValueError as exc:
            raise ConfigError("step", str(exc)) from None
        try:
            step_fn.set_sampling(plan.global_batch, len(parts.data.train))
        except ValueError as exc:  # step.target_epsilon out of reach
            raise ConfigError("step.target_epsilon", str(exc)) from None
        return step_fn

    def callbacks(
        self, ctx: StepContext, step_fn: StepStrategy, parts: Parts
    ) -> dict[str, Callback]:
        del ctx, parts
        return {"privacy": PrivacySpent(step_fn)} if isinstance(step_fn, DPSGDStep) else {}
