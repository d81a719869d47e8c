"""`DataParallel`: DistributedDataParallel over the `dp` ranks; the bare model on one process."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from engine.parallel.base import ParallelBase
from engine.window_task import loss_parameters


class DataParallel(ParallelBase):
    """DDP averages the all-reduced gradients, hence `sync_divisor` = the data-parallel size.

    Under the out-of-memory guard every micro-batch runs in `no_sync` and the window's
    gradients are all-reduced by hand once every rank agreed that the last backward finished
    (DDP's bucketed all-reduce runs inside autograd, where no agreement can happen: a rank
    that ran out of memory there would leave its peers waiting in a bucket's all-reduce).
    """

    name = "ddp"

    @property
    def sync_divisor(self) -> int:
        return self.dp_size  # 1 on one process: nothing wraps the model

    def apply(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module] = (),
        *,
        param_dtype: torch.dtype | None = None,
        reshard_after_forward: bool = True,
    ) -> nn.Module:
        del blocks, param_dtype, reshard_after_forward  # DDP replicates the whole model
        if self.dp_size == 1 or self.simulated is not None:
            # Simulated (trainer.plan): DDP's C++ reducer cannot run on fake tensors; every
            # rank holds the whole model, and its buckets are `untracked_bytes`.
            return model
        info = self.info
        device_ids = [info.device.index] if info.device.type == "cuda" else None
        # A task's own parameters (engine/window_task.py) get no gradient in any backward of
        # the model: step=cached sums theirs over ranks itself.
        own = [name for name, _ in loss_parameters(model)]
        if own:
            ignore_in_ddp(model, own)
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)

    def untracked_bytes(self, model: nn.Module) -> dict[str, int]:
        """DDP's gradient buckets: a copy of the gradient of every parameter it reduces,
        allocated by its C++ reducer (gradient_as_bucket_view is off)."""
        if self.dp_size == 1:
            return {}
        params = reduced_parameters(model)
        return {"ddp_buckets": sum(p.numel() * p.element_size() for p in params)}

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, enabled: bool) -> Iterator[None]:
        # DDP's `no_sync` must cover the forward too (it records whether to reduce there).
        if enabled and self.simulated is not None and self.dp_size > 1:
            # Simulated: the reduction's working copy of the gradients, as DDP's reducer
            # allocates it around a synchronized backward (what a tracker sees of it).
            params = reduced_parameters(model)
            flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype)
            yield
            del flat
        elif enabled or not isinstance(model, nn.parallel.DistributedDataParallel):
            yield
        else:
            with model.no_sync():
                yield

    def guarded_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return self.gradient_sync(model, False)  # reduced by hand after the window

    def reduce_guarded_window(self, params: list[nn.Parameter]) -> None:
        """Average the gradients over ranks as DDP does (sum, divided by the world size);
        every rank has the same parameters with gradients (agreed before)."""
        if self.dp_size == 1:
            return
        grads = [p.grad for p in params if p.grad is not None]
        works = [dist.all_reduce(g, op=dist.ReduceOp.SUM, async_op=True) for g in grads]
        for w in works:
            w.wait()
        torch._foreach_div_(grads, float(self.dp_size))


def ignored_by_ddp(model: nn.Module) -> set[str]:
    """The names DDP was told to ignore: torch keeps the list on the module, where DDP reads
    it at wrapping."""
    return set(vars(model).get("_ddp_params_and_buffers_to_ignore", ()))


def ignore_in_ddp(model: nn.Module, names: list[str]) -> None:
    """DDP ignores `names` too (torch's setter replaces the list: what others put there
    stays, e.g. dist.ep's experts beside a task's own parameters)."""
    keep = sorted(ignored_by_ddp(model) | set(names))
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, keep)


def reduced_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters DDP reduces, and holds buckets for: the trainable ones less those it was
    told to ignore (dist.ep's experts, reduced over their replicas instead; a task's own
    parameters)."""
    ignored = ignored_by_ddp(model)
    return [p for n, p in model.named_parameters() if p.requires_grad and n not in ignored]
