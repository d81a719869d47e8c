"""A mixture of experts' routing in a simulated step: uniform over the experts.

Which experts a token goes to depends on the router's weights and the token's values; fake
tensors have neither, and everything downstream of the choice has shapes that depend on it
(the in-tree GPT's split of the dispatched tokens by expert, transformers' `nonzero` over the
experts hit). `UniformRouting` answers a `topk` of a fake tensor (the router's choice; a
planned training step has no other) with its fake values and real indices that spread the
assignments evenly: token n's slot j goes to expert (n*k + j) mod E, so each expert gets N*k/E
of a layer's N*k token-slot assignments (one more for the first N*k mod E). The indices being
real, what is computed from them stays real (values.py): the step runs every expert on its
share as the real one does.

Why uniform is a plan of the real run's memory: the dispatched rows are N*k whatever the
routing, and each expert's activations kept for backward are proportional to its rows, so
their sum does not depend on the split. Only the transient of the busiest expert's matmul
(freed before the next expert runs) grows with imbalance; a collapsed router (one expert
takes everything) adds at most one expert's hidden activations of all N*k rows to the peak.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.run.memory import DEVICE_QUERY

ASSUMPTION = "uniform (each expert gets 1/E of a layer's token-slot assignments)"


def uniform_choice(shape: tuple[int, ...], experts: int) -> torch.Tensor:
    """(..., k) int64 indices into `experts`: slot j of row n is (n*k + j) mod experts (the
    k of a row distinct when k <= experts)."""
    k = shape[-1]
    rows = 1
    for n in shape[:-1]:
        rows *= n
    with no_dispatch():
        flat = torch.arange(rows * k, dtype=torch.int64) % experts
        return flat.reshape(shape)


class UniformRouting(TorchDispatchMode):
    """`topk` over the last dimension of a fake tensor -> (its fake values, real uniform
    indices); every other op goes on unchanged."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is DEVICE_QUERY:
            return func(*args)
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten.topk.default and isinstance(args[0], FakeTensor):
            x = args[0]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if dim in (-1, x.dim() - 1):
                values, indices = out
                return values, uniform_choice(tuple(indices.shape), x.shape[-1])
        return out
