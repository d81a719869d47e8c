"""Out-of-memory errors a step recovers from, agreed by every rank.

`OomSafeAccumulateStep` is the accumulation step of `engine/accumulate.py` made recoverable:
an out-of-memory error in the forward or backward of any micro-batch on any rank becomes an
`OutOfMemoryAgreed` raised on *every* rank at the same point, with the window's gradients
freed, so the caller can roll the window back and redo it with smaller micro-batches.

Why no rank is ever left waiting in a collective:

- Ranks agree after every micro-batch (one all-reduce of a 0/1 flag). A rank that ran out of
  memory stops there, and so does every other rank, before anyone starts the next
  micro-batch (whose forward may itself communicate, e.g. DDP's buffer broadcast).
- Under DDP every micro-batch runs in `no_sync`, and the window's gradients are all-reduced
  by hand only after the ranks agreed that the last backward finished everywhere. With DDP's
  own bucketed all-reduce, an OOM in the last backward on one rank leaves the other ranks
  inside a bucket's all-reduce that never completes (the hang Composer hit): no agreement
  can happen from inside autograd. The price is that communication no longer overlaps the
  last backward. The hand all-reduce averages like DDP (sum / world size), so
  `ctx.grad_sync_divisor` keeps its meaning.
- FSDP2 gathers parameters inside forward and backward; an OOM there leaves its state
  illegal (Composer's open FSDP2 issue). The trainer refuses FSDP2 on several ranks with
  `micro_batch_size=auto` instead of risking a hang.

An OOM in unscaling, gradient clipping or the optimizer step is retried too: on a GPU the
activations of large micro-batches leave the cache fragmented, and an update that needs one
more buffer (Adam's temporaries, its moments on the first step) fails where the same update
after smaller micro-batches and an emptied cache fits. The update may have been half applied
(some parameters and moments changed), so `StepUndo` keeps a host copy of the parameters,
the optimizer state and the loss scale, taken while the window's forward and backward run,
and puts it back. Ranks agree once more after the
update, before the step is counted; an OOM after that (in a callback of the finished step) is
not retried (`retry=False`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from engine.accumulate import apply_update, count_step, count_window, micro_backward
from engine.distributed import DistInfo, all_reduce_sum
from engine.parallel import local_values
from engine.precision import Precision
from engine.step import Batch, StepContext, StepResult

# What allocators raise when they run out: CUDA's (torch.OutOfMemoryError), and the CPU
# allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory").
_CPU_OOM = ("can't allocate memory", "out of memory")


def is_oom(exc: BaseException) -> bool:
    """True for an allocator's out-of-memory error, on any device."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _CPU_OOM)


class OutOfMemoryAgreed(Exception):
    """Raised on every rank together: some rank ran out of memory in this window.

    Args:
        where: the phase, e.g. "micro-batch 2/4" or "optimizer step".
        ranks: how many ranks ran out of memory.
        retry: True when the window can be redone with smaller micro-batches.
    """

    def __init__(self, where: str, ranks: int, retry: bool = True) -> None:
        super().__init__(f"out of memory on {ranks} rank(s) in the {where}")
        self.where, self.ranks, self.retry = where, ranks, retry


def agree_oom(oom: bool, info: DistInfo) -> int:
    """Collective: how many ranks ran out of memory (0 on every rank when none did)."""
    if not info.distributed:
        return int(oom)  # no device round trip: the allocator raised on the host
    flag = torch.tensor(int(oom), device=info.device)
    return int(all_reduce_sum(flag, info).item())


def release_memory(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Free the window's gradients and whatever the failed graph held; empty the CUDA cache
    (repeated OOMs otherwise leave it fragmented)."""
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def local_gradients(model: nn.Module) -> Iterator[None]:
    """DDP communicates nothing in backward inside this block (gradients stay local). Not
    `gradient_sync(model, False)`: that would also hold back a one-process FSDP2's
    reduce-scatter, which nothing here turns on again."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        yield


def all_reduce_gradients(params: Sequence[nn.Parameter], info: DistInfo) -> None:
    """Average the gradients over ranks as DDP does (sum, divided by the world size); every
    rank has the same parameters with gradients (checked by the agreement before)."""
    if not info.distributed:
        return
    grads = [p.grad for p in params if p.grad is not None]
    works = [dist.all_reduce(g, op=dist.ReduceOp.SUM, async_op=True) for g in grads]
    for w in works:
        w.wait()
    torch._foreach_div_(grads, float(info.world_size))


class StepUndo:
    """Parameters, optimizer state and loss scale as they were before the optimizer step, in
    host memory, so that an update that ran out of memory half way can be undone exactly.

    The copy is taken at the start of the window: nothing it holds changes before the
    optimizer step. On CUDA it goes into pinned buffers (allocated once) by asynchronous copies
    on a side stream, overlapping the window's forward and backward; the optimizer step waits
    for it on the device (`ready`), not on the host. The price of the guarantee: host memory
    for the parameters and the optimizer state, and one device-to-host transfer of them per
    step (runs with `train.micro_batch_size=auto` only).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, precision: Precision) -> None:
        self.optimizer, self.precision = optimizer, precision
        self.host: dict[tuple[int, str], torch.Tensor] = {}
        # Per parameter: None (no state yet: Adam creates its moments in the first step) or
        # its state's keys, each a host buffer's key or a plain value.
        self.state: list[dict[str, Any] | None] = []
        self.scale: tuple[torch.Tensor, torch.Tensor] | None = None
        self.stream: torch.cuda.Stream | None = None

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _to_host(self, key: tuple[int, str], t: torch.Tensor) -> tuple[int, str]:
        src = local_values(t).detach()
        buf = self.host.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
            self.host[key] = buf
        buf.copy_(src, non_blocking=src.is_cuda)
        return key

    def take(self) -> None:
        params = self.params()
        if self.stream is None and params and params[0].is_cuda:
            self.stream = torch.cuda.Stream(params[0].device)
        copies = contextlib.nullcontext() if self.stream is None else torch.cuda.stream(self.stream)
        if self.stream is not None:  # after the previous step's update
            self.stream.wait_stream(torch.cuda.current_stream(params[0].device))
        with torch.no_grad(), copies:
            self.state = []
            for i, p in enumerate(params):
                self._to_host((i, "param"), p)
                entries = self.optimizer.state.get(p)
                self.state.append(
                    None
                    if not entries
                    else {
                        k: (
                            ("host", self._to_host((i, k), v))
                            if torch.is_tensor(v)
                            else ("value", v)
                        )
                        for k, v in entries.items()
                    }
                )
        self.scale = self.precision.window_state()

    def ready(self) -> None:
        """Before the optimizer step: the update waits (on the device) for the copy."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def restore(self) -> None:
        self.ready()
        with torch.no_grad():
            for i, p in enumerate(self.params()):
                local_values(p).copy_(self.host[(i, "param")], non_blocking=True)
                saved = self.state[i]
                if saved is None:
                    self.optimizer.state.pop(p, None)
                    continue
                current = self.optimizer.state[p]
                for k in [k for k in current if k not in saved]:
                    del current[k]
                for k, (kind, v) in saved.items():
                    if kind == "value":
                        current[k] = v
                    else:
                        local_values(current[k]).copy_(self.host[v], non_blocking=True)
        self.precision.restore_window_state(self.scale)


class OomSafeAccumulateStep:
    """Exact micro-batch accumulation whose out-of-memory errors every rank agrees on.

    The same arithmetic as `AccumulateStep` (one count of the window, each micro-batch's
    backward of loss_sum * divisor / global_count, `finish_step`'s two halves), with an
    agreement after every micro-batch, the gradient all-reduce after the last one, and the
    update undone (`StepUndo`) when the step's tail runs out of memory on any rank.
    """

    def __init__(self) -> None:
        self.undo: StepUndo | None = None

    def __call__(self, ctx: StepContext, window: Sequence[Batch]) -> StepResult:
        if ctx.parallel.shards_parameters and ctx.dist.distributed:
            raise RuntimeError("OomSafeAccumulateStep does not support FSDP on several ranks")
        ctx.optimizer.zero_grad(set_to_none=True)
        if self.undo is None or self.undo.optimizer is not ctx.optimizer:
            self.undo = StepUndo(ctx.optimizer, ctx.precision)
        self.undo.take()
        global_count = count_window(ctx, window)
        count = global_count.clamp(min=1)
        loss_sum: torch.Tensor | None = None
        last = len(window) - 1
        with local_gradients(ctx.model):
            for i, batch in enumerate(window):
                micro_sum = self.try_micro_backward(ctx, batch, count)
                failed = agree_oom(micro_sum is None, ctx.dist)
                if failed:
                    release_memory(ctx.optimizer, ctx.dist.device)
                    raise OutOfMemoryAgreed(f"micro-batch {i + 1}/{len(window)}", failed)
                ctx.callbacks.after_micro_batch(ctx, batch, global_count, i == last)
                loss_sum = micro_sum if loss_sum is None else loss_sum + micro_sum
        all_reduce_gradients(ctx.trainable_parameters(), ctx.dist)
        self.undo.ready()
        try:
            update = apply_update(ctx)
            failed = agree_oom(False, ctx.dist)
        except Exception as exc:
            if not is_oom(exc):
                raise
            failed = agree_oom(True, ctx.dist)
        if failed:
            self.undo.restore()
            release_memory(ctx.optimizer, ctx.dist.device)
            raise OutOfMemoryAgreed("gradient clipping or optimizer step", failed)
        try:
            result = count_step(ctx, StepResult(loss_sum, global_count, *update))
            failed = agree_oom(False, ctx.dist)
        except Exception as exc:
            if not is_oom(exc):
                raise
            failed = agree_oom(True, ctx.dist)
        if failed:  # the step is counted and callbacks ran: nothing left to redo
            release_memory(ctx.optimizer, ctx.dist.device)
            raise OutOfMemoryAgreed("callbacks after the optimizer step", failed, retry=False)
        return result

    @staticmethod
    def try_micro_backward(
        ctx: StepContext, batch: Batch, count: torch.Tensor
    ) -> torch.Tensor | None:
        """Forward + backward of one micro-batch: its detached loss sum, or None on OOM (the
        graph is freed when the failed frame and the exception's traceback go)."""
        try:
            return micro_backward(ctx, batch, count)
        except Exception as exc:
            if not is_oom(exc):
                raise
            return None
