"""`plan.search=true`: the valid layouts of the simulated world, ranked by predicted step time.

Every layout (pipeline, tensor- and context-parallel degrees that divide the world, DDP or
FSDP2, activation checkpointing off or on, the same global batch in the largest micro-batch
that fits) is first estimated from the planned layout's measured breakdown, scaled by what
each degree divides (model state by the ranks sharing it, activations by the tokens and the
layers a rank holds, times the micro-batches a pipeline keeps in flight). That screening is an
estimate; the `SIMULATED` fastest layouts it finds fitting are then simulated like the plan
itself (trainer/planning/plan.py), and their measured peak decides. Layouts a model cannot
run (heads that do not divide, no pipeline stages or context-parallel hook) are left out, as
the simulation's refusal says.

A mixture of experts runs without pipeline, tensor or context parallelism (trainer/run/moe.py):
its layouts are DDP or FSDP2 with each expert-parallel degree (`dist.ep`) that divides the
world and the expert count, checkpointing off or on. Its traffic outweighs its compute (a
token goes through top-k of the experts, every expert's weights are moved), so its screening
counts the bytes each collective moves in that layout, as the simulation counts them
(`mixture_traffic`), and estimates the step from them as a plan does; the experts' state is
split by `ep` (not sharded by FSDP2 beside it), the rest by the strategy.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from engine.parallel import LayoutError
from engine.parallel.dims import ParallelDims
from trainer.config.errors import UserError
from trainer.config.schema import Config, DistCfg
from trainer.planning.estimate import estimate
from trainer.planning.gpus import GPUS
from trainer.planning.plan import plan_run
from trainer.planning.progress import Progress
from trainer.run.batch_plan import BatchPlan
from trainer.run.compatibility import Choices, refused

SIMULATED = 3  # how many screened layouts are simulated in full
AC_KEEPS = 0.15  # screening: the share of a block's activations checkpointing keeps (inputs)
COMM_TP, COMM_CP, COMM_FSDP = 0.15, 0.10, 0.05  # screening: traffic as a share of compute


@dataclass
class Layout:
    dims: ParallelDims
    activation_checkpointing: bool
    micro: int
    peak_bytes: float
    step_time_s: float
    simulated: bool = False
    experts: bool = False  # a mixture's layout: its expert-parallel degree is one of them

    def overrides(self) -> list[str]:
        d = self.dims
        return [
            f"dist.pp={d.pp}",
            f"dist.tp={d.tp}",
            f"dist.cp={d.cp}",
            *([f"dist.ep={d.ep}"] if self.experts else []),
            f"dist.strategy={d.strategy}",
            f"model.activation_checkpointing={str(self.activation_checkpointing).lower()}",
            f"train.micro_batch_size={self.micro}",
        ]

    def as_json(self, capacity: float) -> dict[str, Any]:
        return {
            "overrides": self.overrides(),
            "fits": self.peak_bytes <= capacity,
            "step_time_s": self.step_time_s,
            "peak_bytes": int(self.peak_bytes),
            "how": "simulated" if self.simulated else "estimated",
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    world: int, base: ParallelDims, experts: int | None = None, ep: bool = True
) -> list[tuple[ParallelDims, bool]]:
    """Every layout of `world` ranks the degrees allow, with and without checkpointing; of a
    mixture of `experts` experts, its data- and expert-parallel layouts (`ep` false: the
    run's other choices refuse dist.ep > 1, `ep_refused`)."""
    if experts is not None:
        return mixture_candidates(world, base, experts, ep)
    out = []
    for pp in _divisors(world):
        for tp in _divisors(world // pp):
            for cp in _divisors(world // (pp * tp)):
                for strategy in ("ddp", "fsdp"):
                    if strategy == "fsdp" and world // (pp * tp) == 1:
                        continue  # nothing to shard over
                    try:
                        dims = dataclasses.replace(
                            base, pp=pp, tp=tp, cp=cp, strategy=strategy, pp_split=None,
                            sequence_parallel=False, world=world,
                        )  # fmt: skip
                    except LayoutError:
                        continue
                    if any(refused(Choices(dims.tp, dims.pp, dims.cp, dims.ep))):
                        continue  # degrees the compatibility table refuses together
                    out += [(dims, False), (dims, True)]
    return out


def mixture_candidates(
    world: int, base: ParallelDims, experts: int, ep: bool
) -> list[tuple[ParallelDims, bool]]:
    """A mixture's layouts: DDP or FSDP2 over the world, each expert-parallel degree that
    divides the world and `experts` (only 1 when not `ep`), with and without checkpointing."""
    out = []
    for degree in _divisors(world) if ep else [1]:
        for strategy in ("ddp", "fsdp"):
            if experts % degree or (strategy == "fsdp" and world == 1):
                continue
            dims = dataclasses.replace(
                base, pp=1, tp=1, cp=1, ep=degree, strategy=strategy, pp_split=None,
                sequence_parallel=False, world=world,
            )  # fmt: skip
            out += [(dims, False), (dims, True)]
    return out


def ep_refused(cfg: Config) -> bool:
    """Whether the run's other choices refuse dist.ep > 1 (task=dpo, step=sam, ...): the
    compatibility table's rows the config decides, as training asks them before any process
    group (trainer/run/lifecycle.py's `check_choices`)."""
    from trainer.run.build import build_callbacks, build_step

    step, callbacks = build_step(cfg.step), build_callbacks(cfg.callbacks, cfg.train)
    d = cfg.dist
    choices = Choices(d.tp, d.pp, d.cp, 2, cfg, training=True, step=step, callbacks=callbacks)
    return any(refused(choices))


def screen(
    base_dims: ParallelDims, base_ac: bool, plan: Any, dims: ParallelDims, ac: bool,
    global_batch: int, capacity: float, traffic: Traffic | None = None,
) -> Layout | None:  # fmt: skip
    """The layout's largest fitting micro-batch and step time, scaled from the plan (the
    first role, usually the heaviest: a pipeline's first stage holds the most in flight);
    a mixture's (`traffic`) step time from the bytes its collectives move."""
    role = max(plan.roles, key=lambda r: r.memory.peak_bytes).memory
    routed = traffic.routed_share if traffic is not None else 0.0
    base_state = _state_fraction(base_dims, routed)
    share = _state_fraction(dims, routed) / base_state
    state = (role.parameters_bytes + role.gradients_bytes + role.optimizer_bytes) * share
    # DDP's buckets: a copy of the gradients, less the experts dist.ep keeps out of DDP.
    if dims.strategy == "ddp" and base_dims.strategy == "ddp":
        buckets = sum(role.untracked.values()) / _bucketed(base_dims, routed)
        state += buckets * _bucketed(dims, routed)
    elif dims.strategy == "ddp" and dims.dp * dims.cp > 1:
        state += role.gradients_bytes / base_state * _bucketed(dims, routed)
    base_micro = plan.micro
    per_sample = (role.activations_bytes + role.temporaries_bytes) / base_micro
    per_sample *= (base_dims.cp * base_dims.tp * base_dims.pp) / (dims.cp * dims.tp * dims.pp)
    per_sample *= (AC_KEEPS if ac else 1.0) / (AC_KEEPS if base_ac else 1.0)
    if global_batch % dims.dp:
        return None
    per_rank = global_batch // dims.dp
    inflight = 1
    fitting = []
    for micro in _divisors(per_rank):
        accum = per_rank // micro
        if dims.pp > 1 and dims.pp_schedule == "interleaved_1f1b" and accum % dims.pp:
            continue
        inflight = min(dims.pp, accum) if dims.pp > 1 else 1
        peak = state + per_sample * micro * inflight
        if peak <= capacity:
            fitting.append((micro, peak, accum))
    if not fitting:
        micro = 1
        peak = state + per_sample * inflight
        return Layout(dims, ac, micro, peak, float("inf"), experts=traffic is not None)
    micro, peak, accum = fitting[-1]
    if traffic is not None:
        return Layout(dims, ac, micro, peak, traffic.step_time_s(dims, ac, micro), experts=True)
    # The plan's compute, without its own pipeline bubble and checkpointing, then this one's.
    compute = plan.estimate.compute_s / _bubble(base_dims, plan.accum)
    compute *= (4 / 3 if ac else 1.0) / (4 / 3 if base_ac else 1.0)
    return Layout(dims, ac, micro, peak, compute * _bubble(dims, accum) * _traffic(dims))


@dataclass(frozen=True)
class Traffic:
    """What a mixture's step moves in a layout, from the whole model's sizes: the bytes each
    collective moves per step on a rank, as the simulation counts them (the largest tensor of
    each call; docs/plan.md), and the step time a plan estimates from them."""

    plan: Any  # the planned layout's Plan (its work, mixture sizes and global batch)
    gpu: Any
    gpus_per_node: int
    routing_pass: bool  # moe.balance=global: a whole forward more before the window's

    @property
    def routed_share(self) -> float:
        return self.plan.mixture.routed / self.plan.parameters

    def comm(self, dims: ParallelDims, ac: bool, micro: int) -> dict[str, int]:
        """Per rank per step: the experts' all-to-all (dispatch and combine, each forward and
        backward, the bytes leaving the rank) and their gradients over their replicas; FSDP2's
        gathers of what it shards (every forward and backward of every micro-batch) and its
        reduce-scatter, or DDP's all-reduce of its buckets; gradients in fp32."""
        plan, mixture = self.plan, self.plan.mixture
        low = 2 if plan.work.low_precision else 4  # bf16 activations and FSDP2's gathers
        forwards = 2 if self.routing_pass else 1
        tokens = plan.global_batch * plan.work.seq_len // dims.dp
        out: dict[str, int] = {}
        if dims.ep > 1:
            passes = forwards + 1 + (1 if ac else 0)  # + the recomputed forward
            sent = tokens * mixture.dispatched * low * 2 * passes * (dims.ep - 1) // dims.ep
            out["alltoall_base/ep"] = sent
            if dims.dp > dims.ep:
                out["allreduce/ep_replica"] = mixture.routed // dims.ep * 4
        layout = plan.parameters - (mixture.routed if dims.ep > 1 else 0)  # the rest's
        if dims.strategy == "fsdp":
            windows = plan.global_batch // (dims.dp * micro)
            out["allgather_base/dp"] = layout * low * windows * (forwards + 1)
            out["reduce_scatter_base/dp"] = layout * 4
        elif dims.dp > 1:
            out["allreduce/dp (DDP buckets)"] = layout * 4
        return out

    def step_time_s(self, dims: ParallelDims, ac: bool, micro: int) -> float:
        work = dataclasses.replace(self.plan.work, checkpointing=ac)
        per_rank = self.plan.global_batch // dims.dp
        batch = BatchPlan(micro, per_rank // micro, dims.dp, self.plan.global_batch)
        comm = self.comm(dims, ac, micro)
        return estimate(work, dims, batch, comm, self.gpu, self.gpus_per_node).step_time_s


def _state_fraction(dims: ParallelDims, routed: float) -> float:
    """The share of the whole model's state (parameters, gradients, moments) one rank holds:
    the routed experts (`routed` of the parameters) split by dist.ep, or else laid out as the
    rest, which the strategy shares (`_state_share`)."""
    rest = 1.0 / _state_share(dims)
    experts = 1.0 / (dims.pp * dims.tp * dims.ep) if dims.ep > 1 else rest
    return (1.0 - routed) * rest + routed * experts


def _bucketed(dims: ParallelDims, routed: float) -> float:
    """The share of the whole model's gradients in one rank's DDP buckets (DDP ignores the
    experts dist.ep splits)."""
    return (1.0 - (routed if dims.ep > 1 else 0.0)) / (dims.pp * dims.tp)


def _traffic(dims: ParallelDims) -> float:
    """Screening's stand-in for the collectives it does not simulate: each doubling of the
    tensor-parallel degree costs COMM_TP of the compute, of context parallelism COMM_CP,
    FSDP2's exposed gathers COMM_FSDP (assumptions; simulated layouts measure instead)."""
    factor = 1 + COMM_TP * math.log2(dims.tp) + COMM_CP * math.log2(dims.cp)
    return factor + (COMM_FSDP if dims.strategy == "fsdp" else 0.0)


def _bubble(dims: ParallelDims, accum: int) -> float:
    """A pipeline's time over its compute: (pp - 1) idle micro-batch slots per window."""
    return (accum + (dims.pp - 1) / dims.pp_virtual) / accum if dims.pp > 1 else 1.0


def _state_share(dims: ParallelDims) -> float:
    """How many ranks share one copy of the model's state (parameters, gradients, moments)."""
    share = dims.pp * dims.tp
    return share * (dims.dp * dims.cp if dims.strategy == "fsdp" else 1)


def search(cfg: Config, plan: Any, progress: Progress | None = None) -> list[dict[str, Any]]:
    """The valid layouts, fitting first, each group fastest first."""
    progress = progress or Progress(every=float("inf"))
    pc = cfg.plan
    gpu = GPUS[pc.gpu]
    capacity = (pc.memory_bytes or gpu.memory_bytes) * (1 - pc.headroom)
    base_dims = cfg.dist.dims(pc.world)
    global_batch = plan.global_batch
    base_ac = bool(cfg.model.get("activation_checkpointing", False))
    traffic, experts = None, None
    if plan.mixture is not None:
        experts = plan.mixture.experts
        traffic = Traffic(plan, gpu, pc.gpus_per_node, cfg.moe.balance == "global")
    layouts = candidates(pc.world, base_dims, experts, experts is None or not ep_refused(cfg))
    screened = [
        layout
        for dims, ac in layouts
        if (layout := screen(base_dims, base_ac, plan, dims, ac, global_batch, capacity, traffic))
    ]
    screened.sort(key=lambda lay: (lay.peak_bytes > capacity, lay.step_time_s))
    simulated = 0
    for layout in screened:
        if simulated == SIMULATED or layout.peak_bytes > capacity:
            break
        progress.prefix = f"search {simulated + 1}/{SIMULATED} ({' '.join(layout.overrides())}), "
        try:
            result = plan_run(with_layout(cfg, layout, global_batch), progress)
        except (UserError, LayoutError):
            layout.peak_bytes = float("inf")  # the model cannot run it: refused
            continue
        finally:
            progress.prefix = ""
        layout.peak_bytes = max(r.memory.peak_bytes for r in result.roles)
        layout.step_time_s = result.estimate.step_time_s
        layout.simulated = True
        simulated += 1
    # Fitting first; among them the simulated (measured) ones, then the screened estimates.
    screened.sort(key=lambda lay: (lay.peak_bytes > capacity, not lay.simulated, lay.step_time_s))
    return [lay.as_json(capacity) for lay in screened if lay.peak_bytes != float("inf")]


def with_layout(cfg: Config, layout: Layout, global_batch: int) -> Config:
    """`cfg` with the layout's degrees, checkpointing and micro-batch, the global batch kept."""
    d = layout.dims
    dist = dataclasses.replace(
        cfg.dist, pp=d.pp, tp=d.tp, cp=d.cp, ep=d.ep, strategy=d.strategy, pp_split=None,
        tp_sequence_parallel=False,
    )  # fmt: skip
    DistCfg.__post_init__(dist)
    train = dataclasses.replace(
        cfg.train, micro_batch_size=layout.micro, global_batch_size=global_batch
    )
    model = OmegaConf.to_container(OmegaConf.create(cfg.model))
    model["activation_checkpointing"] = layout.activation_checkpointing  # type: ignore[index]
    return dataclasses.replace(cfg, dist=dist, train=train, model=model)
