"""Attention as the planned GPU runs it, not as this CPU would.

A plan runs on the CPU for a CUDA GPU (`plan.gpu`). For SDPA without dropout both pick a
fused kernel that keeps the output and its logsumexp for backward, no T x T scores (the CPU's
flash kernel; CUDA's flash or memory-efficient one): the same memory. With dropout they part:
the CPU's flash kernel has none, so SDPA falls back to its math kernel, which materializes the
T x T scores, the causal mask and the dropout mask; CUDA's flash and memory-efficient
kernels draw the dropout inside the kernel and keep nothing more. `CudaAttention` runs such
a call without dropout (the fused kernel, CUDA's footprint) where CUDA's fused kernels take
the head size (a multiple of 8); elsewhere CUDA falls back to the math kernel as well and the
call runs as it is.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p")


class CudaAttention(TorchFunctionMode):
    """SDPA with dropout as CUDA's fused kernels hold it: no T x T tensor."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention:
            named = dict(zip(SDPA_ARGS, args))
            dropout = kwargs.get("dropout_p", named.get("dropout_p", 0.0))
            query = kwargs.get("query", named.get("query"))
            if dropout and query is not None and query.shape[-1] % 8 == 0:
                if len(args) > 4:
                    args = (*args[:4], 0.0, *args[5:])
                else:
                    kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)
