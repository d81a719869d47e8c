"""`task=grpo` in the run: its reference (beta > 0: a frozen copy of the initial policy, or
the base with adapter=lora's adapters disabled, chosen before the layout and laid out like the
policy after it), the rollouts' generation engine, rewards and plan (attached once the model
is laid out: it generates on the laid-out model), the rollout step around the run's step, and
the rollouts' records. What it refuses is the compatibility table's
(trainer/run/compatibility.py)."""

from __future__ import annotations

from engine.callbacks import Callback
from engine.preference import FrozenCopy, adapters_disabled, frozen_copy
from engine.step import StepContext, StepStrategy
from trainer.config.errors import ConfigError
from trainer.config.schema import Config
from trainer.data.prompts import PromptSamples
from trainer.rollout.engines import generation_engine
from trainer.rollout.generate import RolloutPlan
from trainer.rollout.rewards import rewards_of_config
from trainer.rollout.sampling import Sampling
from trainer.rollout.step import RolloutRecords, RolloutStep
from trainer.rollout.task import GRPORunTask, Rollouts
from trainer.run.batch_plan import BatchPlan
from trainer.run.extensions.base import Extension
from trainer.run.layout import parallelize
from trainer.run.parts import Parts


def rollout_plan(cfg: Config, task: GRPORunTask, end_ids: tuple[int, ...]) -> RolloutPlan:
    """How each rollout batch is made: what is drawn is the task's (`task.max_new_tokens`,
    `task.temperature`, `task.top_p`), how it is batched `rollout.micro_batch_size`."""
    micro = cfg.rollout.micro_batch_size
    if micro is None:  # each prompt micro-batch's completions
        micro = int(cfg.train.micro_batch_size) * task.num_generations
    data_limit = cfg.data.get("max_new_tokens")
    if data_limit is not None and data_limit != task.max_new_tokens:
        raise ConfigError(
            "data.max_new_tokens",
            f"is {data_limit} and task.max_new_tokens is {task.max_new_tokens}: the data checks "
            "that each prompt leaves room for the completions the task generates, and reads "
            "task.max_new_tokens by default; set task.max_new_tokens alone",
        )
    try:
        sampling = Sampling(task.max_new_tokens, end_ids, task.temperature, task.top_p)
    except ValueError as exc:
        raise ConfigError(f"task.{str(exc).split(' ', 1)[0]}", str(exc)) from None
    return RolloutPlan(
        task.num_generations, sampling, micro, task.scale_rewards, task.mask_truncated
    )


class PolicyRollouts(Extension):
    """task=grpo's reference, rollouts, step and records (a no-op for any other task)."""

    name = "grpo"

    def __init__(self) -> None:
        self.step: RolloutStep | None = None

    def before_layout(self, parts: Parts) -> Parts:
        task = parts.task
        if not isinstance(task, GRPORunTask) or task.beta == 0:
            return parts
        mode = task.reference or ("adapter" if parts.adapter is not None else "copy")
        if mode == "adapter":
            if parts.adapter is None:
                raise ConfigError(
                    "task.reference",
                    "adapter scores the reference as the policy's base with its adapters "
                    "disabled, and this run has no adapter (adapter=none): select "
                    "adapter=lora, or task.reference=copy (a frozen copy of the initial model)",
                )
            task.loss.reference = adapters_disabled(parts.adapter.peft_model, parts.built_model())
        else:
            task.loss.reference = frozen_copy(parts.built_model())
        return parts

    def after_layout(self, parts: Parts) -> Parts:
        task = parts.task
        if not isinstance(task, GRPORunTask):
            return parts
        ref = task.loss.reference
        if isinstance(ref, FrozenCopy) and parts.parallel.shards_parameters:
            extras, parallel, dtype = parts.model_extras, parts.parallel, parts.param_dtype
            assert extras is not None
            with parts.building:  # sharded like the policy: no rank holds a second model
                ref.lay_out(lambda m: parallelize(m, extras, parallel, param_dtype=dtype))
        task.rollouts = self._rollouts(parts, task)
        return parts

    def _rollouts(self, parts: Parts, task: GRPORunTask) -> Rollouts:
        cfg, data = parts.cfg, parts.data
        train, val = data.train, data.val
        assert isinstance(train, PromptSamples) and isinstance(val, PromptSamples)
        rewards = rewards_of_config(cfg.reward.funcs, cfg.reward.weights)
        rewards.check_fields(train.fields, str(cfg.data.get("path")))
        # A forward of a sharded model is collective: every rank steps as long as the longest.
        engine = generation_engine(
            cfg.rollout.engine, parts.built_model(), synced_ranks=parts.parallel.shards_parameters
        )
        return Rollouts(
            engine=engine,
            rewards=rewards,
            plan=rollout_plan(cfg, task, train.end_ids),
            seed=cfg.seed,
            train_row=train.row,
            val_row=val.row,
            decode=train.decode_text,
        )

    def prepare_step(
        self, step_fn: StepStrategy, ctx: StepContext, plan: BatchPlan, parts: Parts
    ) -> StepStrategy:
        del plan
        if not isinstance(parts.task, GRPORunTask):
            return step_fn
        self.step = RolloutStep(step_fn, parts.task, ctx)
        return self.step

    def callbacks(
        self, ctx: StepContext, step_fn: StepStrategy, parts: Parts
    ) -> dict[str, Callback]:
        del ctx, step_fn, parts
        return {} if self.step is None else {"rollouts": RolloutRecords(self.step)}
