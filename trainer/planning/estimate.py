"""The plan's time estimate (an estimate, so labelled) and `micro_batch_size=auto`'s choice,
from the simulated memory and traffic, the model's FLOPs and the GPU's data sheet."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.parallel.dims import ParallelDims
from trainer.planning.gpus import GPU
from trainer.run.batch_plan import BatchPlan
from trainer.run.memory import MemoryReport

# Efficiency assumptions of the time estimate (docs/plan.md): the fraction of the data-sheet
# peak FLOP/s a well-tuned transformer step reaches, and of link bandwidth a collective gets.
COMPUTE_EFFICIENCY = 0.5
LINK_EFFICIENCY = 0.7


@dataclass
class Estimate:
    step_time_s: float
    tokens_per_s: float
    mfu: float
    compute_s: float
    comm_s: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Work:
    """What the step computes: the whole model's FLOPs per token, tokens per sample, and
    whether activation checkpointing runs the forward twice."""

    flops_per_token: float
    seq_len: int
    checkpointing: bool
    low_precision: bool  # bf16/fp16 (tensor-core peak) rather than fp32 (TF32)


def estimate(
    work: Work, dims: ParallelDims, plan: BatchPlan, comm: dict[str, int], gpu: GPU,
    gpus_per_node: int,
) -> Estimate:  # fmt: skip
    """Step time from FLOPs and bytes under the stated assumptions: compute at
    COMPUTE_EFFICIENCY of the peak, split evenly over every rank, a pipeline's bubble on top;
    collectives at LINK_EFFICIENCY of the link their group spans (within a node: NVLink);
    data-parallel traffic overlapped with compute, the rest exposed: the expert all-to-all
    (`/ep`: the bytes leaving each rank) sits between a layer's router and its experts."""
    world = dims.world or 1
    tokens = plan.global_batch * (work.seq_len or 1)
    flops = work.flops_per_token * tokens
    if work.checkpointing:
        flops *= 4 / 3  # the forward once more
    peak = gpu.bf16_flops if work.low_precision else gpu.fp32_flops
    compute = flops / (world * peak * COMPUTE_EFFICIENCY)
    if dims.pp > 1:  # 1F1B/GPipe bubble: (pp - 1) idle micro-batch slots per window
        compute *= (plan.accum + (dims.pp - 1) / dims.pp_virtual) / plan.accum
    inner = {"tp": dims.tp, "cp": dims.cp * dims.tp, "dp": dims.dp * dims.cp * dims.tp}
    # dist.ep's groups: ep consecutive data-parallel ranks; the replicas strided across dp.
    inner |= {"ep": dims.ep * dims.cp * dims.tp, "ep_replica": inner["dp"]}
    times: dict[str, float] = {}
    for key, nbytes in comm.items():
        dim = key.split("/")[1].split(" ")[0]
        span = inner.get(dim, world)
        link = gpu.node_link if span <= gpus_per_node else gpu.net_link
        times[key] = nbytes / (link * LINK_EFFICIENCY)
    overlapped = sum(v for k, v in times.items() if "/dp" in k)
    exposed = sum(v for k, v in times.items() if "/dp" not in k)
    step = max(compute, overlapped) + exposed
    return Estimate(step, tokens / step, flops / (step * world * peak), compute, times)


def auto_micro(memory: MemoryReport, plan: BatchPlan, capacity: float) -> int | None:
    """The divisor of the per-rank batch `micro_batch_size=auto` would choose, activations
    and temporaries taken as proportional to the micro-batch (an estimate)."""
    per_sample = (memory.activations_bytes + memory.temporaries_bytes) / plan.micro
    fixed = memory.peak_bytes - per_sample * plan.micro
    fitting = [d for d in divisors(plan.per_rank) if fixed + per_sample * d <= capacity]
    return fitting[-1] if fitting else None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
