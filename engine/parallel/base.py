"""How the model is spread over the job's ranks: a device mesh built once, and a parallelism.

A parallelism is the one object the rest of the run asks about data parallelism: it wraps or
shards the model (`apply`), names the data-parallel rank and size the loader reads, turns
gradient communication on and off around a micro-batch (`gradient_sync`), says what the
synchronized gradients are divided by (`sync_divisor`) and how a checkpoint holds the state
(`checkpoint_format`). Three implement it: `DataParallel` (DDP; the bare model on one
process), `FullyShardedDataParallel` (FSDP2's `fully_shard` on each block and the root) and
`PipelineParallel` (engine/parallel/pipeline/: stages over `pp`, its own window schedule, gradients
summed over `dp` after the window).

The mesh has one named dimension per kind of parallelism: `dp`, and `pp` outside it with a
pipeline (`tp` will join); the data-parallel rank is the rank along `dp`. A parallelism may
also run the window itself (`backward_window`), compute the total gradient norm over ranks
that hold different parameters (`grad_norm`) and agree on fp16 overflows
(`agree_found_inf`); the step asks for these only where they exist.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from engine.distributed import DistInfo, is_sharded

MESH_DIMS = ("pp", "dp", "tp")  # the mesh's dimension names, outermost first


def build_mesh(info: DistInfo, pp: int = 1, tp: int = 1) -> DeviceMesh | None:
    """The job's device mesh, built once per run: `pp` pipeline ranks (consecutive blocks of
    `world / pp` ranks each), the data-parallel ranks within each, and `tp` tensor-parallel
    ranks innermost (neighbouring ranks: the most traffic on the fastest links). Without
    either, every rank along `dp`. None on one process (nothing to communicate). Needs the
    process group (`init_distributed`)."""
    if not info.distributed:
        return None
    if info.world_size % (pp * tp):
        raise ValueError(
            f"the world ({info.world_size} ranks) is not a multiple of dist.pp x dist.tp = "
            f"{pp * tp}"
        )
    dims = {"pp": pp, "dp": info.world_size // (pp * tp), "tp": tp}
    names = tuple(n for n, size in dims.items() if size > 1 or n == "dp")
    shape = tuple(dims[n] for n in names)
    return init_device_mesh(info.device.type, shape, mesh_dim_names=names)


@runtime_checkable
class Parallelism(Protocol):
    """What the run needs to know about how the model is spread over ranks."""

    name: ClassVar[str]  # the `dist.strategy` value that selects it
    # Each block becomes its own unit (FSDP shards block by block): the model must declare its
    # blocks, and `torch.compile` applies per block rather than to the whole model.
    per_block: ClassVar[bool]
    # Parameters (and optimizer state, EMA averages) are sharded over ranks: forwards run in
    # lockstep on every rank, and only sharded checkpoints hold the whole state.
    shards_parameters: ClassVar[bool]

    @property
    def dp_rank(self) -> int:
        """This process's index among the data-parallel ranks (which slice of a batch)."""
        ...

    @property
    def dp_size(self) -> int:
        """How many data-parallel ranks split a global batch."""
        ...

    @property
    def dp_group(self) -> ProcessGroup | None:
        """The process group of this rank's data-parallel peers (None: the whole world), over
        which item counts are summed."""
        ...

    @property
    def sync_divisor(self) -> int:
        """What the wrapper divides synchronized gradients by (the step multiplies it back)."""
        ...

    @property
    def checkpoint_format(self) -> str:
        """`checkpoint.format=auto` resolves to this: `full` or `sharded`."""
        ...

    def apply(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module] = (),
        *,
        param_dtype: torch.dtype | None = None,
        reshard_after_forward: bool = True,
    ) -> nn.Module:
        """Wrap or shard `model` (with `blocks`, its repeated layers) for this parallelism."""
        ...

    def gradient_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """Around forward *and* backward of a micro-batch: communicate gradients if `enabled`."""
        ...


class _OnMesh:
    """The data-parallel coordinates, from the mesh's `dp` dimension when there is one."""

    def __init__(self, info: DistInfo, mesh: DeviceMesh | None = None) -> None:
        self.info = info
        self.mesh = mesh

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp") if self.mesh is not None else self.info.rank

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size() if self.mesh is not None else self.info.world_size

    @property
    def dp_group(self) -> None:
        return None  # every rank: the data-parallel ranks are the whole world


class DataParallel(_OnMesh):
    """DistributedDataParallel over the `dp` ranks; the bare model on one process.

    DDP averages the all-reduced gradients, hence `sync_divisor` = the data-parallel size.
    """

    name = "ddp"
    per_block = False
    shards_parameters = False

    @property
    def sync_divisor(self) -> int:
        return self.dp_size  # 1 on one process: nothing wraps the model

    @property
    def checkpoint_format(self) -> str:
        return "full"

    def apply(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module] = (),
        *,
        param_dtype: torch.dtype | None = None,
        reshard_after_forward: bool = True,
    ) -> nn.Module:
        del blocks, param_dtype, reshard_after_forward  # DDP replicates the whole model
        if self.dp_size == 1:
            return model
        info = self.info
        device_ids = [info.device.index] if info.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, enabled: bool) -> Iterator[None]:
        # DDP's `no_sync` must cover the forward too (it records whether to reduce there).
        if enabled or not hasattr(model, "no_sync"):
            yield
        else:
            with model.no_sync():
                yield


class FullyShardedDataParallel(_OnMesh):
    """FSDP2: `fully_shard` on each block and the root over the mesh's `dp` dimension.

    FSDP's own division of gradients is turned off (sum reduction), so `sync_divisor` is 1 and
    the step's global-count normalization is the only one.
    """

    name = "fsdp"
    per_block = True
    shards_parameters = True

    @property
    def sync_divisor(self) -> int:
        return 1

    @property
    def checkpoint_format(self) -> str:
        return "sharded"

    def apply(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module] = (),
        *,
        param_dtype: torch.dtype | None = None,
        reshard_after_forward: bool = True,
    ) -> nn.Module:
        """`param_dtype` (bf16) computes with low-precision parameters; gradients are reduced
        in fp32."""
        if not self.info.distributed:
            return model
        from torch.distributed.fsdp import FSDPModule

        if not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
            raise RuntimeError(
                f"dist.strategy=fsdp needs a torch with FSDPModule.set_force_sum_reduction_for_"
                f"comms (this is {torch.__version__}); use dist.strategy=ddp or upgrade torch"
            )

        mesh = self.mesh["dp"] if self.mesh is not None else None  # None: FSDP's default mesh
        shard_units([*blocks, model], mesh, param_dtype, reshard_after_forward)
        return model

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, enabled: bool) -> Iterator[None]:
        # FSDP2 keeps unsharded gradients until a micro-batch with sync enabled reduce-scatters.
        model.set_requires_gradient_sync(enabled)
        yield


def shard_units(
    units: Sequence[nn.Module],
    mesh: DeviceMesh | None,
    param_dtype: torch.dtype | None,
    reshard: bool,
    placement: Any = None,
) -> None:
    """FSDP2 (`fully_shard`) on each unit, in order (blocks first, the root last), over
    `mesh`; gradients reduced in fp32 (float64 models: float64) as plain sums, never divided
    (the loss is already normalized by the global item count). `placement`: FSDP2's
    `shard_placement_fn`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # fp32, or float64 for a float64 model (fp32 would round its gradients).
    wide = any(p.dtype == torch.float64 for unit in units for p in unit.parameters())
    reduce_dtype = torch.float64 if wide else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for unit in units:
        fully_shard(
            unit,
            mesh=mesh,
            mp_policy=policy,
            reshard_after_forward=reshard,
            shard_placement_fn=placement,
        )
    for unit in units:  # a setting of each FSDP module, not inherited
        unit.set_gradient_divide_factor(1.0)
        # gloo lacks PREMUL_SUM; plain sums are exact for every backend.
        unit.set_force_sum_reduction_for_comms(True)


class MeshSplit:
    """The shared part of parallelisms that split the model over mesh dimensions besides
    `dp` (pipeline stages, tensor-parallel ranks): the data-parallel coordinates from the
    mesh, gradients summed by the parallelism itself (`sync_divisor` 1) and checkpoints in
    the `full` layout, gathered under the model's own parameter names."""

    def __init__(self, info: DistInfo, mesh: DeviceMesh) -> None:
        self.info, self.mesh = info, mesh

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size()

    @property
    def dp_group(self) -> ProcessGroup:
        return self.mesh.get_group("dp")

    @property
    def sync_divisor(self) -> int:
        return 1

    @property
    def checkpoint_format(self) -> str:
        return "full"


def local_values(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of a DTensor (a view: in-place changes reach the DTensor), or the
    tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor, the same on every rank (collective over its mesh), or
    the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def all_reduce_flat(tensors: list[torch.Tensor], group: ProcessGroup | None) -> None:
    """Sum `tensors` over `group` in place, one collective per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM, group=group)
        offset = 0
        for t in ts:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


PARALLELISMS: dict[str, type[DataParallel] | type[FullyShardedDataParallel]] = {
    cls.name: cls for cls in (DataParallel, FullyShardedDataParallel)
}
STRATEGIES = tuple(PARALLELISMS)


def build_parallelism(
    strategy: str, info: DistInfo, mesh: DeviceMesh | None = None
) -> DataParallel | FullyShardedDataParallel:
    """The parallelism `dist.strategy` names; on one process the bare model (`DataParallel`'s
    no-op) whatever the strategy. `mesh` (from `build_mesh`) may be left out: FSDP then shards
    over its default mesh, which spans the same ranks."""
    if not info.distributed:
        return DataParallel(info, mesh)
    if strategy not in PARALLELISMS:
        raise ValueError(
            f"dist.strategy={strategy!r} is not supported; valid: {', '.join(STRATEGIES)}"
        )
    return PARALLELISMS[strategy](info, mesh)


def parallelism_of(
    model: nn.Module, info: DistInfo | None = None
) -> DataParallel | FullyShardedDataParallel:
    """The parallelism an already wrapped `model` is under, for callers that built the model
    themselves (a `StepContext` given no `parallel`): FSDP2 modules are sharded, DDP (also
    inside `torch.compile`) is data-parallel over `info`'s ranks, anything else is the bare
    model of one process."""
    info = info or DistInfo()
    if is_sharded(model):
        return FullyShardedDataParallel(info)
    if isinstance(getattr(model, "_orig_mod", model), nn.parallel.DistributedDataParallel):
        return DataParallel(info)
    return DataParallel(DistInfo(device=info.device))
