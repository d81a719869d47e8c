"""A mixture of experts' routing in a simulated step: uniform over the experts.

Which experts a token goes to depends on the router's weights and the token's values; fake
tensors have neither. The routing (engine/moe/routing.py) counts each expert's assignments
with `bincount` and splits the dispatched tokens by those counts; on a fake tensor the counts
have no values. `UniformRouting` answers a `bincount` of a fake tensor with real counts, the
assignments spread evenly over the `minlength` experts (N*k/E each, the remainder one apiece
to the first), so the simulated step runs every expert on its share as the real one does.

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
from torch.utils._python_dispatch import TorchDispatchMode

ASSUMPTION = "uniform (each expert gets 1/E of a layer's token-slot assignments)"


def uniform_counts(n: int, experts: int) -> torch.Tensor:
    """(experts,) int64: n assignments spread as evenly as they go."""
    counts = torch.full((experts,), n // experts, dtype=torch.int64)
    counts[: n % experts] += 1
    return counts


class UniformRouting(TorchDispatchMode):
    """`bincount` of a fake tensor (without weights) -> real uniform counts; every other op
    goes on unchanged."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.bincount.default and isinstance(args[0], FakeTensor):
            weights = args[1] if len(args) > 1 else kwargs.get("weights")
            minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
            if weights is None and minlength > 0:
                return uniform_counts(args[0].numel(), minlength)
        return func(*args, **kwargs)
