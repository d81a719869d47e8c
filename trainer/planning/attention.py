"""Attention as the planned GPU runs it, not as this CPU would.

A plan runs on the CPU for a CUDA GPU (`plan.gpu`). SDPA picks a kernel per call, and the
kernel decides what attention holds: CUDA's flash and memory-efficient kernels, like the
CPU's flash kernel, keep the output and its logsumexp for backward, no T x T scores; the math
kernel materializes the scores (and the causal and dropout masks). What CUDA picks
(`aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`), on the sm80+ GPUs the planner
knows:
- flash: fp16 / bf16, no explicit mask, head size a multiple of 8 up to 256, grouped-query
  heads allowed (`enable_gqa`);
- memory-efficient: fp32 too, masks allowed, head size a multiple of 8, but before torch
  2.14 no grouped-query heads (`enable_gqa` with fewer key than query heads);
- otherwise math.
So an fp32 Llama whose attention passes `enable_gqa` (transformers does, without a mask)
runs the math kernel on CUDA (measured on an H200, torch 2.11: 272 MiB tracked at 2048
tokens against 30 MiB fused), while this CPU's flash kernel takes it fused. With dropout,
the CPU's flash kernel has none, so SDPA falls back to math here, while CUDA's fused kernels
draw the dropout inside the kernel and keep nothing more. `CudaAttention` runs each call as
CUDA would hold it: forced to the math kernel where CUDA would choose it, without dropout
(a fused kernel, CUDA's footprint) where CUDA's fused kernels take it with dropout.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
EFFICIENT_TAKES_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 14)


def cuda_kernel(query: torch.Tensor, key: torch.Tensor, attn_mask: Any, enable_gqa: bool) -> str:
    """The kernel CUDA (sm80+) picks for this call: "flash", "efficient" or "math"."""
    dtype = query.dtype
    if torch.is_autocast_enabled(query.device.type):  # SDPA runs in autocast's dtype
        dtype = torch.get_autocast_dtype(query.device.type)
    head = query.shape[-1]
    grouped = enable_gqa and query.shape[-3] != key.shape[-3]
    if head % 8:  # both fused kernels need the head size in multiples of 8
        return "math"
    if dtype in (torch.float16, torch.bfloat16) and attn_mask is None and head <= 256:
        return "flash"
    if EFFICIENT_TAKES_GQA or not grouped:
        return "efficient"
    return "math"


class CudaAttention:
    """While entered, SDPA as CUDA's kernel choice holds it: the math kernel's T x T scores
    where CUDA picks math; no T x T tensor where it picks a fused kernel, with dropout too.

    `torch.nn.functional.scaled_dot_product_attention` itself is replaced (models look it up
    at each call), not intercepted by a torch-function mode: the autograd engine does not
    carry such a mode into backward, where activation checkpointing recomputes a block's
    forward, which then chose this CPU's kernel and saved other tensors than the forward had
    (torch.utils.checkpoint's CheckpointError, for an fp32 grouped-query model)."""

    def __enter__(self) -> CudaAttention:
        self.original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = functools.partial(as_cuda_runs, self.original)
        return self

    def __exit__(self, *exc: object) -> None:
        F.scaled_dot_product_attention = self.original


def as_cuda_runs(sdpa: Any, *args: Any, **kwargs: Any) -> Any:
    """`sdpa(*args, **kwargs)` with the kernel CUDA would run it with."""
    call = {**dict(zip(SDPA_ARGS, args)), **kwargs}
    query, key = call.get("query"), call.get("key")
    if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
        return sdpa(*args, **kwargs)
    kernel = cuda_kernel(query, key, call.get("attn_mask"), bool(call.get("enable_gqa")))
    if kernel == "math":
        with sdpa_kernel([SDPBackend.MATH]):
            return sdpa(*args, **kwargs)
    if call.get("dropout_p"):
        if len(args) > 4:
            args = (*args[:4], 0.0, *args[5:])
        else:
            kwargs["dropout_p"] = 0.0
    return sdpa(*args, **kwargs)
