"""The batch's integer values stay real in a simulated step, so the model takes the branches
the real run takes.

A fake tensor has shapes, no values. Model code that reads the values of its integer inputs
(token ids, positions, padding masks) decides on them: transformers, for one, checks whether
the position ids restart (packed documents) or the padding mask has holes, and otherwise
drops its causal mask for SDPA's `is_causal` (no T x T mask). On fake tensors it cannot look,
takes the traced branch and builds the mask, which SDPA converts to the query's dtype for
every layer and keeps for backward: a 2048-token `hf_llama` planned twice the activations
its real run holds.

`RealIntegers` keeps integer and boolean tensors computed from real ones real (the batch's
token ids and targets are read from the data; positions come from `arange`), as long as each
stays under `LIMIT_BYTES`; every floating-point tensor and everything computed from a fake one
stays fake. Real tensors it makes are tracked like fake ones: the real run holds them too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainer.run.memory import DEVICE_QUERY

# The largest integer or boolean tensor computed for real (a (B, 1, T, T) mask at 8192 tokens
# is 64 MiB per sample); a larger one stays fake.
LIMIT_BYTES = 2**28


def _plain(x: Any) -> bool:
    return type(x) is torch.Tensor


def _small_integers(out: Any) -> bool:
    for t in tree_flatten(out)[0]:
        if not isinstance(t, torch.Tensor):
            continue
        if t.is_floating_point() or t.is_complex() or t.numel() * t.element_size() > LIMIT_BYTES:
            return False
    return True


class RealIntegers(TorchDispatchMode):
    """Entered just above the fake mode: an op whose tensor arguments are all real and whose
    results are small integer or boolean tensors runs for real; any other goes on to the fake
    mode (which fakes the real arguments it is given)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is DEVICE_QUERY:
            return func(*args)
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not all(_plain(t) for t in tensors):
            return func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)  # the fake mode's result: the shapes and dtypes
        except (DataDependentOutputException, DynamicOutputShapeException):
            out = None  # `item()`, `nonzero()`: answered from the real values below
        if out is not None and not _small_integers(out):
            return out
        with no_dispatch():
            return func(*args, **kwargs)


def real_or_fake(t: torch.Tensor, mode: Any) -> torch.Tensor:
    """A batch's tensor as the simulation gives it to the step: integers real, floats fake."""
    if t.is_floating_point() or t.numel() * t.element_size() > LIMIT_BYTES:
        return mode.from_tensor(t)
    return t
