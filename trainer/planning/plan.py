"""The planner behind `python -m trainer.plan`: the real run built for a simulated world of W
GPUs on this machine, and whether it fits, before anyone rents the GPUs.

For one representative rank of each distinct role (each pipeline stage), the run is built on
fake tensors and stepped twice (trainer/planning/simulate.py). Where the model's blocks are
alike and a stage holds more than a few, the model is simulated with 2 and 3 blocks per
stage and every figure is taken on the line through them (trainer/planning/extrapolate.py);
`plan.full=true` simulates every block.

The report per role: the peak split into parameters, gradients, optimizer state, activations,
temporaries and buffers, and whether it fits the GPU with `plan.headroom` kept free; bytes
communicated per step; an estimate (labelled so) of step time, tokens/s and MFU
(trainer/planning/estimate.py); and what `train.micro_batch_size=auto` would choose. Printed
as a table (trainer/planning/table.py), written as `plan.json`. docs/plan.md says how to read
it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.distributed import DistInfo
from engine.model import find_blocks, flops_per_token
from engine.moe.active import MixtureSizes, mixture_sizes
from engine.parallel.dims import ParallelDims
from trainer.config.schema import Config
from trainer.planning import extrapolate
from trainer.planning.estimate import (
    COMPUTE_EFFICIENCY,
    LINK_EFFICIENCY,
    Estimate,
    Work,
    auto_micro,
    estimate,
)
from trainer.planning.gpus import GPUS
from trainer.planning.progress import Progress
from trainer.planning.routing import ASSUMPTION
from trainer.planning.simulate import RolePlan, roles, simulate_rank
from trainer.planning.table import describe
from trainer.run.batch_plan import BatchPlan


@dataclass
class Plan:
    world: int
    gpu: str
    gpu_memory_bytes: int
    parameters: int
    roles: list[RolePlan]
    estimate: Estimate
    layout: str
    seconds: float
    micro: int  # the planned micro-batch, accumulation and global batch
    accum: int
    global_batch: int
    how: str = "simulated"  # or how the figures were extrapolated
    layouts: list[dict[str, Any]] | None = None
    routing: str | None = None  # a mixture of experts' routing assumption (routing.py)
    work: Work | None = None  # what the step computes (the estimate's FLOPs)
    mixture: MixtureSizes | None = None  # a mixture of experts' sizes, of the whole model

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "world": self.world,
            "gpu": self.gpu,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "parameters": self.parameters,
            "layout": self.layout,
            "roles": [
                {
                    "ranks": r.ranks,
                    **{k: v for k, v in r.memory.as_dict().items() if k != "untracked"},
                    "untracked_bytes": r.memory.untracked,
                    "fits": r.fits,
                    "comm_bytes_per_step": r.comm_bytes,
                    "micro_batch_size_auto": r.micro_auto,
                }
                for r in self.roles
            ],
            "estimate": {
                "step_time_s": self.estimate.step_time_s,
                "tokens_per_s": self.estimate.tokens_per_s,
                "mfu": self.estimate.mfu,
                "compute_s": self.estimate.compute_s,
                "comm_s": self.estimate.comm_s,
                "assumptions": {
                    "compute_efficiency": COMPUTE_EFFICIENCY,
                    "link_efficiency": LINK_EFFICIENCY,
                },
            },
            "how": self.how,
            "planned_in_s": self.seconds,
        }
        if self.layouts is not None:
            out["layouts"] = self.layouts
        if self.routing is not None:
            out["moe_routing"] = self.routing
        if self.mixture is not None:  # what the estimate's FLOPs count
            out["active_parameters"] = self.mixture.active
        return out


@dataclass
class _Roles:
    """Every role of one simulated model: memory and traffic per role, what the step does."""

    memory: list[Any]
    comm: list[dict[str, int]]
    plan: BatchPlan
    work: Work
    parameters: int
    routing: str | None = None
    mixture: MixtureSizes | None = None


def _simulate_roles(
    cfg: Config, dims: ParallelDims, progress: Progress, note: str = "", blocks: int | None = None
) -> _Roles:
    book: dict[Any, Any] = {}  # what pipeline stages sent, for the next stage's rank
    groups: dict[str, str | None] = {}  # process-group names -> mesh dimensions
    memories, comms = [], []
    parts = plan = None
    every = roles(dims)
    for i, ranks in enumerate(every):
        span = f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
        progress.what = f"role {i + 1}/{len(every)} (ranks {span}){note}"
        memory, comm, parts, plan = simulate_rank(
            cfg, dims, ranks[0], book, groups, progress, blocks
        )
        memories.append(memory)
        comms.append(comm)
    assert parts is not None and plan is not None
    work = Work(
        parts.flops_per_token,
        parts.data.seq_len or 1,
        bool(parts.model_extras.activation_checkpointing),
        cfg.train.precision in ("bf16", "fp16", "fp8"),  # fp8: planned as bf16
    )
    routing = ASSUMPTION if parts.mixture is not None else None
    return _Roles(memories, comms, plan, work, parts.n_params, routing, parts.mixture)


def _whole_model(cfg: Config) -> Any:
    """The whole model built on fake tensors, not laid out (0.1 s for Llama-3-8B): its
    blocks, parameter count and FLOPs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainer.run.assemble import build_model

    info = DistInfo(0, 1, 0, torch.device("cpu"))
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, extras = build_model(cfg.model, info)
    return model, find_blocks(model, extras.block_classes)


def _sampled(cfg: Config, dims: ParallelDims, progress: Progress) -> _Roles | None:
    """The roles from SAMPLES blocks per stage, on the line to the real count; None where
    the shortcut does not apply (extrapolate.py)."""
    cut = extrapolate.shortcut(cfg, dims)
    if cut is None:
        return None
    progress.what = "building the whole model (its blocks and FLOPs)"
    model, blocks = _whole_model(cfg)
    if len(blocks) != cut.blocks or not extrapolate.alike(blocks):
        return None
    k0, k1 = extrapolate.SAMPLES
    small = _simulate_roles(cut.sample(cfg, k0), dims, progress, f", {k0} blocks per stage", k0)
    large = _simulate_roles(cut.sample(cfg, k1), dims, progress, f", {k1} blocks per stage", k1)
    at = cut.per_stage
    n_params = sum(p.numel() for p in model.parameters())
    flops = flops_per_token(model, small.work.seq_len)
    return _Roles(
        [extrapolate.memory(a, b, at) for a, b in zip(small.memory, large.memory)],
        [extrapolate.comm(a, b, at) for a, b in zip(small.comm, large.comm)],
        large.plan,
        Work(flops, small.work.seq_len, small.work.checkpointing, small.work.low_precision),
        n_params,
        large.routing,
        mixture_sizes(model),
    )


def plan_run(cfg: Config, progress: Progress | None = None) -> Plan:
    """Every role of `cfg`'s layout in a world of `plan.world` GPUs, simulated in turn."""
    started = time.perf_counter()
    progress = progress or Progress(every=float("inf"))
    pc = cfg.plan
    gpu = GPUS[pc.gpu]
    dims = cfg.dist.dims(pc.world)
    gpu_memory = pc.memory_bytes or gpu.memory_bytes
    capacity = gpu_memory * (1 - pc.headroom)
    sampled = None if pc.full else _sampled(cfg, dims, progress)
    found = sampled or _simulate_roles(cfg, dims, progress)
    how = "simulated"
    if sampled is not None:
        k0, k1 = extrapolate.SAMPLES
        how = f"extrapolated from {k0} and {k1} blocks per stage"
    planned, comm_total = [], {}
    for ranks, memory, comm in zip(roles(dims), found.memory, found.comm):
        role = RolePlan(ranks, memory, comm, memory.peak_bytes <= capacity)
        role.micro_auto = auto_micro(memory, found.plan, capacity)
        planned.append(role)
        for k, v in comm.items():
            comm_total[k] = max(comm_total.get(k, 0), v)
    est = estimate(found.work, dims, found.plan, comm_total, gpu, pc.gpus_per_node)
    plan = found.plan
    return Plan(
        pc.world, pc.gpu, gpu_memory, found.parameters, planned, est, describe(dims),
        time.perf_counter() - started, plan.micro, plan.accum, plan.global_batch, how,
        routing=found.routing, work=found.work, mixture=found.mixture,
    )  # fmt: skip
