"""Tensor parallelism: the model's linear layers split over the mesh's `tp` ranks, data
parallelism over its `dp` ranks.

The plan names, for module paths (`*` matches one path element), how each linear layer is
split: `colwise` (output features sharded: each rank computes its share of the heads or of
the MLP's hidden units) or `rowwise` (input features sharded; the partial outputs are summed
over the `tp` ranks). A model declares it (`tensor_parallel_plan()`), or a transformers model
brings its config's `base_model_tp_plan` (Llama: q/k/v and gate/up colwise, o/down rowwise).
`torch.distributed.tensor.parallel.parallelize_module` applies it: the split layers' weights
become DTensors sharded over `tp`, everything else stays whole and identical on every `tp`
rank.

Exactness: every rank of a `tp` group reads the same samples (the loader keys on the
data-parallel rank) and computes the same loss, so the window's items are counted over `dp`
only and only the first `tp` rank's loss sums are reported; gradients are summed over `dp`
after the window (no wrapper divides); the total gradient norm adds the shards' squares over
`tp` and counts every whole parameter once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from engine.distributed import DistInfo

STYLES = ("colwise", "rowwise")


@runtime_checkable
class DeclaresTensorPlan(Protocol):
    def tensor_parallel_plan(self) -> dict[str, str]:
        """Module path pattern -> `colwise` or `rowwise`, for the linear layers to split."""
        ...


class NotParallelizable(ValueError):
    """The model cannot be split over tensor-parallel ranks as asked."""


def tensor_plan(model: nn.Module) -> dict[str, str]:
    """The model's plan: its own `tensor_parallel_plan()`, else a transformers config's
    `base_model_tp_plan` (paths under the base model's prefix)."""
    if isinstance(model, DeclaresTensorPlan):
        return dict(model.tensor_parallel_plan())
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    if plan:
        prefix = getattr(model, "base_model_prefix", "")
        return {f"{prefix}.{k}" if prefix else k: v for k, v in plan.items()}
    raise NotParallelizable(
        f"{type(model).__name__} declares no tensor-parallel plan: it needs a method "
        "tensor_parallel_plan() returning {module path pattern: 'colwise' | 'rowwise'} for "
        "its linear layers (docs/your-model.md), or a transformers config with "
        "base_model_tp_plan; or run without dist.tp"
    )


def check_heads(model: nn.Module, tp: int) -> None:
    """Attention heads (and key/value heads) must split evenly over the `tp` ranks."""
    config = getattr(model, "config", None)
    for name in ("num_attention_heads", "num_key_value_heads", "n_head"):
        heads = getattr(config, name, None)
        if isinstance(heads, int) and heads % tp:
            raise NotParallelizable(
                f"the model's {name}={heads} does not split over dist.tp={tp} ranks: use a "
                f"dist.tp that divides it"
            )


class TensorParallel:
    """`dist.tp` tensor-parallel ranks over the mesh's `tp` dimension, data parallelism over
    its `dp` dimension (gradients summed after the window: `sync_divisor` is 1)."""

    name = "tp"
    per_block = False
    shards_parameters = False

    def __init__(self, info: DistInfo, mesh: DeviceMesh) -> None:
        self.info, self.mesh = info, mesh
        self.tp = mesh["tp"].size()
        self.tp_rank = mesh.get_local_rank("tp")

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp")

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("tp")

    @property
    def sync_divisor(self) -> int:
        return 1

    @property
    def checkpoint_format(self) -> str:
        return "full"

    @property
    def reports(self) -> bool:
        """Whether this rank's loss and evaluation sums count (the first `tp` rank's do; the
        others computed the same ones)."""
        return self.tp_rank == 0

    def apply(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module] = (),
        *,
        param_dtype: torch.dtype | None = None,
        reshard_after_forward: bool = True,
    ) -> nn.Module:
        """Split the plan's linear layers over `tp` (in place; names unchanged)."""
        del blocks, param_dtype, reshard_after_forward
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        plan = tensor_plan(model)
        unknown = sorted({v for v in plan.values() if v not in STYLES})
        if unknown:
            raise NotParallelizable(
                f"the tensor-parallel plan uses {', '.join(unknown)}; supported: "
                f"{', '.join(STYLES)}"
            )
        check_heads(model, self.tp)
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        parallelize_module(model, self.mesh["tp"], {k: styles[v]() for k, v in plan.items()})
        if not any(isinstance(p, DTensor) for p in model.parameters()):
            raise NotParallelizable(
                f"the tensor-parallel plan {plan} matched no module of {type(model).__name__}"
            )
        return model

    def mixed_tensors(self) -> contextlib.AbstractContextManager:
        """Around the optimizer's step (and GradScaler's unscale): parameters left whole are
        plain tensors next to the split layers' DTensors, taken as replicated over `tp`."""
        from torch.distributed.tensor.experimental import implicit_replication

        return implicit_replication()

    def gradient_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        del model, enabled  # gradients are summed once, after the window (`sync_gradients`)
        return contextlib.nullcontext()

    def sync_gradients(self, params: list[nn.Parameter]) -> None:
        """Sum gradients (each rank's shards) over the data-parallel ranks."""
        grads = [_local(p.grad) for p in params if p.grad is not None]
        if self.dp_size > 1 and grads:
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for g in grads:
                by_dtype.setdefault(g.dtype, []).append(g)
            for ts in by_dtype.values():
                flat = torch.cat([t.reshape(-1) for t in ts])
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group)
                offset = 0
                for t in ts:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The total gradient norm: the shards' squares summed over `tp`, whole parameters
        (identical on every `tp` rank) counted once; float64 squares."""
        grads = [p.grad for p in params if p.grad is not None]
        sharded = [g.to_local() for g in grads if _is_shard(g)]
        # Whole: plain tensors, and DTensors replicated over `tp` (a row-split layer's bias).
        whole = [_local(g) for g in grads if not _is_shard(g)]
        device = self.info.device
        sq_sharded = _squares(sharded, device)
        dist.all_reduce(sq_sharded, op=dist.ReduceOp.SUM, group=self.tp_group)
        return (sq_sharded + _squares(whole, device)).sqrt().float()

    def agree_found_inf(self, precision: Any, optimizer: torch.optim.Optimizer) -> None:
        """fp16: every rank's GradScaler skips the step when any rank overflowed."""
        for flag in precision.found_inf_flags(optimizer):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)


def _is_shard(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and any(isinstance(p, Shard) for p in t.placements)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    per_tensor = torch._foreach_norm(tensors, 2.0, dtype=torch.float64)
    return torch.stack(per_tensor).square().sum()
