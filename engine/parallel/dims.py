"""`ParallelDims`: the degrees of every kind of parallelism and the strategy, decided once.

A frozen value, validated in one place: every layout that cannot exist is refused here, with
the config key that asks for it (`LayoutError`), before anything is built. It knows the
world's shape (`pp x dp x cp x tp`), builds the device mesh once, and returns the one
parallelism the run uses. Importing it costs nothing: torch loads only when a mesh is built.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from engine.distributed import DistInfo
    from engine.parallel.base import Parallelism, RunShape

from engine.parallel import LayoutError
from engine.parallel.pipeline.schedule import SCHEDULES

STRATEGIES = ("ddp", "fsdp")
CP_IMPLS = ("allgather", "ring")  # engine/parallel/context.py
MESH_DIMS = ("pp", "dp", "cp", "tp")  # the mesh's dimension names, outermost first
_NAMES = {"pp": "pipeline", "cp": "context-parallel", "tp": "tensor-parallel"}


def _require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise LayoutError(key, message)


@dataclass(frozen=True)
class ParallelDims:
    """How a job's ranks are laid out. `world` None: checked for every world size that could
    host it (config time); `for_world` fixes it and checks that it divides."""

    pp: int = 1
    tp: int = 1
    cp: int = 1
    strategy: str = "ddp"
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    pp_split: tuple[int, ...] | None = None
    sequence_parallel: bool = False
    cp_impl: str = "allgather"
    ep: int = 1
    world: int | None = None

    def __post_init__(self) -> None:
        _require(
            self.strategy in STRATEGIES,
            "dist.strategy",
            f"must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}",
        )
        sizes = {
            "pp": self.pp,
            "pp_virtual": self.pp_virtual,
            "tp": self.tp,
            "cp": self.cp,
            "ep": self.ep,
        }
        for key, value in sizes.items():
            _require(
                type(value) is int and value > 0,
                f"dist.{key}",
                f"must be a positive number, got {value!r}",
            )
        _require(
            self.cp_impl in CP_IMPLS,
            "dist.cp_impl",
            f"must be one of {', '.join(CP_IMPLS)}, got {self.cp_impl!r}",
        )
        _require(
            not self.sequence_parallel or self.tp > 1,
            "dist.tp_sequence_parallel",
            "splits the sequence over tensor-parallel ranks: it needs dist.tp > 1",
        )
        _require(
            not (self.sequence_parallel and self.pp > 1),
            "dist.tp_sequence_parallel",
            "not available with dist.pp > 1 yet (the sequence is split on the first stage and "
            "gathered on the last); use dist.tp without it",
        )
        self._check_pipeline()
        if self.world is not None:
            self._check_world()

    def _check_pipeline(self) -> None:
        _require(
            self.pp_schedule in SCHEDULES,
            "dist.pp_schedule",
            f"must be one of {', '.join(SCHEDULES)}, got {self.pp_schedule!r}",
        )
        _require(
            self.pp_virtual == 1 or self.pp_schedule == "interleaved_1f1b",
            "dist.pp_virtual",
            f"more than one stage per rank needs dist.pp_schedule=interleaved_1f1b (it is "
            f"{self.pp_schedule}); got {self.pp_virtual}",
        )
        if self.pp_split is not None:
            stages = self.pp * self.pp_virtual
            _require(
                len(self.pp_split) == stages - 1,
                "dist.pp_split",
                f"must list {stages - 1} block indices (where stages 2..{stages} begin) for "
                f"dist.pp={self.pp} x dist.pp_virtual={self.pp_virtual}, got "
                f"{list(self.pp_split)}",
            )

    def _check_experts(self) -> None:
        if self.ep == 1:
            return
        for key, size in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp)):
            _require(
                size == 1,
                "dist.ep",
                f"does not compose with dist.{key}={size} yet (expert parallelism is carved from "
                f"the data-parallel ranks of DDP or FSDP2); set dist.ep=1 or "
                f"dist.{key}=1",
            )

    def _check_world(self) -> None:
        n = self.pp * self.tp * self.cp
        if self.world % n == 0 and self.dp % self.ep == 0:  # type: ignore[operator]
            return
        if self.world % n == 0:  # type: ignore[operator]
            raise LayoutError(
                "dist.ep",
                f"must divide the data-parallel size ({self.dp}), got {self.ep}: the experts "
                f"are split over groups of dist.ep ranks carved from the {self.dp} data-parallel "
                f"ranks; launch a multiple of {self.ep} ranks or set dist.ep to a divisor of "
                f"{self.dp}",
            )
        sizes = {"pp": self.pp, "cp": self.cp, "tp": self.tp}
        split = [k for k, size in sizes.items() if size > 1]
        key = f"dist.{split[0]}"
        what = " x ".join(_NAMES[k] for k in split)
        what += " stages" if split == ["pp"] else " ranks"
        shape = " x ".join(split)
        raise LayoutError(
            key,
            f"{n} {what} need a world that is a multiple of {n} ranks (world = {shape} x "
            f"data-parallel size); this run has {self.world}: launch with torchrun "
            f"--nproc_per_node={n} (or a multiple), or set {key}=1",
        )

    def check(self, shape: RunShape) -> None:
        """Refuse (`LayoutError`) what these degrees cannot run with, as far as the run's
        choices alone decide it: the degrees that do not compose with expert parallelism yet,
        and the choices beside it. No process group, mesh or world size is needed, so one
        process reaches each refusal before any rank builds a layout (cumulus's trainer asks
        its compatibility table first, trainer/run/compatibility.py). `shape` may hold only
        what the config fixes (its `accum` and `checkpoint_format` are read by the built
        parallelism's `check`, not here)."""
        self._check_experts()
        if self.ep > 1:
            from engine.parallel.expert import check_beside_experts

            check_beside_experts(shape)

    # ---- the shape ----
    def for_world(self, world: int) -> ParallelDims:
        """These degrees in a world of `world` ranks (checked)."""
        return replace(self, world=world)

    @property
    def dp(self) -> int:
        """The data-parallel size: what a global batch is split by."""
        if self.world is None:
            raise ValueError("ParallelDims.dp needs the world size (for_world)")
        return self.world // (self.pp * self.tp * self.cp)

    @property
    def splits_model(self) -> bool:
        """Ranks hold different parts of the model (pipeline stages, tensor-parallel shards)."""
        return self.pp > 1 or self.tp > 1

    def sizes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}

    def mesh(self, device_type: str) -> DeviceMesh | None:
        """The job's device mesh: `pp` blocks of consecutive ranks outermost, then the
        data-parallel ranks, then `cp`, and `tp` innermost (neighbouring ranks: the most
        traffic on the fastest links); a dimension of size 1 is left out, except `dp`. None on
        one process (nothing to communicate). Needs the process group."""
        if self.world is None or self.world == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        sizes = self.sizes()
        names = tuple(n for n in MESH_DIMS if sizes[n] > 1 or n == "dp")
        return init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)

    def build(self, info: DistInfo, mesh: DeviceMesh | None = None) -> Parallelism:
        """The parallelism of these degrees for this rank (builds the mesh unless given);
        degrees that do not compose (`check`) are refused before any group is built."""
        self._check_experts()
        dims = self if self.world == info.world_size else self.for_world(info.world_size)
        if mesh is None:
            mesh = dims.mesh(info.device.type)
        if dims.cp > 1:  # over the parallelism of a data-parallel dimension of dp x cp ranks
            from engine.parallel.context import ContextParallel

            cp_group = mesh.get_group("cp")  # type: ignore[union-attr]
            inner = replace(dims, cp=1).build(info)
            return ContextParallel(inner, info, dims.cp, cp_group, dims.cp_impl)
        if dims.pp > 1:
            from engine.parallel.pipeline import PipelineParallel

            return PipelineParallel(
                info,
                mesh,  # type: ignore[arg-type]
                dims.pp_schedule,
                dims.pp_virtual,
                dims.pp_split,
                fsdp=dims.strategy == "fsdp",
            )
        if dims.tp > 1:
            from engine.parallel.tensor import TensorParallel

            return TensorParallel(
                info,
                mesh,  # type: ignore[arg-type]
                fsdp=dims.strategy == "fsdp",
                sequence_parallel=dims.sequence_parallel,
            )
        if dims.ep > 1:
            from engine.parallel.expert import ExpertParallel, ExpertShardedParallel

            if dims.strategy == "fsdp":  # the other parameters sharded, the experts split
                return ExpertShardedParallel(info, dims.ep, mesh)
            return ExpertParallel(info, dims.ep, mesh)
        return build_parallelism(dims.strategy, info, mesh)


def build_parallelism(strategy: str, info: DistInfo, mesh: DeviceMesh | None = None) -> Any:
    """Plain data parallelism: the `strategy`'s (DDP or FSDP2); on one process the bare model
    (`DataParallel`'s no-op) whatever the strategy. `mesh` may be left out: FSDP then shards
    over its default mesh, which spans the same ranks."""
    from engine.parallel.ddp import DataParallel
    from engine.parallel.fsdp import FullyShardedDataParallel

    _require(
        strategy in STRATEGIES,
        "dist.strategy",
        f"must be one of {', '.join(STRATEGIES)}, got {strategy!r}",
    )
    if not info.distributed or strategy == "ddp":
        return DataParallel(info, mesh)
    return FullyShardedDataParallel(info, mesh)


def parallelism_of(model: nn.Module, info: DistInfo | None = None) -> Parallelism:
    """The parallelism an already wrapped `model` is under, for callers that built the model
    themselves (a `StepContext` given no `parallel`): FSDP2 modules are sharded, DDP (also
    inside `torch.compile`) is data-parallel over `info`'s ranks, anything else is the bare
    model of one process."""
    from torch import nn

    from engine.distributed import DistInfo
    from engine.parallel.ddp import DataParallel
    from engine.parallel.fsdp import FullyShardedDataParallel, is_sharded

    info = info or DistInfo()
    if is_sharded(model):
        return FullyShardedDataParallel(info)
    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper keeps its module here
    if isinstance(inner, nn.parallel.DistributedDataParallel):
        return DataParallel(info)
    return DataParallel(DistInfo(device=info.device))
