"""All-gather of per-sample rows over data-parallel ranks, with its true gradient.

Every rank computes loss terms from the gathered rows, so the gradient of a rank's own rows is
the sum over ranks of what each rank's terms give them: backward sums the incoming gradient
over the group and keeps this rank's rows (a reduce-scatter; an all-reduce and a slice where
the backend has no reduce-scatter, gloo). A gather that returns only this rank's share of the
gradient (GradCache's distributed loss) trains with 1/world of it. torch's deprecated
`torch.distributed.nn.functional.all_gather` gave wrong gradients on gloo (PLATFORM.md).
Ranks may hold different numbers of rows (exchanged on the host, through gloo, so that a
step never waits for the device to read them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def gather_rows(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, int]:
    """Every rank's rows `x` (rows, ...) concatenated in rank order, differentiable; and the
    index of this rank's first row in the result. Without a process group: `x` itself."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return x, 0
    sizes = _row_counts(x, group)
    rank = dist.get_rank(group)
    return _GatherRows.apply(x, sizes, group), sum(sizes[:rank])


def _row_counts(x: torch.Tensor, group: dist.ProcessGroup | None) -> list[int]:
    """Every rank's number of rows, exchanged on the host (no wait for the device): through
    `group` when it is gloo, else through a gloo group over the same ranks, made once."""
    mine = torch.tensor([x.shape[0]], dtype=torch.int64)
    counts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, mine, group=_host_group(group))
    return [int(c) for c in counts]


_HOST_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _host_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if dist.get_backend(group) == "gloo":
        return group
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    if ranks not in _HOST_GROUPS:  # collective: every rank of the world makes it, once
        _HOST_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo")
    return _HOST_GROUPS[ranks]


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        ctx.sizes, ctx.group = sizes, group
        longest = max(sizes)
        padded = x.new_zeros((longest, *x.shape[1:]))  # all_gather needs equal shapes
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])  # (sum(sizes), ...)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        sizes, group = ctx.sizes, ctx.group
        rank = dist.get_rank(group)
        start = sum(sizes[:rank])
        grad = grad.contiguous()
        if len(set(sizes)) == 1 and dist.get_backend(group) != "gloo":
            out = grad.new_empty((sizes[rank], *grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, op=dist.ReduceOp.SUM, group=group)
            return out, None, None
        summed = grad.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
        return summed[start : start + sizes[rank]].contiguous(), None, None
