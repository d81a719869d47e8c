"""The load-balancing loss of the whole step (`moe.balance`), exact under any split.

    aux = the model's objective of f and P      (engine/moe/objective.py)

f_i is the share of the (token, slot) assignments that went to expert i (no gradient), P_i
the mean router probability of expert i. The in-tree GPT's objective is Switch / Megatron's,
E * sum_i f_i * P_i per MoE layer averaged over the layers; transformers' mixtures pool every
layer's tokens (their `load_balancing_loss_func`). Over a global batch either is a product of
two means, not a sum of micro-batch terms. With `balance="global"` the accumulation step runs,
before any backward:

    routing pass: every micro-batch of the window forward without a graph, its random state
    recorded, stopping after the last router (whole-model layouts) -> per layer and expert:
    the assignments, the summed probabilities, the summed squared logsumexps and the routed
    tokens, summed over the data-parallel ranks in one all-reduce ->
    each micro-batch forward again (its random state replayed: the same dropout masks route
    every token alike) and backward of
        CE_sum + global_count * (aux_coef * aux(C, Psum, T) + z_coef * Zsum / (T L))

where C is the whole step's assignments (a constant), Psum and Zsum this micro-batch's sums
and T the whole step's routed tokens: the objective is linear in P for a fixed C and T.
Summed over micro-batches and ranks and divided by the global count (the accumulation step's
rule), this is the gradient of mean CE + aux_coef * aux + z_coef * z of the whole batch at
once.

The modes are strategies (engine/moe/strategies.py). `balance="micro"` is what the peers do
(transformers, DeepSpeed): each micro-batch's own f and P, its aux averaged over the step's
micro-batches (the same scale as `global` when the micro-batches are alike), an
approximation that depends on the split. `balance="none"` adds nothing. The records
(`metrics`) are the whole step's aux (the model's objective), z-loss and the most-loaded
expert's share over the mean (worst layer), in every mode.

Tokens: every position of the input is routed; f, P and z count only the positions that are
not padding - a tuple batch's positions whose target is a loss item, a dict batch's where its
`attention_mask` is 1 (every position without one), or those a task marks itself
(engine/moe/sums.py's `MarksRoutedPositions`: task=dpo's pairs, each side's positions up to
its last answer token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from engine.distributed import DistInfo
from engine.item_sums import ItemSums
from engine.moe.objective import BalanceObjective, PerLayer
from engine.moe.routing import BiasedRouter, HookedRouter, Routed, Routing, counted
from engine.moe.strategies import Share, strategy
from engine.moe.sums import LayerSums, MicroRouting, StepSums, Window, routed_mask
from engine.parallel.base import NO_GUARD, SumsAcrossGroups, WindowGuard
from engine.step import EvalTask
from engine.steps.cached import RandomState, cuda_devices
from engine.steps.oom import OutOfMemoryAgreed


@dataclass(frozen=True)
class BalanceCfg:
    """`moe.*`: the mode (a name of engine/moe/strategies.py's), the load-balancing loss's
    weight (None: the model's objective's own) and the router z-loss's, the routing bias's
    step (`bias`); `stop_early`: the routing pass stops after the last router (off where
    forwards are collective all the way through: sharded parameters)."""

    balance: str = "global"
    aux_coef: float | None = None
    z_coef: float = 0.0
    stop_early: bool = True
    bias_rate: float = 0.001

    def __post_init__(self) -> None:
        strategy(self.balance)  # an unknown mode: its one message
        if self.bias_rate < 0:
            raise ValueError(f"bias_rate must be >= 0, got {self.bias_rate}")


# The name of the balancing's window sums among those that cross replica groups.
WINDOW_SUMS = "moe/routing"


class RoutingNotRepeated(RuntimeError):
    """`moe.balance=global`: a micro-batch's backward pass routed unlike its routing pass (on
    some rank); raised on every rank alike by `BalancedTask.check_routing`."""


class RoutingDone(Exception):
    """Raised after the last router of the routing pass: the rest of the forward is skipped."""


class BalancedTask:
    """A task whose loss adds the routers' load-balancing (and z-) loss, exact over the whole
    step with `balance="global"` (see the module's docstring).

    It wraps the run's task: `loss_sum`'s value is the task's, bit for bit (the balancing term
    enters the gradient only), so `train/loss` stays the cross-entropy. The accumulation step
    calls `prepare_window` once per window, before any backward (engine/step.py's
    `PreparesWindow`); micro-batches outside a prepared window (evaluation) are the task's.
    """

    def __init__(
        self,
        task: Any,
        routers: Sequence[Routed],
        cfg: BalanceCfg,
        info: DistInfo,
        group: Any = None,
        objective: BalanceObjective | None = None,
    ) -> None:
        if not routers:
            raise ValueError("BalancedTask needs a model with at least one router")
        self.task, self.routers, self.cfg = task, list(routers), cfg
        self.info, self.group = info, group
        self.mode = strategy(cfg.balance)
        self.objective = objective or PerLayer()  # the model's (engine/moe/objective.py)
        self.aux_coef = self.objective.coef if cfg.aux_coef is None else cfg.aux_coef
        self.experts = routers[0].num_experts
        self.top_k = routers[0].top_k
        if any(r.num_experts != self.experts or r.top_k != self.top_k for r in routers):
            raise ValueError("every router must have the same number of experts and top_k")
        self.window: Window | None = None
        # The window's parallelism when its ranks span replica groups (ft): the sums before
        # the backward are summed across the groups too.
        self.across: SumsAcrossGroups | None = None
        # Whether a micro-batch routed unlike its count since the last check (on the device).
        self.differs: torch.Tensor | None = None

    # ---- the task's contract ----
    def count_items(self, batch: Any) -> torch.Tensor:
        return self.task.count_items(batch)

    def loss_sum(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.loss_and_sums(model, batch)[0]

    @property
    def item_sum_names(self) -> tuple[str, ...]:
        """The task's item sums (engine/item_sums.py), if it reports any."""
        return self.task.item_sum_names if isinstance(self.task, ItemSums) else ()

    def loss_and_sums(
        self, model: nn.Module, batch: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The task's loss sum with the balancing in its gradient, and the task's item sums
        (none when it reports none)."""
        window = self.window
        if window is None or not any(b is batch for b in window.batches):
            return self._task_loss(model, batch)  # not a micro-batch of the window
        entry = window.replays.get(id(batch))
        if entry is not None:
            entry[0].restore()  # the routing pass's random state: the same routing
        loss, sums = self._task_loss(model, batch)
        micro = self.micro(batch)
        differs = None
        if entry is not None:  # compared on the device; read when records are (check_routing)
            differs = (micro.sums.counts != entry[1]).any()
            self.differs = differs if self.differs is None else self.differs | differs
        share = self.mode.share(micro, window, self.objective)
        if window.step is None:  # global's routing pass gave the step's sums already
            own = self.mode.own(share)
            flat = micro.sums.flat()
            window.local.append(flat if own is None else torch.cat([flat, own.reshape(-1)]))
        extra = self.balance_term(share)
        if extra is not None:
            extra = (extra * window.global_count.to(extra.dtype)).to(loss.dtype)
            loss = loss + (extra - extra.detach())  # the value stays the task's loss, exactly
        return (loss if differs is None else _NanGradientIf.apply(loss, differs)), sums

    def _task_loss(
        self, model: nn.Module, batch: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if isinstance(self.task, ItemSums):
            return self.task.loss_and_sums(model, batch)
        return self.task.loss_sum(model, batch), {}

    # ---- the window ----
    def check_routing(self) -> None:
        """With `global`: raise `RoutingNotRepeated` on every rank if a micro-batch of any rank
        routed differently in its backward pass than in the routing pass since the last check
        (its gradient would use another f). No step waits for it: such a micro-batch's
        gradient is NaN (`_NanGradientIf`), so its step's update is skipped on the device, on
        every rank (the gradients' reduction carries the NaN), as a non-finite gradient's is.
        Collective (every rank calls it, at the same step): the ranks' flags are agreed in one
        scalar all-reduce (MAX) and read once. `metrics` calls it, so the run stops at the
        next record; a trainer calls it too before it writes a checkpoint, which would hold
        the skipped steps as if they had been taken."""
        if not self.mode.routing_pass:
            return
        differs, self.differs = self.differs, None
        flag = torch.zeros((), dtype=torch.int32, device=self.info.device)
        if differs is not None:
            flag = differs.to(self.info.device, torch.int32)
        if self.info.distributed:  # the world's ranks: every one of them stops
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if bool(flag):
            raise RoutingNotRepeated(
                "moe.balance=global: a micro-batch routed differently in its backward pass than "
                "in the routing pass (a forward that depends on more than the weights, the "
                "batch and the random state?); the steps that held one were skipped (their "
                "gradients not applied), and the run stops before a record or a checkpoint "
                "counts them as taken. Make the model's routing depend on its weights, its "
                "batch and the random state only, or set moe.balance=micro or none"
            )

    def prepare_window(
        self,
        ctx: Any,
        window: Sequence[Any],
        global_count: torch.Tensor,
        guard: WindowGuard = NO_GUARD,
    ) -> None:
        """Before any backward: what the mode needs (`Balance.prepare`; with `global`, the
        routing pass and its one all-reduce: `count_step`)."""
        dp = ctx.parallel.dp_size
        self.across = ctx.parallel if isinstance(ctx.parallel, SumsAcrossGroups) else None
        if self.across is not None:  # the routing pass draws as each backward will
            guard = self.across.keyed_guard(ctx, len(window), guard)
        prepared = Window(global_count.clamp(min=1), len(window) * dp, list(window))
        self.window = self.mode.prepare(self, ctx, prepared, guard)

    def count_step(self, ctx: Any, window: Window, guard: WindowGuard = NO_GUARD) -> StepSums:
        """The routing pass over `window`'s micro-batches (their random states and counts kept
        in `window.replays`) and its one all-reduce: the whole step's sums. Each forward of
        the pass runs under `guard.micro_batch`, like a backward's (under
        train.micro_batch_size=auto: ranks agree after each, so an out-of-memory error on one
        rank is every rank's `OutOfMemoryAgreed` before any of them reaches the counts'
        all-reduce)."""
        with ctx.clock.span("moe routing pass"):
            sums = self.routing_pass(ctx, window, guard)
        with ctx.clock.collective("moe routing counts"):
            flat = self.all_reduce(sums)
        return StepSums.unflat(flat, len(self.routers), self.experts, self.top_k)

    def routing_pass(self, ctx: Any, window: Window, guard: WindowGuard = NO_GUARD) -> torch.Tensor:
        batches = window.batches
        devices = cuda_devices(ctx, batches)
        total: torch.Tensor | None = None
        for i, batch in enumerate(batches):

            def look(b: Any = batch) -> tuple[RandomState, LayerSums]:
                # Captured inside the guard: a keyed guard (ft) seeds each micro-batch first.
                return RandomState.capture(devices), self.route(ctx, b)

            try:
                state, sums = guard.micro_batch(i, len(batches), look)
            except OutOfMemoryAgreed as oom:  # named for what ran out: the routing pass
                raise OutOfMemoryAgreed(f"moe routing pass of the {oom.where}", oom.ranks) from None
            window.replays[id(batch)] = (state, sums.counts)
            total = sums.flat() if total is None else total + sums.flat()
        assert total is not None
        return total

    def route(self, ctx: Any, batch: Any) -> LayerSums:
        """One micro-batch forward without a graph, up to the last router when it can."""
        last = self.routers[-1]
        module = last.module if isinstance(last, HookedRouter) else last
        hook = None
        if self.cfg.stop_early and isinstance(module, nn.Module):
            hook = module.register_forward_hook(_stop)  # after the router's own hooks
        try:
            with torch.no_grad(), ctx.precision.autocast():
                self.task.loss_sum(ctx.model, batch)
        except RoutingDone:
            pass
        except BaseException:
            for r in self.routers:  # a forward that failed (out of memory): not kept alive
                r.routing = None
            raise
        finally:
            if hook is not None:
                hook.remove()
        return self.micro(batch).sums

    def micro(self, batch: Any) -> MicroRouting:
        """What the routers routed in `batch`'s forward, taken from them."""
        routings: list[Routing] = []
        for r in self.routers:
            if r.routing is None:
                raise RuntimeError(f"router {type(r).__name__} did not route in this forward")
            routings.append(r.routing)
            r.routing = None  # not kept alive (nor counted) past this micro-batch
        n = routings[0].logits.shape[0]
        sums = LayerSums.of(routings, routed_mask(batch, n, self.task))
        return MicroRouting(sums, routings, batch, self.top_k)

    def all_reduce(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` summed over every data-parallel rank of the step, before its backward: this
        group's, and across replica groups (ft) the quorum's."""
        flat = self.group_sum(flat)
        if self.across is not None:
            self.across.sum_across_groups(flat)
        return flat

    def group_sum(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` summed over this group's data-parallel ranks (`group`)."""
        flat = flat.to(self.info.device)
        if self.info.distributed:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        return flat

    # ---- across replica groups (engine/parallel/base.py's `KeepsWindowSums`) ----
    def take_window_sums(self) -> dict[str, torch.Tensor]:
        """This rank's sums of the window's forwards that `step_sums` adds up after the step
        (the modes without a routing pass), taken: summed across the replica groups with the
        gradients, they come back through `put_window_sums` when the window commits."""
        window = self.window
        if window is None or window.step is not None or not window.local:
            return {}
        local, window.local = torch.stack(window.local).sum(0), []
        return {WINDOW_SUMS: local}

    def put_window_sums(self, sums: dict[str, torch.Tensor]) -> None:
        assert self.window is not None
        self.window.local = [sums[WINDOW_SUMS]]

    def balance_term(self, share: Share) -> torch.Tensor | None:
        """This micro-batch's share of aux_coef * aux + z_coef * z, per loss item."""
        term = None
        if share.aux is not None:
            term = self.aux_coef * share.aux
        if share.z is not None and self.cfg.z_coef:
            z = self.cfg.z_coef * share.z
            term = z if term is None else term + z
        return term

    # ---- after the update ----
    def step_sums(self) -> StepSums | None:
        """The last step's sums over every micro-batch and rank (collective outside `global`,
        once per step: every rank calls it)."""
        window = self.window
        if window is None:
            return None
        if window.step is None and window.local:
            flat = self.group_sum(torch.stack(window.local).sum(0))
            window.step = StepSums.unflat(flat, len(self.routers), self.experts, self.top_k)
        return window.step

    def update_bias(self) -> None:
        """`bias`: after each optimizer step, every router's bias moves by `bias_rate` towards
        balance, from the whole step's assignments (every micro-batch, every rank): up for
        experts below the mean load, down for those above (DeepSeek-V3)."""
        sums = self.step_sums() if self.mode.moves_bias else None
        if sums is None:
            return
        with torch.no_grad():
            for router, counts in zip(self.routers, sums.counts):  # (E,) each
                if not isinstance(router, BiasedRouter):
                    raise TypeError(f"moe.balance=bias needs routers with a `bias`; {router!r}")
                step = self.cfg.bias_rate * torch.sign(counts.mean() - counts)
                router.bias.add_(step.to(router.bias.device, router.bias.dtype))

    # ---- records ----
    def metrics(self) -> dict[str, torch.Tensor]:
        """The last step's whole-batch aux, z-loss and load (collective outside `global` and
        `bias`: every rank calls it when a record is due); with `global`, first the routing
        check of the steps since the last record (`check_routing`)."""
        self.check_routing()
        sums, window = self.step_sums(), self.window
        if sums is None or window is None:
            return {}
        return {**sums.records(self.objective), **self.mode.records(sums, window)}


class BalancedEvalTask(BalancedTask):
    """A `BalancedTask` around a task with evaluation sums of its own (`val/accuracy`)."""

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        return self.task.eval_sums(model, batch)


def balanced(
    task: Any,
    routers: Sequence[Routed],
    cfg: BalanceCfg,
    info: DistInfo,
    group: Any = None,
    objective: BalanceObjective | None = None,
) -> BalancedTask:
    """`task` with the routers' balancing by the model's `objective` (default: Switch's per
    layer); its evaluation sums kept when it has them."""
    kind = BalancedEvalTask if isinstance(task, EvalTask) else BalancedTask
    return kind(task, routers, cfg, info, group, objective)


class _NanGradientIf(torch.autograd.Function):
    """The identity; in backward, a NaN gradient where `flag` (a bool tensor) is set: decided
    on the device, no host read."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(flag)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (flag,) = ctx.saved_tensors
        return torch.where(flag.to(grad.device), torch.full_like(grad, float("nan")), grad), None


def _stop(module: nn.Module, args: Any, output: Any) -> None:
    del module, args, output
    if counted():  # not in a forward whose routing is not the model's (DPO's reference)
        raise RoutingDone
