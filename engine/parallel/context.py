"""Context parallelism: each sequence split over the mesh's `cp` ranks, attention computed over
the whole sequence (Llama 3's all-gather context parallelism).

Rank r of a `cp` group holds chunks r and 2N-1-r of every sequence cut into 2N chunks (the
causal load balance: early chunks attend to few keys, late ones to many, and each rank holds
one of each). A sequence whose length does not divide by 2N is padded at the end (inputs with
0, targets with the ignore index) and so never refused; a causal model's real tokens never
attend to the padding after them.

Exactness is in the accounting: the ranks of a `cp` group hold different loss items of the
same samples, so for counting and reducing they are data-parallel ranks. The parallelism
underneath (DDP, FSDP2, tensor or pipeline parallelism) is built over a data-parallel
dimension of `dp x cp` ranks: the window's items are counted on each rank's own tokens and
summed over `dp x cp` (the unsharded count, never `cp` times it), gradients of parameters
replicated over `cp` are summed over `dp x cp` (FSDP2 shards over `dp x cp`), and every
logged sum adds up to the unsharded run's. Only the loader keys on the true data-parallel
rank, so a `cp` group reads the same samples.

The model declares where it attends and where it takes positions (`DeclaresContextParallel`,
docs/your-model.md): its attention calls `SequenceShard.attend(q, k, v)` on its local queries,
keys and values, which all-gathers keys and values along the sequence (their gradients summed
back onto each rank's chunks) and attends under the causal mask of the tokens' global
positions; positions (learned or rotary) are `SequenceShard.positions(T)`, those of the
original tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from engine.distributed import DistInfo
from engine.numerics.chunked_ce import IGNORE_INDEX
from engine.parallel import LayoutError
from engine.parallel.base import Batch, Parallelism, RunShape, SumsOf


class SequenceShard:
    """This rank's share of every sequence: which tokens it holds, their positions, and
    attention over the whole sequence. Given to the model's `context_parallel` hook."""

    def __init__(self, size: int, rank: int, group: dist.ProcessGroup | None) -> None:
        self.size, self.rank, self.group = size, rank, group

    # ---- the split ----
    def split(self, t: torch.Tensor, pad_value: float | int) -> torch.Tensor:
        """This rank's chunks r and 2N-1-r of `t` along dim 1 (the sequence), padded at the
        end to a multiple of 2N with `pad_value`."""
        n = 2 * self.size
        pad = -t.shape[1] % n
        if pad:
            widths = [0, 0] * (t.dim() - 2) + [0, pad]  # F.pad counts from the last dim
            t = F.pad(t, widths, value=pad_value)
        chunks = t.chunk(n, dim=1)
        return torch.cat([chunks[self.rank], chunks[n - 1 - self.rank]], dim=1)

    def positions(self, local_length: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The global positions of this rank's `local_length` tokens (its two chunks)."""
        if local_length % 2:
            raise ValueError(f"a context-parallel shard holds two equal chunks, got {local_length}")
        c = local_length // 2
        first = torch.arange(self.rank * c, (self.rank + 1) * c, device=device)
        second = torch.arange((2 * self.size - 1 - self.rank) * c, (2 * self.size - self.rank) * c)
        return torch.cat([first, second.to(device)])

    # ---- packed documents ----
    def documents(self, position_ids: torch.Tensor) -> torch.Tensor:
        """(B, T_local) position ids of this rank's tokens, restarting at 0 where a packed
        document starts -> (B, T) the document of every token of the whole sequence (all
        ranks'), for `attend(documents=...)`. One all-gather of the positions per forward."""
        parts = [torch.empty_like(position_ids) for _ in range(self.size)]
        dist.all_gather(parts, position_ids.contiguous(), group=self.group)
        whole = self.to_global([p[:, None, :, None] for p in parts])[:, 0, :, 0]  # (B, T)
        step = torch.diff(whole, dim=-1, prepend=whole[:, :1] - 1)
        return (step != 1).cumsum(-1)

    # ---- attention over the whole sequence ----
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout_p: float = 0.0,
        scale: float | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of this rank's queries (B, H, T_local, D) over every rank's keys
        and values (B, H_kv, T_local, D; H a multiple of H_kv): keys and values all-gathered
        along the sequence, the mask from the tokens' global positions. `documents` (B, T,
        from `documents()`): packed documents, each attending only to itself."""
        k_all = _GatherSequence.apply(k, self)
        v_all = _GatherSequence.apply(v, self)
        if k_all.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves a group
            repeat = q.shape[1] // k_all.shape[1]
            k_all = k_all.repeat_interleave(repeat, dim=1)
            v_all = v_all.repeat_interleave(repeat, dim=1)
        # Recomputed in backward: the (T_local x T) mask and scores of a masked attention would
        # otherwise be kept for backward, T^2 / cp memory where one process keeps O(T).
        return checkpoint(
            self._masked, q, k_all, v_all, dropout_p, scale, documents, use_reentrant=False
        )

    def _masked(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout_p: float,
        scale: float | None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the local queries over the whole sequence, causal in global positions
        (and within each packed document)."""
        q_pos = self.positions(q.shape[-2], q.device)
        k_pos = torch.arange(k.shape[-2], device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # (T_local, T): True where a query may attend
        if documents is not None:
            mine = self.own(documents[:, None, :, None])[:, 0, :, 0]  # (B, T_local)
            mask = (mask & (mine[:, :, None] == documents[:, None, :]))[:, None]  # (B,1,Tl,T)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale
        )

    def to_global(self, gathered: Sequence[torch.Tensor]) -> torch.Tensor:
        """Every rank's (B, H, T_local, D) shard, in rank order, as the whole sequence."""
        halves = [t.chunk(2, dim=-2) for t in gathered]
        order = [halves[r][0] for r in range(self.size)]
        order += [halves[r][1] for r in reversed(range(self.size))]
        return torch.cat(order, dim=-2)

    def own(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's chunks of a whole-sequence tensor (B, H, T, D)."""
        chunks = whole.chunk(2 * self.size, dim=-2)
        return torch.cat([chunks[self.rank], chunks[2 * self.size - 1 - self.rank]], dim=-2)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (forward); backward: each rank's gradient of the whole
    sequence summed over the group, this rank's chunks kept (a reduce-scatter; on backends
    without one, gloo, an all-reduce and a slice: the same sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
        ctx.shard = shard
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(shard.size)]
        dist.all_gather(parts, x, group=shard.group)
        return shard.to_global(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        shard: SequenceShard = ctx.shard
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=shard.group)
        return shard.own(grad).contiguous(), None


@runtime_checkable
class DeclaresContextParallel(Protocol):
    def context_parallel(self, shard: SequenceShard) -> None:
        """From now on this model holds `shard`'s part of every sequence: positions are
        `shard.positions(T)` and every attention is `shard.attend(q, k, v)` (docs/your-model.md)."""
        ...


class ContextParallel:
    """`dist.cp` ranks per sequence, over the parallelism `inner` (built over a data-parallel
    dimension of `dp x cp` ranks): every member is `inner`'s except the loader's coordinates
    (the true data-parallel rank and size), the batch split, the model's hook and dropout."""

    def __init__(
        self, inner: Parallelism, info: DistInfo, cp: int, cp_group: Any, impl: str = "allgather"
    ) -> None:
        self.inner, self.info, self.cp, self.impl = inner, info, cp, impl
        self.cp_rank = inner.dp_rank % cp  # cp is the inner part of the `dp x cp` dimension
        self.shard = SequenceShard(cp, self.cp_rank, cp_group)
        self.name = f"cp+{inner.name}"

    def __getattr__(self, name: str) -> Any:
        # Everything this class does not define is the inner parallelism's own member.
        return getattr(self.inner, name)

    # ---- what differs ----
    @property
    def dp_rank(self) -> int:
        return self.inner.dp_rank // self.cp

    @property
    def dp_size(self) -> int:
        return self.inner.dp_size // self.cp

    @property
    def dropout_stream(self) -> int:
        """Each rank's dropout acts on its own tokens: one stream per `dp x cp` rank (and per
        tensor-parallel rank where the inner parallelism gives one)."""
        return self.inner.dropout_stream * self.cp + self.cp_rank

    @property
    def whole_model(self) -> bool:
        return False  # a forward is collective over the `cp` group, on sharded sequences

    def describe(self) -> str:
        inner = self.inner.describe()
        return f"context parallel {self.cp} ({self.impl})" + (f" | {inner}" if inner else "")

    def check(self, shape: RunShape) -> None:
        if not shape.plain_accumulation:
            raise LayoutError(
                "step",
                f"with dist.cp the window's sequences are split over ranks as step=accumulate "
                f"splits them; {type(shape.step).__name__} would see them whole",
            )
        if self.impl == "ring":
            raise LayoutError(
                "dist.cp_impl",
                "ring runs torch's ring attention (torch.distributed.tensor.experimental."
                "context_parallel), whose kernels exist only for CUDA's flash, efficient and "
                "cuDNN attention (pytorch #147793); this version does not build it: use "
                "dist.cp_impl=allgather (the default; any backend)",
            )
        if shape.auto_micro_batch:
            raise LayoutError(
                "train.micro_batch_size", "auto is not probed with dist.cp yet; set a number"
            )
        self.inner.check(shape)

    def apply(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module] = (),
        *,
        param_dtype: torch.dtype | None = None,
        reshard_after_forward: bool = True,
    ) -> nn.Module:
        """The model's hook first (its stages, shards and wrappers keep it), then `inner`."""
        if not isinstance(model, DeclaresContextParallel):
            raise LayoutError(
                "dist.cp",
                f"{type(model).__name__} does not declare where it attends: context "
                "parallelism needs a method context_parallel(shard) that makes its attention "
                "call shard.attend(q, k, v) and its positions shard.positions(T) "
                "(docs/your-model.md, 'Context parallelism'); or run without dist.cp",
            )
        model.context_parallel(self.shard)
        return self.inner.apply(
            model, blocks, param_dtype=param_dtype, reshard_after_forward=reshard_after_forward
        )

    def local_batch(self, batch: Batch) -> Batch:
        """This rank's chunks of every sequence of the batch: inputs padded with 0, targets
        with the ignore index (a padded position is no loss item)."""
        return split_batch(self.inner.local_batch(batch), self.shard)

    def eval_sums(
        self,
        model: nn.Module,
        task: Any,
        batches: Iterable[Batch],
        sums_of: SumsOf,
        n_forwards: int | None = None,
    ) -> Iterator[tuple[Batch, dict[str, torch.Tensor]]]:
        local = [self.local_batch(b) for b in batches]  # one validation batch at a time
        yield from self.inner.eval_sums(model, task, local, sums_of, n_forwards)

    def eval_mode(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return self.inner.eval_mode(model)

    def backward_window(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner.backward_window(*args, **kwargs)


def split_batch(batch: Batch, shard: SequenceShard) -> Batch:
    """The sequences of a causal-LM micro-batch cut to `shard`'s chunks: a pair (token ids,
    targets aligned with them), or a dict of (B, T) fields with aligned `shift_labels`;
    anything else is refused in one paragraph."""
    if isinstance(batch, tuple | list) and len(batch) == 2:
        inputs, targets = batch
        return type(batch)((shard.split(inputs, 0), shard.split(targets, IGNORE_INDEX)))
    if isinstance(batch, dict) and "shift_labels" in batch and "labels" not in batch:
        out = {}
        for key, value in batch.items():
            pad = IGNORE_INDEX if key == "shift_labels" else 0
            out[key] = shard.split(value, pad) if _sequence(value) else value
        return out
    if isinstance(batch, dict):
        raise LayoutError(
            "dist.cp",
            "a dict batch split over context-parallel ranks needs its targets aligned with the "
            "input positions as `shift_labels` (the token each position predicts, -100 where "
            "none): `labels` (or none) are shifted by the task, across the split; give the "
            "data's collate_fn shift_labels, or use (inputs, targets) pairs",
        )
    raise LayoutError(
        "dist.cp",
        f"context parallelism splits a batch's sequences along dim 1 and needs a pair "
        f"(inputs, targets) or a dict of (batch, sequence) tensors; got a {type(batch).__name__}",
    )


def _sequence(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2
