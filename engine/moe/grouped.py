"""Every expert's matrix product in one call, with the routing's counts left on the device.

The dispatch (engine/moe/routing.py) sorts a layer's token-slot assignments by expert:
expert g's rows are [offsets[g-1], offsets[g]) of the sorted rows, `offsets` (E,) int32 the
running total of the counts. `grouped_mm(x, w, offsets)` multiplies each expert's rows by its
weight `w[g]` with shapes that do not depend on the counts: nothing reads them on the host
first, so torch.compile traces a mixture in one graph whatever the routing. (A split by sizes
read on the host cut the graph there and recompiled the frame after it for every new pattern
of counts, until dynamo gave up on it: issue #65.)

`torch._grouped_mm` computes it where it can (torchtitan's and transformers' experts call it
too); one `torch.mm` per expert where it cannot (`loop_mm`, an operator whose inside
torch.compile does not trace, so it cuts no graph either). `loop_reason` says which and why.
On CPU both are a loop of the same `mm` calls: the two give the same values, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor

# The dtypes torch 2.13's kernels multiply (CPU and CUDA; float64 is refused).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# torch 2.13's shape function of torch._grouped_mm (its meta, what torch.compile and fake
# tensors run) accepts bfloat16 only, although the kernels take the three above.
TRACED_DTYPES = (torch.bfloat16,)
DEVICES = ("cpu", "cuda")  # where torch._grouped_mm has a kernel


def group_offsets(counts: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    """Rows per group (E,) -> each group's end row (E,) int32 on `device`, as
    torch._grouped_mm takes them. From a list (expert parallelism's host counts) too."""
    counts = torch.as_tensor(counts, device=device)
    return torch.cumsum(counts, dim=0, dtype=torch.int32)


def row_groups(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows,) int64: the group of each row, from the groups' end rows (a per-expert bias is
    gathered with it; its shape, unlike a repeat by the counts, does not depend on them)."""
    index = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, index, right=True)


def _tracing(x: torch.Tensor) -> bool:
    """torch.compile, or fake tensors (trainer.plan's simulated step): torch._grouped_mm's
    shape function runs instead of its kernel."""
    return torch.compiler.is_compiling() or isinstance(x, FakeTensor)


def _takes_layout(t: torch.Tensor) -> bool:
    """The kernel's layout: row- or column-major in the last two dims, the other stride a
    multiple of 16 bytes."""
    align = 16 // t.element_size()
    rows, cols = t.shape[-2:]
    row_stride, col_stride = t.stride()[-2:]
    if col_stride == 1 and row_stride >= max(1, cols):
        return row_stride % align == 0
    if row_stride == 1 and col_stride >= max(1, rows):
        return col_stride % align == 0
    return False


def loop_reason(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why `grouped_mm(x, w, ...)` runs one matmul per expert rather than torch._grouped_mm;
    None when the kernel runs it. `x` (M, K), `w` (E, K, N)."""
    if x.device.type not in DEVICES:
        return f"torch._grouped_mm has no kernel on {x.device.type}"
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 0):
        return "torch._grouped_mm needs a GPU of compute capability 8.0 or more"
    if x.dtype != w.dtype:
        return f"the rows are {x.dtype}, the weights {w.dtype}"
    if x.dtype not in KERNEL_DTYPES:
        return f"torch._grouped_mm multiplies float32, bfloat16 or float16, not {x.dtype}"
    if _tracing(x) and x.dtype not in TRACED_DTYPES:
        return f"torch 2.13 traces torch._grouped_mm in bfloat16 only, not {x.dtype}"
    align = 16 // x.element_size()
    if w.shape[-2] % align or w.shape[-1] % align:  # the backward's products too
        return f"torch._grouped_mm needs widths of 16-byte multiples, not {tuple(w.shape[-2:])}"
    if not (_takes_layout(x) and _takes_layout(w)):
        return f"torch._grouped_mm refuses strides {x.stride()} and {w.stride()}"
    if not _tracing(x) and (x.data_ptr() % 16 or w.data_ptr() % 16):
        return "torch._grouped_mm needs 16-byte aligned operands"
    return None


def _as_autocast_would(t: torch.Tensor) -> torch.Tensor:
    """A matmul operand cast as autocast casts `torch.mm`'s (to its dtype, float64 left as it
    is): neither torch._grouped_mm nor `loop_mm` is an autocast operator."""
    device = t.device.type
    if torch.is_autocast_enabled(device) and t.is_floating_point() and t.dtype != torch.float64:
        return t.to(torch.get_autocast_dtype(device))
    return t


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`x` (M, K) rows sorted by group, `w` (E, K, N), `offsets` (E,) int32 the groups' end
    rows (the last M) -> (M, N): group g's rows times w[g], in the dtype `x[a:b] @ w[g]`
    would take under autocast. Every group's weight takes part, an empty group's with a zero
    gradient (data parallelism's gradient sync expects every parameter in the graph)."""
    x, w = _as_autocast_would(x), _as_autocast_would(w)
    if loop_reason(x, w) is None:
        return torch._grouped_mm(x, w, offs=offsets)
    return loop_mm(x, w, offsets)


@torch.library.custom_op("cumulus::loop_mm", mutates_args=())
def loop_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`grouped_mm` as one `torch.mm` per group: the counts read on the host once, inside an
    operator torch.compile does not look into (so they neither cut its graph nor guard it)."""
    out = x.new_empty(x.shape[0], w.shape[-1])
    start = 0
    for g, end in enumerate(offsets.tolist()):
        torch.mm(x[start:end], w[g], out=out[start:end])
        start = end
    return out


@loop_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("cumulus::loop_mm_backward", mutates_args=())
def loop_mm_backward(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `loop_mm` for `x` and `w`: per group, grad @ w[g]^T and x^T @ grad
    (the products autograd takes for `x[a:b] @ w[g]`); an empty group's is zero."""
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    parts, start = [], 0
    for g, end in enumerate(offsets.tolist()):
        torch.mm(grad[start:end], w[g].T, out=grad_x[start:end])
        parts.append(x[start:end].T @ grad[start:end])  # (K, N)
        start = end
    return grad_x, torch.stack(parts)


@loop_mm_backward.register_fake
def _(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    return grad_x, w.new_empty(w.shape)


def _save(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    del output
    ctx.save_for_backward(*inputs)


def _backward(
    ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, None]:
    x, w, offsets = ctx.saved_tensors  # type: ignore[attr-defined]
    grad_x, grad_w = loop_mm_backward(x, w, offsets, grad.contiguous())
    return grad_x, grad_w, None


loop_mm.register_autograd(_backward, setup_context=_save)
