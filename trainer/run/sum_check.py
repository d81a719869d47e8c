"""Once per launch: is the task's loss a sum over its loss items?

Exact accumulation divides each micro-batch's `loss_sum` by the global item count of the
window. A task that returns a mean instead trains silently and wrongly: its logged loss is
tiny and the trajectory depends on the micro-batch size. A sum is additive over any split of
a batch, a mean is not, so the first micro-batch's loss is compared with the sum of its two
halves' losses (model in eval mode, no gradients, random state untouched).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from engine.distributed import DistInfo, all_reduce_sum, unwrap
from engine.numerics.precision import Precision
from engine.rng import rng_state, set_rng_state
from engine.step import Batch, Task
from trainer.config.errors import UserError

# Relative tolerance of |loss(batch) - (loss(first half) + loss(second half))|: a mean over
# n items is off by a factor of about 2, a sum only by rounding (larger under autocast).
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}


class LossNotSum(UserError):
    all_ranks = True


def halves(batch: Batch) -> tuple[Batch, Batch] | None:
    """`batch` split in two along its first dimension, or None when it cannot be (fewer than
    two samples, or tensors that disagree on the batch size, or no tensor at all)."""
    sizes: set[int] = set()

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            sizes.add(x.shape[0])
        elif isinstance(x, Mapping):
            for v in x.values():
                visit(v)
        elif isinstance(x, list | tuple):
            for v in x:
                visit(v)

    visit(batch)
    if len(sizes) != 1 or (n := sizes.pop()) < 2:
        return None
    cut = n // 2

    def take(x: Any, part: slice) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return x[part]
        if isinstance(x, Mapping):
            return type(x)({k: take(v, part) for k, v in x.items()})  # type: ignore[call-arg]
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
            return type(x)(*(take(v, part) for v in x))
        if isinstance(x, list | tuple):
            return type(x)(take(v, part) for v in x)
        return x

    return take(batch, slice(0, cut)), take(batch, slice(cut, n))


@contextlib.contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode, no gradients, eager (a compiled model is not recompiled for eval mode), and
    every random generator as it was: the training trajectory does not see the check.

    `no_grad`, not `inference_mode`: a model that builds a cache lazily (rotary tables) would
    keep inference tensors that training cannot use."""
    was_training = model.training
    state = rng_state()
    stance = getattr(torch.compiler, "set_stance", None)
    eager = stance("force_eager") if stance is not None else contextlib.nullcontext()
    model.eval()
    try:
        with torch.no_grad(), eager:
            yield
    finally:
        model.train(was_training)
        set_rng_state(state)


def check_loss_is_sum(
    task: Task,
    model: nn.Module,
    batch: Batch | None,
    precision: Precision,
    dist: DistInfo,
    name: str,
) -> None:
    """Raise `LossNotSum` (on every rank alike) when `task.loss_sum` is not additive over the
    two halves of `batch` (None: this rank has no batch). Collective: every rank calls it."""
    inner = unwrap(model)  # DDP's forward would prepare a gradient sync that never comes
    parts = halves(batch)
    values = torch.zeros(3, dtype=torch.float64)  # failed, whole, halves summed
    whole = first = second = None
    if batch is not None:
        with evaluation_mode(inner):
            # Every rank runs the same number of forwards, even one whose batch cannot be
            # split (a sharded model's forward is collective).
            split = parts if parts is not None else (batch, batch)
            with precision.autocast():
                whole = task.loss_sum(inner, batch)
                first = task.loss_sum(inner, split[0])
                second = task.loss_sum(inner, split[1])
    if parts is not None and all(isinstance(t, torch.Tensor) for t in (whole, first, second)):
        w, h = float(whole.double()), float(first.double() + second.double())
        scale = max(abs(w), abs(h))
        tol = TOLERANCE.get(precision.mode, 2e-2)
        if math.isfinite(w) and math.isfinite(h) and abs(w - h) > tol * scale:
            values = torch.tensor([1.0, w, h], dtype=torch.float64)
    if parts is None and batch is not None and dist.is_main:
        print(
            f"NOTE: task.check_sum skipped: the first micro-batch of {name} cannot be split in "
            "two (a single sample, or tensors that disagree on the batch size)",
            flush=True,
        )
    total = all_reduce_sum(values.to(dist.device), dist).cpu()
    failed = int(total[0].item())
    if not failed:
        return
    w, h = (total[1] / failed).item(), (total[2] / failed).item()
    n = _batch_size(batch)
    raise LossNotSum(
        f"invalid config `task`: the loss of {name} is not a sum over its loss items. On the "
        f"first micro-batch{f' ({n} samples)' if n else ''} its loss_sum was {w:.6g}, the "
        f"losses of the two halves add up to {h:.6g}"
        + (" (about twice as much: a mean)" if w and 1.5 < abs(h / w) < 2.5 else "")
        + ". cumulus divides the summed loss by the global count of loss items of the whole "
        "window (all micro-batches, all ranks) itself, so loss_sum must return the sum over "
        "the batch's items (e.g. F.cross_entropy(..., reduction='sum'), or loss.sum() instead "
        "of loss.mean()) and count_items the number of those items. If the loss is "
        "deliberately not a sum (an auxiliary term that depends on the whole batch), set "
        "task.check_sum=false to skip this check."
    )


def _batch_size(batch: Batch) -> int | None:
    parts = halves(batch)
    if parts is None:
        return None
    first = next(t for t in _tensors(batch) if t.dim() > 0)
    return int(first.shape[0])


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, Mapping):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, list | tuple):
        for v in x:
            yield from _tensors(v)
