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
from trainer.planning.gpus import GPUS
from trainer.planning.plan import plan_run
from trainer.planning.progress import Progress
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

    def overrides(self) -> list[str]:
        d = self.dims
        return [
            f"dist.pp={d.pp}",
            f"dist.tp={d.tp}",
            f"dist.cp={d.cp}",
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


def candidates(world: int, base: ParallelDims) -> list[tuple[ParallelDims, bool]]:
    """Every layout of `world` ranks the degrees allow, with and without checkpointing."""
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


def screen(
    base_dims: ParallelDims, base_ac: bool, plan: Any, dims: ParallelDims, ac: bool,
    global_batch: int, capacity: float,
) -> Layout | None:  # fmt: skip
    """The layout's largest fitting micro-batch and step time, scaled from the plan (the
    first role, usually the heaviest: a pipeline's first stage holds the most in flight)."""
    role = max(plan.roles, key=lambda r: r.memory.peak_bytes).memory
    share = _state_share(base_dims) / _state_share(dims)
    state = (role.parameters_bytes + role.gradients_bytes + role.optimizer_bytes) * share
    state += sum(role.untracked.values()) * share if dims.strategy == "ddp" else 0.0
    if dims.strategy == "ddp" and base_dims.strategy != "ddp" and dims.dp * dims.cp > 1:
        state += role.gradients_bytes * share  # DDP's buckets: a copy of the gradients
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
        return Layout(dims, ac, micro, peak, float("inf"))
    micro, peak, accum = fitting[-1]
    # The plan's compute, without its own pipeline bubble and checkpointing, then this one's.
    compute = plan.estimate.compute_s / _bubble(base_dims, plan.accum)
    compute *= (4 / 3 if ac else 1.0) / (4 / 3 if base_ac else 1.0)
    return Layout(dims, ac, micro, peak, compute * _bubble(dims, accum) * _traffic(dims))


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
    screened = [
        layout
        for dims, ac in candidates(pc.world, base_dims)
        if (layout := screen(base_dims, base_ac, plan, dims, ac, global_batch, capacity))
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
        cfg.dist, pp=d.pp, tp=d.tp, cp=d.cp, strategy=d.strategy, pp_split=None,
        tp_sequence_parallel=False,
    )  # fmt: skip
    DistCfg.__post_init__(dist)
    train = dataclasses.replace(
        cfg.train, micro_batch_size=layout.micro, global_batch_size=global_batch
    )
    model = OmegaConf.to_container(OmegaConf.create(cfg.model))
    model["activation_checkpointing"] = layout.activation_checkpointing  # type: ignore[index]
    return dataclasses.replace(cfg, dist=dist, train=train, model=model)
