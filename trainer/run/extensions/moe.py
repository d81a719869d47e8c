"""Mixture-of-experts models in a run: the task wrapped with the load-balancing loss of the
routers the model declares (engine/moe/), and its records (`MoERecords`, which also moves the
routing biases of `moe.balance=bias`)."""

from __future__ import annotations

from typing import Any

from engine.callbacks import Callback
from engine.moe.balance import BalanceCfg, BalancedTask, RoutingNotRepeated, balanced
from engine.moe.objective import objective_of
from engine.moe.routing import HasRouters
from engine.step import StepContext, StepStrategy
from trainer.config.errors import ConfigError
from trainer.run.extensions.base import Extension
from trainer.run.fit import RunEnded
from trainer.run.parts import Parts


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


class Balancing(Extension):
    """The run's task wrapped with the balancing when the model declares routers, and its
    records first among the callbacks: the biases are updated before any other callback sees
    the finished step."""

    name = "moe"

    def wrap_task(self, task: Any, parts: Parts) -> Any:
        model = parts.built_model()
        routers = list(model.routers()) if isinstance(model, HasRouters) else []
        if not routers:
            return task
        cfg = parts.cfg
        balance = BalanceCfg(
            cfg.moe.balance,
            cfg.moe.aux_coef,
            cfg.moe.z_coef,
            bias_rate=cfg.moe.bias_rate,
            # A forward under sharded parameters or compilation runs whole (its collectives
            # and graphs would be cut short by the routing pass's early stop).
            stop_early=not parts.parallel.shards_parameters and not cfg.train.compile,
        )
        objective = objective_of(model)  # the model's own: per layer, or transformers'
        group = parts.parallel.dp_group
        try:
            return balanced(task, routers, balance, parts.info, group, objective)
        except ValueError as exc:
            raise ConfigError("model.moe", str(exc)) from None

    def callbacks(
        self, ctx: StepContext, step_fn: StepStrategy, parts: Parts
    ) -> dict[str, Callback]:
        del step_fn, parts
        return {"moe": MoERecords(ctx.task)} if isinstance(ctx.task, BalancedTask) else {}
