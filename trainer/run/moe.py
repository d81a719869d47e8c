"""Mixture-of-experts models in a run: the task wrapped with the load-balancing loss of the
routers the model declares (engine/moe/), its records, and what it cannot run with yet."""

from __future__ import annotations

from typing import Any

from engine.callbacks import Callback
from engine.distributed import DistInfo
from engine.moe.balance import BalanceCfg, BalancedTask, RoutingNotRepeated, balanced
from engine.moe.objective import objective_of
from engine.moe.routing import HasRouters
from engine.parallel.dims import ParallelDims
from engine.preference import DPOTask
from engine.steps.accumulate import AccumulateStep
from engine.window_task import WindowTask
from trainer.config.errors import ConfigError
from trainer.config.schema import Config
from trainer.run.assemble import Assembly
from trainer.run.fit import RunEnded


class RoutingDiffered(RunEnded):
    """`moe.balance=global`: a micro-batch routed unlike its count (on any rank); every rank
    stops alike, before a record or a checkpoint of the skipped steps."""

    outcome = "stopped: routing not repeated"


class MoERecords(Callback):
    """`train/moe_aux_loss`, `train/moe_z_loss`, `train/moe_load_max` of the recorded step
    (with `moe.balance=global`, after the routing check of the steps since the last record:
    a step routed unlike its count was skipped, and the run stops there, as it does before a
    checkpoint: `before_save`); with `moe.balance=bias`, the routers' biases updated after
    each step (their state is the model's: buffers in its checkpoint)."""

    state_optional = True

    def __init__(self, task: BalancedTask) -> None:
        self.task = task

    def on_after_optimizer_step(self, ctx: Any, step: int) -> None:
        del ctx, step
        self.task.update_bias()

    def metrics(self) -> dict[str, Any]:
        try:
            return self.task.metrics()  # the routing check first (collective)
        except RoutingNotRepeated as exc:
            raise RoutingDiffered(str(exc)) from None

    def before_save(self) -> None:
        """Collective, before each checkpoint (the stop request's included): the routing
        check, as at a record; a checkpoint written after a skipped step would hide it from
        the resumed run."""
        try:
            self.task.check_routing()
        except RoutingNotRepeated as exc:
            raise RoutingDiffered(str(exc)) from None


def declares_experts(model: dict[str, Any]) -> bool:
    """Whether `model.*` alone makes the model a mixture of experts, before it is built: the
    in-tree GPT's `model.moe.experts`, or the expert count of a transformers model built from
    `model.config` (`num_experts`, `num_local_experts`). A pretrained directory's own config is
    read when the model is built (`balanced_task` checks its routers then)."""
    moe = model.get("moe")
    if isinstance(moe, dict) and moe.get("experts"):
        return True
    fields = model.get("config")
    if model.get("pretrained") is not None or not isinstance(fields, dict):
        return False
    return any(fields.get(name) for name in ("num_experts", "num_local_experts"))


def check_mixture_layout(dims: ParallelDims) -> None:
    """A mixture of experts refuses tensor, pipeline and context parallelism, in one
    paragraph naming the key."""
    for key, degree in (("dist.tp", dims.tp), ("dist.pp", dims.pp), ("dist.cp", dims.cp)):
        if degree > 1:
            raise ConfigError(
                key,
                f"must be 1 with a mixture-of-experts model (got {degree}): the routers' "
                "load-balancing loss (moe.balance) is counted over whole tokens and whole "
                "experts on each data-parallel rank; tensor, pipeline and context parallelism "
                "would split them and are not built for it yet. Use dist.strategy=ddp or fsdp",
            )


def balanced_task(cfg: Config, parts: Assembly, info: DistInfo, dims: ParallelDims) -> Any:
    """The run's task, wrapped with the balancing when the model declares routers."""
    routers = list(parts.model.routers()) if isinstance(parts.model, HasRouters) else []
    if not routers:
        return parts.task
    if isinstance(parts.task, WindowTask):
        raise ConfigError(
            "task",
            "a mixture-of-experts model's load balancing (moe.balance) needs a task with a loss "
            "per micro-batch (task=causal_lm, classification, token_classification); a loss of "
            "the whole window (step=cached) does not combine with it yet",
        )
    if isinstance(parts.task, DPOTask):
        raise ConfigError(
            "task",
            "task=dpo on a mixture-of-experts model is not built yet: the reference's forward "
            "(task.reference=adapter runs the policy's own routers with the adapters off, copy "
            "its own) would be counted by the load balancing and its routing check, so the "
            "balancing would not be the policy's. Use a dense model for task=dpo, or "
            "task=causal_lm to train the mixture",
        )
    check_mixture_layout(dims)  # (a mixture the config did not declare: its built routers)
    balance = BalanceCfg(
        cfg.moe.balance,
        cfg.moe.aux_coef,
        cfg.moe.z_coef,
        bias_rate=cfg.moe.bias_rate,
        # A forward under sharded parameters or compilation runs whole (its collectives and
        # graphs would be cut short by the routing pass's early stop).
        stop_early=not parts.parallel.shards_parameters and not cfg.train.compile,
    )
    objective = objective_of(parts.model)  # the model's own: per layer, or transformers'
    try:
        return balanced(parts.task, routers, balance, info, parts.parallel.dp_group, objective)
    except ValueError as exc:
        raise ConfigError("model.moe", str(exc)) from None


def check_moe_step(task: Any, step_fn: Any, callbacks: Any) -> None:
    """A mode that needs work before any backward (`global`'s routing pass) runs it in the
    accumulation step; records join."""
    if not isinstance(task, BalancedTask):
        return
    if task.mode.needs and not isinstance(step_fn, AccumulateStep):
        raise ConfigError(
            "moe.balance",
            f"{task.mode.name} {task.mode.needs}, which step=accumulate does; "
            f"{type(step_fn).__name__} does not. Use step=accumulate, or moe.balance=micro|none",
        )
    # First: the biases are updated before any other callback sees the finished step.
    callbacks.named = {"moe": MoERecords(task), **callbacks.named}
