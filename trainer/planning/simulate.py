"""One rank of a simulated world: the real run built on fake tensors, two real steps measured.

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

The integer tensors of the batch stay real (trainer/planning/values.py), so the model takes
the branches its real run takes. A mixture of experts routes uniformly over its experts
(trainer/planning/routing.py): the values that would choose the experts are fake.
trainer/planning/plan.py puts the roles together.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from engine.distributed import DistInfo
from engine.parallel.dims import ParallelDims
from engine.parallel.expert import ExpertSplit
from trainer.config.schema import Config
from trainer.planning.attention import CudaAttention
from trainer.planning.progress import Progress
from trainer.planning.routing import UniformRouting
from trainer.planning.values import RealIntegers, real_or_fake
from trainer.run.assemble import Assembly, assemble
from trainer.run.batch_plan import BatchPlan
from trainer.run.build import build_context, build_step
from trainer.run.layout import check_layout, run_shape
from trainer.run.memory import MemoryReport, StepPeaks, frozen_modules, report

STEPS = 2  # the first builds the optimizer's state; the second is a steady step


def first_window(dims: ParallelDims) -> int:
    """Micro-batches of the first step, which only has to build the optimizer's state (its
    peak is below the second's, which holds that state throughout): one, or a round of the
    interleaved pipeline schedule, which needs a multiple of `pp`."""
    return dims.pp if dims.pp_schedule == "interleaved_1f1b" and dims.pp > 1 else 1


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
        if func is torch.ops.aten._local_scalar_dense.default and _fake_scalar(args[0]):
            # A non-fused optimizer's step reads the step's overflow flag (`found_inf.item()`,
            # engine/numerics/precision.py): fake, it has no value; the plan is of a step
            # that updates (no overflow). No other value is read during a planned step.
            return 0.0 if args[0].dtype.is_floating_point else False
        if func in _FUSED_UPDATES:
            # In place and allocation-free on a GPU; on fake DTensors the update would be
            # materialized out of place (copies of every state), which no real run does.
            return None
        if func.namespace in ("c10d", "_c10d_functional") and "wait" not in func.__name__:
            tensors = [a for a in _flat(args) if isinstance(a, torch.Tensor)]
            size = max((t.numel() * t.element_size() for t in tensors), default=0)
            if func is torch.ops.c10d.alltoall_base_.default:
                size = _leaving_bytes(*args[1:5])
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


def _leaving_bytes(x: torch.Tensor, group: Any, _: list[int], in_splits: list[int]) -> int:
    """What an all-to-all sends to the other ranks: its input less the rows it keeps (its own
    split; even splits when none are given). Under uniform routing a rank receives as much."""
    pg = dist.ProcessGroup.unbox(group)
    total = x.numel() * x.element_size()
    rows = x.shape[0] if x.dim() else 1
    if rows == 0:
        return 0
    kept = in_splits[pg.rank()] if in_splits else rows // pg.size()
    return total - kept * (total // rows)


def _fake_scalar(x: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor) and x.numel() == 1


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
    micro-batch of this size needs (as `micro_batch_size=auto` probes): its integer tensors
    real (values.py), its floating-point ones fake."""
    from torch.utils.data import default_collate

    from trainer.run.auto_batch import worst_case_sample

    collate = parts.data.collate_fn or default_collate
    batch = collate([worst_case_sample(parts.data.train)] * plan.micro)
    simulated = _map(batch, lambda t: real_or_fake(t, mode))
    return [simulated] * plan.accum


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
    progress: Progress | None = None,
    blocks: int | None = None,
) -> tuple[MemoryReport, dict[str, int], Assembly, BatchPlan]:
    """Rank `rank` of the simulated world: the real run built on fake tensors, two steps.
    With `blocks` (blocks per stage) the report has every op's moment (extrapolate.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    progress = progress or Progress(every=float("inf"))
    role = progress.what
    world = dims.world or 1
    info = DistInfo(rank, world, rank % 8, torch.device("cpu"))
    plan = BatchPlan.from_config(cfg.train, dims.dp)  # auto: the whole per-rank batch
    with fake_world(rank, world), meshes_outside_fake_tensors() as meshes:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        progress.what = f"{role}: building the model and reading the data"
        parts = assemble(cfg, info, dims, building=mode, simulated=book)
        names = {} if groups is None else groups
        names.update(expert_groups(parts.parallel))  # before the counter resolves them
        window = worst_window(parts, plan, mode)  # integers real, floats faked
        with mode:
            ctx = build_context(cfg, parts, info)
            step_fn = build_step(cfg.step)
            check_layout(parts.parallel, run_shape(cfg, step_fn, ctx, plan))
            ctx.callbacks.setup(ctx)
            peaks, counter = StepPeaks(), CommCounter(meshes, names)
            progress.peaks, peaks.blocks = peaks, blocks
            for step in range(STEPS):
                progress.what = f"{role}: step {step + 1}/{STEPS}"
                if step == STEPS - 1:  # the steady step's traffic only
                    counter.bytes.clear()
                    book["sent_bytes"] = 0
                steps_window = window if step == STEPS - 1 else window[: first_window(dims)]
                tracked = peaks.step(parts.wrapped, ctx.optimizer, frozen_modules(parts.task))
                with (
                    no_cycle_collection(),
                    RealIntegers(),
                    CudaAttention(),
                    tracked,
                    counter,
                    UniformRouting(),
                ):
                    step_fn(ctx, steps_window)
            progress.peaks = None
            frozen = frozen_modules(parts.task)
            memory = report(peaks, parts.model, ctx.optimizer, parts.parallel, frozen)
    comm = dict(counter.bytes)
    sent = book.pop("sent_bytes", 0)  # a pipeline stage's sends to its neighbours
    if sent:
        comm["send/pp"] = sent
    for key, value in memory.untracked.items():  # DDP's buckets are all-reduced over dp
        if key == "ddp_buckets":
            comm["allreduce/dp (DDP buckets)"] = value
    return memory, comm, parts, plan


def expert_groups(parallel: Any) -> dict[str, str | None]:
    """Under `dist.ep`, the expert groups' names -> `ep` (the all-to-all and the experts' norm)
    and `ep_replica` (their gradients' all-reduce): process groups no mesh dimension names, and
    whose ranks a data-parallel dimension of as many ranks would claim."""
    if not isinstance(parallel, ExpertSplit):
        return {}
    named = {"ep": parallel.expert_group, "ep_replica": parallel.replica_group}
    return {g.group_name: dim for dim, g in named.items() if g is not None}


@contextlib.contextmanager
def no_cycle_collection() -> Iterator[None]:
    """Within: Python's cycle collector off, after one collection. A tensor held in a reference
    cycle is freed when the collector happens to run, which depends on everything the process
    allocated before (a plan's peak moved by 1.7% with the collector's threshold): the step's
    peak is then the same in any process."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def roles(dims: ParallelDims) -> list[list[int]]:
    """The ranks of each distinct role: one per pipeline stage (pp is the mesh's outermost
    dimension), every other coordinate alike."""
    world = dims.world or 1
    per_stage = world // dims.pp
    return [list(range(s * per_stage, (s + 1) * per_stage)) for s in range(dims.pp)]
