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


class RecordedLinks(Links):
    """Links of a simulated world (trainer.plan): nothing crosses ranks. Sends record the
    shape and dtype of what they would send in `book` (shared by the runs of every stage's
    rank, which the planner runs in stage order); a receive returns an empty tensor shaped as
    recorded: the forward input of a stage as its predecessor sent it (or, before that
    stage ran, any stage boundary's for the same micro-batch: a transformer's hidden states
    have one shape throughout), the gradient of a stage's output as that output."""

    def __init__(self, book: dict[Any, Any], n_stages: int, device: torch.device) -> None:
        super().__init__(lambda stage: stage, n_stages, device)
        self.book = book

    def send(self, t: torch.Tensor, to_stage: int, micro: int, backward: bool) -> None:
        if not backward:
            self.book[to_stage, micro] = (tuple(t.shape), t.dtype)
        # What this rank would send, for the planner's traffic (with its header).
        self.book["sent_bytes"] = self.book.get("sent_bytes", 0) + t.numel() * t.element_size()

    def recv(self, from_stage: int, at_stage: int, micro: int, backward: bool) -> torch.Tensor:
        stage = at_stage + 1 if backward else at_stage  # the boundary the tensor crosses
        spec = self.book.get((stage, micro))
        if spec is None:
            spec = next(
                (v for k, v in self.book.items() if isinstance(k, tuple) and k[1] == micro), None
            )
        if spec is None:
            raise RuntimeError(f"simulated pipeline: nothing recorded for micro-batch {micro}")
        shape, dtype = spec
        return torch.empty(shape, dtype=dtype, device=self.device)

    def flush(self) -> None:
        pass
