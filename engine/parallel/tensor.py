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

Sequence parallelism (`sequence_parallel=True`, Megatron-LM's): between the split layers the
residual stream is split along the sequence over the `tp` ranks, so norms, dropout and the
residual adds hold 1/tp of the tokens. A column-split layer all-gathers its input's sequence
(reduce-scatter in backward), a row-split layer reduce-scatters its output onto the sequence
shards (instead of all-reducing it): the same communication volume as without. The model
declares where the stream is split and gathered (`sequence_parallel_plan()`): the sequence is
padded to a multiple of `tp` where it is split and cut back where it is gathered, so a causal
model sees the same tokens (padding comes last, nothing before it attends to it). A norm's
weight then gets a partial gradient per rank, summed over `tp` after the window. Dropout acts
on sharded activations only, so each rank draws its own masks (`dropout_stream`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from engine.distributed import DistInfo
from engine.parallel.base import LayoutError, MeshSplit, RunShape, all_reduce_flat, local_values
from engine.parallel.fsdp import shard_units

# colwise_qkv: a fused projection whose output is [q | k | v]: each third split colwise, so a
# rank holds the same heads' rows of q, k and v (a DTensor `_StridedShard(0, split_factor=3)`:
# whole, it is the layer's own weight, as checkpoints store it). Its bias stays whole on every
# rank (each takes its rows in forward): FSDP2 could not shard a strided 1-D split again.
STYLES = ("colwise", "rowwise", "colwise_qkv")
# Sequence parallelism: `sequence_split` pads and splits a module's input along the sequence
# (the whole stream -> this rank's shard), `sequence` runs a module (a norm) on the shard,
# `sequence_gather` runs it on the shard, then gathers its output whole (cut to the length
# before padding), for a layer every rank computes whole (the output layer and the loss).
SEQUENCE_STYLES = ("sequence_split", "sequence", "sequence_gather")


@runtime_checkable
class DeclaresTensorPlan(Protocol):
    def tensor_parallel_plan(self) -> dict[str, str]:
        """Module path pattern -> `colwise` or `rowwise`, for the linear layers to split."""
        ...


@runtime_checkable
class DeclaresSequencePlan(Protocol):
    def sequence_parallel_plan(self) -> dict[str, str]:
        """Module path pattern -> a `SEQUENCE_STYLES` entry: where the residual stream is
        split along the sequence, the norms that run on its shards, where it is gathered."""
        ...


class NotParallelizable(LayoutError):
    """The model cannot be split over tensor-parallel ranks as asked."""

    def __init__(self, message: str, key: str = "dist.tp") -> None:
        super().__init__(key, message)


class NotSequenceParallelizable(NotParallelizable):
    """The model cannot run with its sequence split over tensor-parallel ranks."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "dist.tp_sequence_parallel")


def tensor_plan(model: nn.Module) -> dict[str, str]:
    """The model's plan: its own `tensor_parallel_plan()`, else a transformers config's
    `base_model_tp_plan` (paths under the base model's prefix)."""
    if isinstance(model, DeclaresTensorPlan):
        return dict(model.tensor_parallel_plan())
    # A transformers model's config (optional attributes of a foreign object).
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
    # The head counts of a transformers config or the in-tree GPT's (optional attributes).
    for config in (getattr(model, "config", None), getattr(model, "cfg", None)):
        for name in ("num_attention_heads", "num_key_value_heads", "n_head"):
            heads = getattr(config, name, None)
            if isinstance(heads, int) and heads % tp:
                raise NotParallelizable(
                    f"the model's {name}={heads} does not split over dist.tp={tp} ranks: use "
                    f"a dist.tp that divides it"
                )


class _LocalRows(torch.autograd.Function):
    """A whole fused bias `[q | k | v]`: forward gives this rank's rows of each of its `parts`
    (the rows its weight shard computes); backward puts the gradient back in place and sums it
    over the group (the ranks' rows are disjoint), so every rank holds the whole gradient."""

    @staticmethod
    def forward(ctx: Any, bias: torch.Tensor, parts: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.parts, ctx.group = parts, group
        ctx.size, ctx.rank = dist.get_world_size(group), dist.get_rank(group)
        return bias.view(parts, ctx.size, -1)[:, ctx.rank].reshape(-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        whole = grad.new_zeros(ctx.parts, ctx.size, grad.numel() // ctx.parts)
        whole[:, ctx.rank] = grad.view(ctx.parts, -1)
        dist.all_reduce(whole, op=dist.ReduceOp.SUM, group=ctx.group)
        return whole.view(-1), None, None


class _CopyToParallel(torch.autograd.Function):
    """Megatron's `f`: the input as it is in forward; in backward, the partial gradients of
    the ranks' column shares summed over the group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def fused_colwise(parts: int, sequence: bool = False) -> Any:
    """A ParallelStyle for an `nn.Linear` whose output is `parts` equal pieces (q, k, v):
    each piece split colwise, computed on the local shard, the output left local. With
    `sequence`, the input is this rank's sequence shard, all-gathered first (its gradient
    reduce-scattered back)."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle
    from torch.distributed.tensor.placement_types import _StridedShard

    class FusedColwise(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            if type(module) is not nn.Linear:
                raise NotParallelizable(
                    f"colwise_qkv splits an nn.Linear, not a {type(module).__name__}"
                )
            placement = [_StridedShard(0, split_factor=parts)]
            w = module.weight
            weight = distribute_tensor(w.data, device_mesh, placement)
            module.weight = nn.Parameter(weight, w.requires_grad)
            group = device_mesh.get_group()

            def forward(x: torch.Tensor) -> torch.Tensor:
                bias = module.bias
                if bias is not None:
                    bias = _LocalRows.apply(local_values(bias), parts, group)
                weight = local_values(module.weight)
                x = gather_sequence(x, device_mesh) if sequence else _CopyToParallel.apply(x, group)
                return F.linear(x, weight, bias)

            module.forward = forward  # type: ignore[method-assign]
            return module

    return FusedColwise()


def gather_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's sequence shard -> the whole sequence, for a column-split layer: the ranks'
    gradients are partial sums, reduce-scattered back onto the shards."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    whole = DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(
        mesh, [Replicate()]
    )
    return whole.to_local(grad_placements=[Partial()])


class SequenceSplit:
    """Where the residual stream is split along the sequence and gathered again: the split
    pads to a multiple of `tp` and remembers the length, which the gather cuts back to."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh, self.tp = mesh, mesh.size()
        self.length: int | None = None

    def split(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        from torch.distributed.tensor import Replicate, Shard

        x, *rest = args
        self.length = x.shape[1]
        pad = -self.length % self.tp
        if pad:
            x = F.pad(x, (0, 0, 0, pad))  # (B, T, C): zeros after the last token
        shard = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False).redistribute(
            self.mesh, [Shard(1)]
        )
        return (shard.to_local(), *rest)

    def gather(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        """Every rank computes what follows whole and alike: the gradient is this rank's
        slice of a replicated one (no reduction)."""
        from torch.distributed.tensor import Replicate, Shard

        if self.length is None:
            raise RuntimeError("sequence_gather ran before sequence_split in the forward")
        whole = DTensor.from_local(out, self.mesh, [Shard(1)], run_check=False).redistribute(
            self.mesh, [Replicate()]
        )
        return whole.to_local()[:, : self.length]


def sequence_plan(model: nn.Module) -> dict[str, str]:
    """The model's `sequence_parallel_plan()`, checked."""
    if not isinstance(model, DeclaresSequencePlan):
        raise NotSequenceParallelizable(
            f"{type(model).__name__} declares no sequence-parallel plan: dist."
            "tp_sequence_parallel=true needs a method sequence_parallel_plan() returning "
            "{module path pattern: 'sequence_split' | 'sequence' | 'sequence_gather'} "
            "(docs/your-model.md; the in-tree GPT has one); or set "
            "dist.tp_sequence_parallel=false"
        )
    plan = dict(model.sequence_parallel_plan())
    unknown = sorted({v for v in plan.values() if v not in SEQUENCE_STYLES})
    ends = [v for v in plan.values() if v in ("sequence_split", "sequence_gather")]
    if unknown or sorted(ends) != ["sequence_gather", "sequence_split"]:
        raise NotSequenceParallelizable(
            f"the sequence-parallel plan {plan} must name one sequence_split and one "
            f"sequence_gather module, with norms in between as sequence (got "
            f"{', '.join(unknown) or 'no unknown style'})"
        )
    return plan


# What torch's styles split: ColwiseParallel and RowwiseParallel take nn.Linear and
# nn.Embedding, the fused q/k/v split (colwise_qkv) nn.Linear only.
SPLITS: dict[str, tuple[type[nn.Module], ...]] = {
    "colwise": (nn.Linear, nn.Embedding),
    "rowwise": (nn.Linear, nn.Embedding),
    "colwise_qkv": (nn.Linear,),
}


def check_plan_modules(model: nn.Module, plan: dict[str, str]) -> None:
    """Every module the plan names is one its style can split: one paragraph naming the
    first that is not (torch would raise a bare NotImplementedError in the middle of it)."""
    names = {id(m): n for n, m in model.named_modules()}
    for pattern, style in plan.items():
        kinds = SPLITS.get(style, ())
        for module in _matching(model, pattern):
            name = names[id(module)]
            if kinds and not isinstance(module, kinds):
                raise NotParallelizable(
                    f"the tensor-parallel plan of {type(model).__name__} splits {name!r} "
                    f"({pattern!r}: {style}), a {type(module).__name__}; {style} splits "
                    f"{' and '.join(k.__name__ for k in kinds)} modules only. Name the linear "
                    "layers inside it in the plan (tensor_parallel_plan(), or the transformers "
                    "config's base_model_tp_plan), or run without dist.tp"
                )


def _matching(model: nn.Module, pattern: str) -> list[nn.Module]:
    """Modules whose path matches `pattern` (`*`: one path element)."""
    want = pattern.split(".")
    return [
        m
        for name, m in model.named_modules()
        if name
        and len(parts := name.split(".")) == len(want)
        and all(w in ("*", n) for w, n in zip(want, parts, strict=True))
    ]


class TensorParallel(MeshSplit):
    """`dist.tp` tensor-parallel ranks over the mesh's `tp` dimension, data parallelism over
    its `dp` dimension (gradients summed after the window: `sync_divisor` is 1)."""

    name = "tp"
    key = "dist.tp"
    # Every rank runs the model's forward (its layers split over the `tp` group, together).
    whole_model = True
    # With `fsdp` (2-D: FSDP2 over `dp` on top of the `tp` split), an instance attribute.
    shards_parameters = False

    def __init__(
        self, info: DistInfo, mesh: DeviceMesh, fsdp: bool = False, sequence_parallel: bool = False
    ) -> None:
        super().__init__(info, mesh)
        self.fsdp, self.sequence_parallel = fsdp, sequence_parallel
        self.tp = mesh["tp"].size()
        self.tp_rank = mesh.get_local_rank("tp")
        # Parameters that see one sequence shard per rank (norms): partial gradients.
        self.sequence_params: list[nn.Parameter] = []
        self.model_parameters: list[tuple[str, nn.Parameter]] = []  # after `apply`

    @property
    def dropout_stream(self) -> int:
        """Which dropout stream this rank draws from: one per data-parallel rank (a `tp`
        group computes the same activations), one per rank with sequence parallelism
        (every dropout acts on this rank's own shard of the sequence or of the heads)."""
        if self.sequence_parallel:
            return self.dp_rank + self.dp_size * self.tp_rank
        return self.dp_rank

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("tp")

    def describe(self) -> str:
        return f"tensor parallel {self.tp}" + (" + sequence" if self.sequence_parallel else "")

    def check(self, shape: RunShape) -> None:
        super().check(shape)
        strided = [n for n, p in self.model_parameters if is_strided(p)]
        if shape.checkpoint_format == "sharded" and strided:
            raise LayoutError(
                "checkpoint.format",
                f"sharded checkpoints cannot hold {strided[0]}: a fused q/k/v weight split third "
                "by third over dist.tp (colwise_qkv) is a strided DTensor, which "
                "torch.distributed.checkpoint cannot save; use checkpoint.format=full (or auto): "
                "gathered, it resumes on any layout",
            )

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
        """Split the plan's linear layers over `tp` (in place; names unchanged); with `fsdp`,
        then shard every block and the root with FSDP2 over `dp` (2-D parallelism)."""
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
        check_plan_modules(model, plan)
        seq = self.sequence_parallel
        if seq:
            from torch.distributed.tensor import Shard

            styles: dict[str, Any] = {
                "colwise": lambda: ColwiseParallel(input_layouts=Shard(1)),
                "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1)),
                "colwise_qkv": lambda: fused_colwise(3, sequence=True),
            }
            sequence = sequence_plan(model)  # before anything changes
        else:
            styles = {
                "colwise": ColwiseParallel,
                "rowwise": RowwiseParallel,
                "colwise_qkv": lambda: fused_colwise(3),
            }
        parallelize_module(model, self.mesh["tp"], {k: styles[v]() for k, v in plan.items()})
        if not any(isinstance(p, DTensor) for p in model.parameters()):
            raise NotParallelizable(
                f"the tensor-parallel plan {plan} matched no module of {type(model).__name__}"
            )
        if seq:
            self._split_sequence(model, sequence)
        if self.fsdp:
            self._shard(model, blocks, param_dtype, reshard_after_forward)
        self.model_parameters = list(model.named_parameters())
        return model

    def _split_sequence(self, model: nn.Module, plan: dict[str, str]) -> None:
        """Hooks at the split and the gather; norms run on shards (their parameters
        replicated DTensors whose gradients are partial over `tp`)."""
        from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

        split = SequenceSplit(self.mesh["tp"])
        norms = {
            k: SequenceParallel(use_local_output=True)
            for k, v in plan.items()
            if v != "sequence_split"
        }
        parallelize_module(model, self.mesh["tp"], norms)
        for pattern, style in plan.items():
            modules = _matching(model, pattern)
            if not modules:
                raise NotSequenceParallelizable(
                    f"the sequence-parallel plan's {pattern!r} matched no module of "
                    f"{type(model).__name__}"
                )
            for m in modules:
                if style == "sequence_split":
                    m.register_forward_pre_hook(split.split)
                else:
                    self.sequence_params += list(m.parameters())
                if style == "sequence_gather":
                    m.register_forward_hook(split.gather)

    def _shard(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module],
        param_dtype: torch.dtype | None,
        reshard: bool,
    ) -> None:
        if not blocks:
            raise NotParallelizable(
                f"dist.strategy=fsdp shards the model block by block and {type(model).__name__} "
                "declares no blocks (block_modules(), or model.block_classes)"
            )
        check_dp_placements(model, self.dp_size)
        shard_units([*blocks, model], self.mesh["dp"], param_dtype, reshard, dp_placement)
        self.shards_parameters = True

    def optimizer_context(self) -> contextlib.AbstractContextManager:
        """Around the optimizer's step (and GradScaler's unscale): parameters left whole are
        plain tensors next to the split layers' DTensors, taken as replicated over `tp`."""
        from torch.distributed.tensor.experimental import implicit_replication

        return implicit_replication()

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, enabled: bool) -> Iterator[None]:
        """FSDP2 reduce-scatters in the last micro-batch only; without it gradients are summed
        once, after the window (`sync_gradients`)."""
        if self.fsdp:
            model.set_requires_gradient_sync(enabled)
        yield

    def sync_gradients(self, params: list[nn.Parameter]) -> None:
        """Sum gradients (each rank's shards) over the data-parallel ranks; with sequence
        parallelism, the norms' partial gradients over `tp` first."""
        if self.sequence_parallel:
            self._sum_sequence_gradients()
        grads = [local_values(p.grad) for p in params if p.grad is not None]
        if self.dp_size > 1 and grads and not self.fsdp:  # FSDP2 reduce-scattered already
            all_reduce_flat(grads, self.dp_group)

    def _sum_sequence_gradients(self) -> None:
        """A norm's gradient from each rank's sequence shard is a partial sum (DTensor
        `Partial` over `tp`): summed, it is the whole gradient, replicated."""
        from torch.distributed.tensor import Replicate

        for p in self.sequence_params:  # DTensors: `SequenceParallel` replicated them
            g = p.grad
            if g is not None:
                placements = [Replicate() if pl.is_partial() else pl for pl in g.placements]
                p.grad = g.redistribute(g.device_mesh, placements)

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The total gradient norm, float64 squares: each gradient's local squares summed
        over the mesh dimensions it is sharded along (`tp` for a split layer, `dp` too under
        FSDP2), so whole and replicated values (a row-split layer's bias) count once."""
        grads = [p.grad for p in params if p.grad is not None]
        return sharded_squares(grads, self.mesh, self.info.device).sqrt().float()


def dp_placement(param: nn.Parameter) -> Any:
    """FSDP2's data-parallel placement of a parameter: dim 0 (its default), except a strided
    tensor-parallel split (colwise_qkv's weight), sharded on dim 1. FSDP2 would shard dim 0 of
    each rank's q/k/v rows again, a layout DTensor cannot describe (it records
    `(_StridedShard(0, sf=2), _StridedShard(0, sf=3))`, whose `full_tensor()` puts the rows out
    of order): training ran right but gathered checkpoints held a wrong weight."""
    from torch.distributed.tensor import Shard

    if is_strided(param):
        return Shard(1)
    return None


def is_strided(t: torch.Tensor) -> bool:
    """A DTensor with a strided placement (colwise_qkv's split)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements)


def check_dp_placements(model: nn.Module, dp: int) -> None:
    """FSDP2 shards a parameter on dim 1 (`dp_placement`) only when that dim divides evenly."""
    for name, p in model.named_parameters():
        placement = dp_placement(p)
        if placement is not None and p.shape[placement.dim] % dp:
            raise NotParallelizable(
                f"dist.strategy=fsdp shards {name} (a fused q/k/v split, colwise_qkv) on its "
                f"{p.shape[placement.dim]} input features, which do not split over {dp} "
                "data-parallel ranks: use a data-parallel size that divides them, or "
                "dist.strategy=ddp"
            )


def sharded_dims(t: torch.Tensor) -> tuple[str, ...]:
    """The mesh dimensions a DTensor is sharded along (none for a plain tensor)."""
    if not isinstance(t, DTensor):
        return ()
    names = t.device_mesh.mesh_dim_names or ()
    # Not replicated = sharded: Shard, and FSDP2's _StridedShard on a tensor-parallel split.
    return tuple(n for n, p in zip(names, t.placements) if not p.is_replicate())


def sharded_squares(
    grads: list[torch.Tensor], mesh: DeviceMesh, device: torch.device
) -> torch.Tensor:
    """The sum of squares (float64) of `grads` over every rank holding a share: each
    gradient's local squares summed over the mesh dimensions it is sharded along, so whole
    and replicated values count once."""
    by_dims: dict[tuple[str, ...], list[torch.Tensor]] = {}
    for g in grads:
        by_dims.setdefault(sharded_dims(g), []).append(local_values(g))
    total = torch.zeros((), dtype=torch.float64, device=device)
    for dims, local in by_dims.items():
        sq = torch.stack(torch._foreach_norm(local, 2.0, dtype=torch.float64)).square().sum()
        for name in dims:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=mesh.get_group(name))
        total = total + sq
    return total
