"""Out-of-memory errors a step recovers from, agreed by every rank.

`OomGuard` makes the accumulation step of engine/steps/accumulate.py recoverable (the same
step, `AccumulateStep(guard=OomGuard(...))`, not a copy of it): an out-of-memory error in the
forward or backward of any micro-batch on any rank (or in a forward of a task's look at the
window before them: moe.balance=global's routing pass) becomes an `OutOfMemoryAgreed` raised on
*every* rank at the same point, with the window's gradients freed, so the caller can roll the
window back and redo it with smaller micro-batches.

Why no rank is ever left waiting in a collective:

- Ranks agree after every micro-batch (`Agreement`: one all-reduce of a 0/1 flag, on the
  host). A rank that ran out of memory stops there, and so does every other rank, before
  anyone starts the next micro-batch (whose forward may itself communicate, e.g. DDP's
  buffer broadcast).
- Under DDP every micro-batch runs in `no_sync`, and the window's gradients are all-reduced
  by hand only after the ranks agreed that the last backward finished everywhere
  (`DataParallel.guarded_sync` / `reduce_guarded_window`). With DDP's
  own bucketed all-reduce, an OOM in the last backward on one rank leaves the other ranks
  inside a bucket's all-reduce that never completes (the hang Composer hit): no agreement
  can happen from inside autograd. The price is that communication no longer overlaps the
  last backward. The hand all-reduce averages like DDP (sum / world size), so
  `ctx.grad_sync_divisor` keeps its meaning.
- FSDP2 all-gathers and reduce-scatters inside forward and backward, from its module hooks.
  `guard_collectives` (engine/parallel/fsdp.py) replaces its communication by one that
  agrees before every collective: a rank that ran out of memory anywhere (in a layer, or
  allocating FSDP's own buffers) unwinds and agrees at the top, which is the agreement its
  peers reach next (before their next collective, or at the end of the micro-batch); they
  learn it there and unwind too (`PeerOutOfMemory`). FSDP2's state after the unwinding is put
  back by its `reset_iter_state` (the parallelism's `reset_after_oom`). Agreements go through
  a gloo group on the host, so they never wait for the device. Not covered: under FSDP2, the
  collectives between the last agreement and the update (fp16's found-inf all-reduce, the
  gradient norm's, per-layer norms): an OOM in their scalar allocations on one rank leaves
  the others waiting there until the timeout. The update's own allocations (Adam's moments,
  temporaries) are covered.

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
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from engine.distributed import DistInfo
from engine.numerics.precision import Precision
from engine.parallel.base import local_values
from engine.parallel.fsdp import PeerOutOfMemory
from engine.step import StepContext

T = TypeVar("T")

# What allocators raise when they run out: CUDA's (torch.OutOfMemoryError), and the CPU
# allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory").
_CPU_OOM = ("can't allocate memory", "out of memory")


def is_oom(exc: BaseException) -> bool:
    """True for an allocator's out-of-memory error, on any device."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if isinstance(exc, dist.DistError):  # e.g. NCCL's "Cuda failure 'out of memory'"
        return False  # a collective failed after the agreement: not recoverable here
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


class Agreement:
    """How many ranks ran out of memory: one all-reduce of a 0/1 flag. On the host: through the
    default group when it is gloo, else through a gloo group made for it (collective: every
    rank builds its `Agreement` at the same point), so no agreement waits for the device."""

    def __init__(self, info: DistInfo, timeout: timedelta | None = None) -> None:
        self.info = info
        self.group: dist.ProcessGroup | None = None
        if info.distributed and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo", timeout=timeout)

    def __call__(self, oom: bool) -> int:
        if not self.info.distributed:
            return int(oom)
        flag = torch.tensor([int(oom)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=self.group)
        return int(flag[0])

    def attempt(self, fn: Callable[[], T]) -> tuple[T | None, int]:
        """Collective: run `fn`, then agree. Its result (None on an OOM anywhere) and how many
        ranks ran out of memory. A `PeerOutOfMemory` means the agreement already happened."""
        oom, out = False, None
        try:
            out = fn()
        except PeerOutOfMemory as exc:
            return None, exc.ranks
        except Exception as exc:
            if not is_oom(exc):
                raise
            oom = True  # agreed below, once the traceback (and the graph it holds) is gone
        return out, self(oom)


def release_memory(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Free the window's gradients and whatever the failed graph held; empty the CUDA cache
    (repeated OOMs otherwise leave it fragmented)."""
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reset_window(ctx: StepContext) -> None:
    """After an agreed OOM: the parallelism's state of the failed window (FSDP2's iteration
    state and unreduced gradients), then `release_memory`."""
    ctx.parallel.reset_after_oom(ctx.model)
    release_memory(ctx.optimizer, ctx.dist.device)


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


class OomGuard:
    """`AccumulateStep`'s guard under `train.micro_batch_size=auto`: an agreement after every
    micro-batch, the gradients reduced after the last one (by hand under DDP; by FSDP2's
    agreed reduce-scatters in the last backward), the update undone (`StepUndo`) when the
    step's tail runs out of memory on any rank. The arithmetic is the step's own."""

    def __init__(self, agreement: Agreement) -> None:
        self.agree = agreement
        self.undo: StepUndo | None = None
        self.ctx: StepContext | None = None

    # ---- the step's moments (engine/steps/accumulate.py's StepGuard) ----
    def start(self, ctx: StepContext) -> None:
        self.ctx = ctx
        if self.undo is None or self.undo.optimizer is not ctx.optimizer:
            self.undo = StepUndo(ctx.optimizer, ctx.precision)
        self.undo.take()

    def window(self, ctx: StepContext) -> OomGuard:
        del ctx
        return self

    def update(self, ctx: StepContext, fn: Callable[[], T]) -> T:
        out, failed = self.agree.attempt(fn)
        if failed or out is None:
            assert self.undo is not None
            self.undo.restore()
            reset_window(ctx)
            raise OutOfMemoryAgreed("gradient clipping or optimizer step", failed)
        return out

    def finish(self, ctx: StepContext, fn: Callable[[], T]) -> T:
        out, failed = self.agree.attempt(fn)
        if failed or out is None:  # the step is counted and callbacks ran: not redone
            reset_window(ctx)
            raise OutOfMemoryAgreed("callbacks after the optimizer step", failed, retry=False)
        return out

    # ---- the window's moments (engine/parallel/base.py's WindowGuard) ----
    def micro_batch(self, index: int, count: int, fn: Callable[[], T]) -> T:
        micro_sum, failed = self.agree.attempt(fn)
        if failed or micro_sum is None:
            assert self.ctx is not None
            reset_window(self.ctx)
            raise OutOfMemoryAgreed(f"micro-batch {index + 1}/{count}", failed)
        return micro_sum

    def gradient_sync(self, ctx: StepContext, enabled: bool) -> contextlib.AbstractContextManager:
        return ctx.parallel.guarded_sync(ctx.model, enabled)

    def after_window(self, ctx: StepContext) -> None:
        ctx.parallel.reduce_guarded_window(ctx.trainable_parameters())
        assert self.undo is not None
        self.undo.ready()
