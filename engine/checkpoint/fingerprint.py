"""A fingerprint of a model's frozen weights: what a checkpoint of adapters records about the
base they were trained on, so that resuming or evaluating them on another base is refused
instead of silently producing a different model.

Per frozen parameter: its shape, dtype and two float64 sums over its values, one weighted by
a fixed pseudo-random pattern of (row, column) so that a permutation of rows or columns (a
re-laid-out q/k projection, swapped heads) changes it, and the sum of squares. Rows are summed
whole on the rank that holds them and the row sums are gathered in global order, so the
fingerprint is the same (to float64 rounding, hence compared with a tolerance) for one
process, DDP and FSDP2 on any number of ranks; nothing larger than a row's sums is gathered,
and a parameter is read in chunks of rows.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

ROWS = 4096  # rows converted to float64 at a time
RTOL = 1e-9  # of a sum's scale: float64 summation order stays far below, another base far above
_GOLDEN = (math.sqrt(5) - 1) / 2


def _pattern(n: int, salt: float, device: torch.device) -> torch.Tensor:
    """A fixed pseudo-random vector in [-1, 1] of length `n` (float64)."""
    i = torch.arange(n, dtype=torch.float64, device=device)
    return torch.cos(i * (2 * math.pi * _GOLDEN) + salt)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as (rows, columns): dimension 0 against the rest (a scalar is one row)."""
    return t.reshape(1, 1) if t.ndim == 0 else t.reshape(t.shape[0], -1)


def row_sums(t: torch.Tensor) -> torch.Tensor:
    """(rows, 2) float64: each row's values weighted by the column pattern, and squared."""
    x = _rows(t.detach())
    cols = _pattern(x.shape[1], 0.5, x.device)
    parts = [
        torch.stack([(c * cols).sum(1), (c * c).sum(1)], dim=1)
        for c in (chunk.to(torch.float64) for chunk in x.split(ROWS))
    ]
    return torch.cat(parts).cpu() if parts else torch.zeros(0, 2, dtype=torch.float64)


def is_dtensor(t: Any) -> bool:
    """A DTensor, without importing DTensor (slow to import) where none can exist yet."""
    import sys

    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _is_row_sharded(p: Any) -> bool:
    """A DTensor sharded along dimension 0 over a 1-D mesh (FSDP2's layout)."""
    from torch.distributed.tensor import DTensor, Shard

    return (
        isinstance(p, DTensor)
        and p.device_mesh.ndim == 1
        and len(p.placements) == 1
        and p.placements[0] == Shard(0)
    )


@torch.no_grad()
def frozen_fingerprint(model: nn.Module) -> dict[str, dict[str, Any]]:
    """{name: {"shape", "dtype", "sums"}} of every parameter of `model` that does not require
    grad. Collective when the parameters are DTensors (every rank of their mesh calls it)."""
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    rows: dict[str, torch.Tensor] = {}
    by_mesh: dict[Any, dict[str, torch.Tensor]] = {}
    for name, p in frozen:
        if not is_dtensor(p):
            rows[name] = row_sums(p)
        elif _is_row_sharded(p):  # this rank's rows; gathered below, one collective per mesh
            by_mesh.setdefault(p.device_mesh, {})[name] = row_sums(p.to_local())
        else:  # any other layout: the whole tensor (not met under FSDP2)
            rows[name] = row_sums(p.full_tensor())
    for mesh, local in by_mesh.items():
        import torch.distributed as dist

        everyone: list[Any] = [None] * mesh.size()
        dist.all_gather_object(everyone, local, group=mesh.get_group())
        for name in local:  # rank order is Shard(0)'s chunk order
            rows[name] = torch.cat([part[name] for part in everyone])
    out = {}
    for name, p in frozen:
        r = rows[name]
        weighted = float((r[:, 0] * _pattern(len(r), 1.5, r.device)).sum())
        out[name] = {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."),
                     "sums": [weighted, float(r[:, 1].sum())]}  # fmt: skip
    return out


def fingerprint_difference(saved: dict[str, Any], live: dict[str, Any]) -> str | None:
    """None when two fingerprints describe the same weights, else the first difference in
    words (parameters missing or extra, a shape, a dtype, or the values)."""
    missing, extra = sorted(set(saved) - set(live)), sorted(set(live) - set(saved))
    if missing:
        return f"the base it was trained on has {missing[0]}, this one does not"
    if extra:
        return f"this base has {extra[0]}, the one it was trained on does not"
    for name in sorted(saved):
        a, b = saved[name], live[name]
        if list(a["shape"]) != list(b["shape"]):
            return f"{name} has shape {tuple(b['shape'])} here, {tuple(a['shape'])} there"
        if a["dtype"] != b["dtype"]:
            return f"{name} is {b['dtype']} here, {a['dtype']} there"
        numel = math.prod(a["shape"]) or 1
        scale = math.sqrt(max(a["sums"][1], b["sums"][1]) * numel) + 1e-30
        if any(abs(x - y) > RTOL * scale for x, y in zip(a["sums"], b["sums"])):
            return f"the values of {name} differ"
    return None
