"""Point-to-point transfers between pipeline stages: each tensor preceded by a header with its
shape and dtype, so micro-batches may differ in length."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.bool,
]
_HEADER = 10  # ndim, dtype index, up to 8 sizes


@dataclass
class _Sent:
    work: Any
    tensor: torch.Tensor  # kept alive until the send completed


class Links:
    """Point-to-point transfers between pipeline stages of one data-parallel replica."""

    def __init__(
        self, rank_of_stage: Callable[[int], int], n_stages: int, device: torch.device
    ) -> None:
        self.rank_of_stage, self.n_stages, self.device = rank_of_stage, n_stages, device
        self.pending: list[_Sent] = []
        self.waited = 0.0  # seconds blocked in receives (the bubble, on a host-synchronous link)

    def _tag(self, stage: int, micro: int, backward: bool) -> int:
        return ((micro * self.n_stages + stage) * 2 + int(backward)) * 2

    def send(self, t: torch.Tensor, to_stage: int, micro: int, backward: bool) -> None:
        if t.dim() > _HEADER - 2:
            raise ValueError(f"pipeline activations have at most 8 dimensions, got {t.dim()}")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = t.dim(), _DTYPES.index(t.dtype)
        header[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        peer, tag = self.rank_of_stage(to_stage), self._tag(to_stage, micro, backward)
        device = self.device
        for i, x in enumerate((header.to(device), t.detach().contiguous())):
            self.pending.append(_Sent(dist.isend(x, peer, tag=tag + i), x))

    def recv(self, from_stage: int, at_stage: int, micro: int, backward: bool) -> torch.Tensor:
        peer, tag = self.rank_of_stage(from_stage), self._tag(at_stage, micro, backward)
        device = self.device
        started = time.perf_counter()
        header = torch.empty(_HEADER, dtype=torch.int64, device=device)
        dist.recv(header, peer, tag=tag)
        ndim, kind, *shape = header.tolist()
        out = torch.empty(shape[:ndim], dtype=_DTYPES[kind], device=device)
        dist.recv(out, peer, tag=tag + 1)
        self.waited += time.perf_counter() - started
        return out

    def flush(self) -> None:
        """Wait for every send of the window (their tensors may be freed after)."""
        for sent in self.pending:
            sent.work.wait()
        self.pending.clear()
