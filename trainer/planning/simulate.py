"""The planner behind `python -m trainer.plan`: the real run built for a simulated world of W
GPUs on this machine, and whether it fits, before anyone rents the GPUs.

For one representative rank of each distinct role (each pipeline stage; the ranks of a
stage's data-, tensor- and context-parallel coordinates hold the same shapes), the planner
joins a fake process group of W ranks as that rank, builds the same model, task, parallelism,
optimizer and step strategy `trainer.train` builds (`trainer.run.assemble`, `trainer.run.build`'s
builders: one path, no copy), with the model's tensors fake (shapes and dtypes, no memory),
and runs two real training steps (the window of micro-batches, backward, clipping, the
update; the second with the optimizer's state) through the real step code under the tracker
`train.memory_report=true` uses on a real run (trainer/run/memory.py). Collectives return at once;
their bytes are counted by collective and mesh dimension. A pipeline stage receives what the
previous stage's simulated rank sent (its shapes). Nothing is allocated; the data is read for
one worst-case batch.

The report per role: the peak split into parameters, gradients, optimizer state, activations,
temporaries and buffers, and whether it fits the GPU with `plan.headroom` kept free; bytes
communicated per step; and an estimate (labelled so) of step time, tokens/s and MFU from the
model's FLOPs, the GPU's data-sheet peak and the efficiency assumptions below; and what
`train.micro_batch_size=auto` would choose. Printed as a table, written as `plan.json`.
docs/plan.md says how to read it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from engine.distributed import DistInfo
from engine.parallel.dims import ParallelDims
from trainer.config.schema import Config
from trainer.planning.gpus import GPU, GPUS
from trainer.run.assemble import Assembly, assemble, check_layout
from trainer.run.batch_plan import BatchPlan
from trainer.run.build import build_context, build_step, run_shape
from trainer.run.memory import MemoryReport, StepPeaks, report

# Efficiency assumptions of the time estimate (docs/plan.md): the fraction of the data-sheet
# peak FLOP/s a well-tuned transformer step reaches, and of link bandwidth a collective gets.
COMPUTE_EFFICIENCY = 0.5
LINK_EFFICIENCY = 0.7
STEPS = 2  # the first builds the optimizer's state; the second is a steady step


# ---- the simulated world -----------------------------------------------------------------
@contextlib.contextmanager
def meshes_outside_fake_tensors() -> Iterator[list[Any]]:
    """DeviceMeshes built while the model is laid out (FSDP2 over a tensor-parallel split
    builds one) compute their coordinates on real tensors: fake ones have no values. Yields
    every mesh built, for naming collectives' groups."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    built: list[Any] = []
    original = DeviceMesh.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            original(self, *args, **kwargs)
        built.append(self)

    DeviceMesh.__init__ = init  # type: ignore[method-assign]
    try:
        yield built
    finally:
        DeviceMesh.__init__ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """This process as rank `rank` of a fake process group of `world` ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


class CommCounter(TorchDispatchMode):
    """Bytes each collective moves, by collective and by the mesh dimension of its group
    ("other group": the default group, or one no mesh names)."""

    def __init__(self, meshes: list[Any], names: dict[str, str | None]) -> None:
        super().__init__()
        self.meshes = meshes
        self.bytes: dict[str, int] = {}
        # Shared by the roles of one plan: torch caches sub-meshes across the fake worlds,
        # so a later role's tensors may name a group an earlier role resolved.
        self._names = names
        self._spans: dict[tuple[int, ...], str] = {}
        self._known_meshes = 0

    def _dim_of(self, name: str) -> str | None:
        """The mesh dimension whose ranks a group (by name) spans; meshes built so far are
        looked at again when more were built (DTensor and FSDP2 build sub-meshes)."""
        if self._known_meshes != len(self.meshes):
            for mesh in self.meshes[self._known_meshes :]:
                for dim in mesh.mesh_dim_names or ():
                    with contextlib.suppress(Exception):
                        ranks = tuple(dist.get_process_group_ranks(mesh.get_group(dim)))
                        self._spans.setdefault(ranks, dim)
            self._known_meshes = len(self.meshes)
        if name not in self._names:
            from torch.distributed.distributed_c10d import _resolve_process_group

            try:
                ranks = tuple(dist.get_process_group_ranks(_resolve_process_group(name)))
            except (KeyError, RuntimeError, ValueError):
                return None
            self._names[name] = self._spans.get(ranks)
        return self._names[name]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _FUSED_UPDATES:
            # In place and allocation-free on a GPU; on fake DTensors the update would be
            # materialized out of place (copies of every state), which no real run does.
            return None
        if func.namespace in ("c10d", "_c10d_functional") and "wait" not in func.__name__:
            tensors = [a for a in _flat(args) if isinstance(a, torch.Tensor)]
            size = max((t.numel() * t.element_size() for t in tensors), default=0)
            # funcol's group is a name among its string arguments (beside a reduce op's);
            # c10d's the ProcessGroup itself, boxed (a ScriptObject).
            names = [a for a in _flat(args) if isinstance(a, str)]
            names += [n for n in map(_group_name, _flat(args)) if n]
            dims = [d for d in map(self._dim_of, names) if d]
            dim = dims[0] if dims else "other group"
            key = f"{func.__name__.split('.')[0].strip('_')}/{dim}"
            self.bytes[key] = self.bytes.get(key, 0) + size
        return func(*args, **kwargs)


_FUSED_UPDATES = {
    torch.ops.aten._fused_adamw_.default,
    torch.ops.aten._fused_adam_.default,
    torch.ops.aten._fused_sgd_.default,
}


def _group_name(x: Any) -> str | None:
    if type(x).__name__ != "ScriptObject":
        return None
    with contextlib.suppress(RuntimeError):  # another boxed class (a ReduceOp)
        return dist.ProcessGroup.unbox(x).group_name
    return None


def _flat(x: Any) -> Iterator[Any]:
    if isinstance(x, list | tuple):
        for v in x:
            yield from _flat(v)
    else:
        yield x


# ---- one rank --------------------------------------------------------------------------
@dataclass
class RolePlan:
    """One role's simulated rank: the ranks sharing its shapes, its memory, its traffic."""

    ranks: list[int]
    memory: MemoryReport
    comm_bytes: dict[str, int]
    fits: bool = False
    micro_auto: int | None = None


def worst_window(parts: Assembly, plan: BatchPlan, mode: Any) -> list[Any]:
    """The window of the longest sample (of the first 256) repeated: the most memory any
    micro-batch of this size needs (as `micro_batch_size=auto` probes), as fake tensors."""
    from torch.utils.data import default_collate

    from trainer.run.auto_batch import worst_case_sample

    collate = parts.data.collate_fn or default_collate
    batch = collate([worst_case_sample(parts.data.train)] * plan.micro)
    fake = _map(batch, mode.from_tensor)
    return [fake] * plan.accum


def _map(x: Any, fn: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_map(v, fn) for v in x)
    return x


def simulate_rank(
    cfg: Config,
    dims: ParallelDims,
    rank: int,
    book: dict[Any, Any],
    groups: dict[str, str | None] | None = None,
) -> tuple[MemoryReport, dict[str, int], Assembly, BatchPlan]:
    """Rank `rank` of the simulated world: the real run built on fake tensors, two steps."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    world = dims.world or 1
    info = DistInfo(rank, world, rank % 8, torch.device("cpu"))
    plan = BatchPlan.from_config(cfg.train, dims.dp)  # auto: the whole per-rank batch
    with fake_world(rank, world), meshes_outside_fake_tensors() as meshes:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        parts = assemble(cfg, info, dims, building=mode, simulated=book)
        window = worst_window(parts, plan, mode)  # read as real tensors, then faked
        with mode:
            ctx = build_context(cfg, parts, info)
            step_fn = build_step(cfg.step)
            check_layout(parts.parallel, run_shape(cfg, step_fn, ctx, plan))
            ctx.callbacks.setup(ctx)
            peaks, counter = StepPeaks(), CommCounter(meshes, {} if groups is None else groups)
            for _ in range(STEPS):
                with peaks.step(parts.wrapped, ctx.optimizer), counter:
                    step_fn(ctx, window)
            memory = report(peaks, parts.model, ctx.optimizer, parts.parallel)
    comm = {k: v // STEPS for k, v in counter.bytes.items()}
    sent = book.pop("sent_bytes", 0)  # a pipeline stage's sends to its neighbours
    if sent:
        comm["send/pp"] = sent // STEPS
    for key, value in memory.untracked.items():  # DDP's buckets are all-reduced over dp
        if key == "ddp_buckets":
            comm["allreduce/dp (DDP buckets)"] = value
    return memory, comm, parts, plan


def roles(dims: ParallelDims) -> list[list[int]]:
    """The ranks of each distinct role: one per pipeline stage (pp is the mesh's outermost
    dimension), every other coordinate alike."""
    world = dims.world or 1
    per_stage = world // dims.pp
    return [list(range(s * per_stage, (s + 1) * per_stage)) for s in range(dims.pp)]


# ---- the estimate ----------------------------------------------------------------------
@dataclass
class Estimate:
    step_time_s: float
    tokens_per_s: float
    mfu: float
    compute_s: float
    comm_s: dict[str, float] = field(default_factory=dict)


def estimate(
    cfg: Config, dims: ParallelDims, parts: Assembly, plan: BatchPlan, comm: dict[str, int],
    gpu: GPU, gpus_per_node: int,
) -> Estimate:  # fmt: skip
    """Step time from FLOPs and bytes under the stated assumptions: compute at
    COMPUTE_EFFICIENCY of the peak, split evenly over every rank, a pipeline's bubble on top;
    collectives at LINK_EFFICIENCY of the link their group spans (within a node: NVLink);
    data-parallel traffic overlapped with compute, the rest exposed."""
    world = dims.world or 1
    seq = parts.data.seq_len or 1
    tokens = plan.global_batch * seq
    flops = parts.flops_per_token * tokens
    if parts.model_extras.activation_checkpointing:
        flops *= 4 / 3  # the forward once more
    peak = gpu.bf16_flops if cfg.train.precision in ("bf16", "fp16") else gpu.fp32_flops
    compute = flops / (world * peak * COMPUTE_EFFICIENCY)
    if dims.pp > 1:  # 1F1B/GPipe bubble: (pp - 1) idle micro-batch slots per window
        compute *= (plan.accum + (dims.pp - 1) / dims.pp_virtual) / plan.accum
    inner = {"tp": dims.tp, "cp": dims.cp * dims.tp, "dp": dims.dp * dims.cp * dims.tp}
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
    fitting = [d for d in _divisors(plan.per_rank) if fixed + per_sample * d <= capacity]
    return fitting[-1] if fitting else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---- the command -------------------------------------------------------------------------
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
    layouts: list[dict[str, Any]] | None = None

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
            "planned_in_s": self.seconds,
        }
        if self.layouts is not None:
            out["layouts"] = self.layouts
        return out


def plan_run(cfg: Config) -> Plan:
    """Every role of `cfg`'s layout in a world of `plan.world` GPUs, simulated in turn."""
    started = time.perf_counter()
    pc = cfg.plan
    gpu = GPUS[pc.gpu]
    dims = cfg.dist.dims(pc.world)
    gpu_memory = pc.memory_bytes or gpu.memory_bytes
    capacity = gpu_memory * (1 - pc.headroom)
    book: dict[Any, Any] = {}  # what pipeline stages sent, for the next stage's rank
    groups: dict[str, str | None] = {}  # process-group names -> mesh dimensions
    planned: list[RolePlan] = []
    comm_total: dict[str, int] = {}
    parts = plan = None
    for ranks in roles(dims):
        memory, comm, parts, plan = simulate_rank(cfg, dims, ranks[0], book, groups)
        role = RolePlan(ranks, memory, comm, memory.peak_bytes <= capacity)
        role.micro_auto = auto_micro(memory, plan, capacity)
        planned.append(role)
        for k, v in comm.items():
            comm_total[k] = max(comm_total.get(k, 0), v)
    assert parts is not None and plan is not None
    est = estimate(cfg, dims, parts, plan, comm_total, gpu, pc.gpus_per_node)
    layout = parts.parallel.describe() or (
        f"data parallel ({cfg.dist.strategy})" if dims.dp > 1 else "one GPU"
    )
    return Plan(
        pc.world, pc.gpu, gpu_memory, parts.n_params, planned, est, layout,
        time.perf_counter() - started, plan.micro, plan.accum, plan.global_batch,
    )  # fmt: skip


def table(p: Plan) -> str:
    """The plan as the console shows it."""
    gib = 2**30
    lines = [
        f"plan: {p.layout} on {p.world} x {p.gpu} ({p.gpu_memory_bytes / 1e9:.0f} GB), "
        f"{p.parameters:,} parameters, planned in {p.seconds:.0f} s",
        f"{'ranks':>12} | {'peak GiB':>9} | {'params':>7} | {'grads':>7} | {'optim':>7} | "
        f"{'activ':>7} | {'temps':>7} | fits | auto micro",
    ]
    for r in p.roles:
        m = r.memory
        span = f"{r.ranks[0]}-{r.ranks[-1]}" if len(r.ranks) > 1 else str(r.ranks[0])
        lines.append(
            f"{span:>12} | {m.peak_bytes / gib:9.2f} | {m.parameters_bytes / gib:7.2f} | "
            f"{m.gradients_bytes / gib:7.2f} | {m.optimizer_bytes / gib:7.2f} | "
            f"{m.activations_bytes / gib:7.2f} | {m.temporaries_bytes / gib:7.2f} | "
            f"{'yes' if r.fits else 'NO':>4} | {r.micro_auto if r.micro_auto else '-'}"
        )
    e = p.estimate
    lines.append(
        f"estimate (docs/plan.md's assumptions): step {e.step_time_s:.3f} s, "
        f"{e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu:.1%}"
    )
    for key, seconds in sorted(e.comm_s.items()):
        lines.append(f"  {key}: {seconds * 1000:.1f} ms per step")
    return "\n".join(lines)
