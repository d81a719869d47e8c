"""`FullyShardedDataParallel`: FSDP2's `fully_shard` on each block and the root over the mesh's
`dp` dimension, gradients reduced as plain sums; and what FSDP2 needs to recover from an
out-of-memory error (agreed collectives, its per-iteration state reset)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from engine.distributed import unwrap
from engine.parallel.base import LayoutError, ParallelBase
from engine.window_task import loss_parameters


class PeerOutOfMemory(Exception):
    """Raised inside a collective's agreement on a rank that did not run out of memory itself:
    `ranks` other ranks did. The agreement has happened; the caller must not agree again."""

    def __init__(self, ranks: int) -> None:
        super().__init__(f"out of memory on {ranks} other rank(s)")
        self.ranks = ranks


class FullyShardedDataParallel(ParallelBase):
    """FSDP's own division of gradients is turned off (sum reduction), so `sync_divisor` is 1
    and the step's global-count normalization is the only one."""

    name = "fsdp"
    per_block = True
    shards_parameters = True

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
        return self.shard(model, blocks, param_dtype, reshard_after_forward)

    def shard(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module],
        param_dtype: torch.dtype | None,
        reshard_after_forward: bool,
        whole: Collection[nn.Parameter] = (),
    ) -> nn.Module:
        """FSDP2 on each of `blocks` and the root, over the `dp` ranks; the parameters in
        `whole` (and a task's own) are left out: not sharded, cast or reduced."""
        if not self.info.distributed:
            return model
        from torch.distributed.fsdp import FSDPModule

        if not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):  # a torch version
            raise LayoutError(
                "dist.strategy",
                f"dist.strategy=fsdp needs a torch with FSDPModule.set_force_sum_reduction_for_"
                f"comms (this is {torch.__version__}); use dist.strategy=ddp or upgrade torch",
            )
        mesh = self.mesh["dp"] if self.mesh is not None else None  # None: FSDP's default mesh
        # A task's own parameters (engine/window_task.py) stay whole on every rank:
        # step=cached sums their gradient over ranks itself.
        own = {p for _, p in loss_parameters(model)}
        shard_units(
            [*blocks, model], mesh, param_dtype, reshard_after_forward, ignored=own | set(whole)
        )
        return model

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, enabled: bool) -> Iterator[None]:
        # FSDP2 keeps unsharded gradients until a micro-batch with sync enabled reduce-scatters.
        if self.info.distributed:
            model.set_requires_gradient_sync(enabled)
        yield

    # ---- out-of-memory recovery ----
    def guard_collectives(self, model: nn.Module, agreement: Callable[[bool], int]) -> None:
        if self.info.distributed:
            agree_in_collectives(model, agreement)

    def guarded_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return self.gradient_sync(model, enabled)  # its collectives agree first

    def reset_after_oom(self, model: nn.Module) -> None:
        if self.info.distributed:
            reset_fsdp_state(model)


def shard_units(
    units: Sequence[nn.Module],
    mesh: DeviceMesh | None,
    param_dtype: torch.dtype | None,
    reshard: bool,
    placement: Any = None,
    ignored: set[nn.Parameter] | None = None,
) -> None:
    """FSDP2 (`fully_shard`) on each unit, in order (blocks first, the root last), over
    `mesh`; gradients reduced in fp32 (float64 models: float64) as plain sums, never divided
    (the loss is already normalized by the global item count). `placement`: FSDP2's
    `shard_placement_fn`; `ignored`: parameters left unsharded and unreduced."""
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
            ignored_params=ignored or None,
        )
    for unit in units:  # a setting of each FSDP module, not inherited
        unit.set_gradient_divide_factor(1.0)
        # gloo lacks PREMUL_SUM; plain sums are exact for every backend.
        unit.set_force_sum_reduction_for_comms(True)


def is_sharded(model: nn.Module) -> bool:
    """An FSDP2 module: it gathers parameters in every forward (ranks run forwards together)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(unwrap(model), FSDPModule)


# ---- agreed collectives: FSDP2 agrees on out-of-memory before each of its collectives ----
def agree_in_collectives(model: nn.Module, agreement: Callable[[bool], int]) -> None:
    """FSDP2 all-gathers and reduce-scatters inside forward and backward, from its module
    hooks; here its communication agrees before every collective: a rank that ran out of
    memory anywhere (in a layer, or allocating FSDP's own buffers) unwinds and agrees at the
    top, which is the agreement its peers reach next; they learn it there and unwind too
    (`PeerOutOfMemory`). Through FSDP2's public `set_custom_all_gather/reduce_scatter`."""
    from torch.distributed.fsdp import FSDPModule

    gather, scatter = _AgreedAllGather(agreement), _AgreedReduceScatter(agreement)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)


class _AgreedComm:
    """FSDP2's communication interface (`allocate`, then the call), agreed before the call."""

    def __init__(self, agreement: Callable[[bool], int]) -> None:
        self.agreement = agreement

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def agree(self) -> None:
        failed = self.agreement(False)
        if failed:
            raise PeerOutOfMemory(failed)


class _AgreedAllGather(_AgreedComm):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        async_op: bool = False,
    ) -> Any:
        self.agree()
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class _AgreedReduceScatter(_AgreedComm):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        self.agree()
        return dist.reduce_scatter_single(
            output_tensor, input_tensor, group=group, op=op, async_op=async_op
        )


def reset_fsdp_state(model: nn.Module) -> None:
    """After an agreed OOM: FSDP2's per-iteration state back to idle and resharded
    (`reset_iter_state`), and its unreduced gradients dropped."""
    from torch.distributed.fsdp import FSDPModule

    root = unwrap(model)
    if not isinstance(root, FSDPModule):
        return
    if root._get_fsdp_state()._is_root is not None:  # None: no forward has started yet
        root.reset_iter_state()
    for module in root.modules():
        if isinstance(module, FSDPModule):
            drop_unsharded(module)


def drop_unsharded(module: Any) -> None:
    """What `reset_iter_state` (torch 2.13) leaves of an FSDP2 unit's failed iteration: the
    gradients accumulated without reducing them (micro-batches with gradient sync off), on
    the unsharded parameters, where the redone window would add to them; and unsharded
    parameter storage allocated by an all-gather's copy-out that ran out of memory part way
    (the group still counts as sharded, so the reset frees nothing). Not reachable through
    a public API: FSDP2's per-parameter records."""
    for group in module._get_fsdp_state()._fsdp_param_groups:
        for fsdp_param in group.fsdp_params:
            fsdp_param.unsharded_accumulated_grad = None
            unsharded = getattr(fsdp_param, "_unsharded_param", None)  # FSDP2's private record
            if unsharded is not None:
                unsharded.grad = None
            if group.is_sharded and hasattr(fsdp_param, "_unsharded_inner_tensors"):
                fsdp_param.free_unsharded_param()
