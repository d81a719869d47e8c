"""Custom autograd functions whose backward is written by hand, for stability or by design.

- `logsumexp`: shifts by the max so fp32 inputs above ~88 don't overflow `exp`; the backward
  rebuilds the softmax from the saved input and output so it stays differentiable (double
  backward works).
- `fake_quantize`: symmetric per-tensor fake quantization with a straight-through estimator; the
  backward is deliberately *not* the derivative of the forward (that is zero almost everywhere).
- `masked_softmax`: softmax over the unmasked positions only, zeros (not NaN) for a fully masked
  row, and an O(n) backward from the saved output alone, never the n x n Jacobian.

Each is a `torch.autograd.Function` behind a small wrapper; call the wrapper, not `.apply`.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["fake_quantize", "logsumexp", "masked_softmax"]


class LogSumExp(torch.autograd.Function):
    """log(sum(exp(x), dim)) computed as m + log(sum(exp(x - m))) with m the max along dim."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, keepdim: bool) -> torch.Tensor:
        m = x.amax(dim, keepdim=True)  # (..., 1, ...)
        # An all -inf slice has m = -inf and x - m = nan; shifting by 0 instead gives log(0) =
        # -inf, the right answer. Finite slices are unaffected: any shift is exact in theory,
        # the max is the one that keeps every exponent <= 0 in practice.
        m = m.masked_fill(torch.isneginf(m), 0.0)
        out = (x - m).exp().sum(dim, keepdim=True).log() + m  # (..., 1, ...)
        if not keepdim:
            out = out.squeeze(dim)
        ctx.dim, ctx.keepdim = dim, keepdim
        # Save input and output, not the softmax: a softmax computed here would be a leaf to
        # autograd, so double backward would miss its dependence on x. Rebuilding it in
        # backward from x and the output (whose grad_fn is this node) keeps the graph whole.
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, out = ctx.saved_tensors
        if not ctx.keepdim:
            out, grad_out = out.unsqueeze(ctx.dim), grad_out.unsqueeze(ctx.dim)  # (..., 1, ...)
        softmax = (x - out).exp()  # (..., n, ...); exponents <= 0, so no overflow here either
        return grad_out * softmax, None, None


def logsumexp(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Numerically stable log-sum-exp of `x` along `dim`, same values as `torch.logsumexp`.

    Twice differentiable: its gradient is the softmax along `dim`, itself differentiable.
    """
    return LogSumExp.apply(x, dim, keepdim)


class FakeQuantize(torch.autograd.Function):
    """Round to a symmetric integer grid and back; straight-through gradient.

    Straight-through estimator: the true derivative of round() is 0 almost everywhere (and
    undefined at the steps), which would stop training dead. We pretend the forward was the
    identity wherever the value lies inside the clipping range [-max|w|, max|w|], and zero
    outside it. With a per-tensor scale taken from max|w| itself, nothing is ever outside, so the
    backward is exactly the identity: grad_w = grad_out. The scale is treated as a constant (no
    gradient flows through max|w|), as in quantization-aware training.
    """

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, bits: int) -> torch.Tensor:
        del ctx  # the backward needs nothing: it is the identity
        qmax = 2 ** (bits - 1) - 1  # symmetric: levels -qmax..qmax, -2**(bits-1) left unused
        amax = w.detach().abs().amax()  # () scalar, per tensor
        # An all-zero tensor has scale 0; any positive scale quantizes it to exactly zero.
        scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))  # ()
        # The clamp only catches round-off: w / scale is within [-qmax, qmax] up to one ulp.
        return (w / scale).round().clamp(-qmax, qmax) * scale  # shape of w, on the grid

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
        del ctx
        return grad_out, None


def fake_quantize(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Quantize `w` to 2**(bits-1)-1 levels each side of zero, scaled by max|w|, and dequantize.

    The result holds at most 2**bits - 1 distinct values, each within scale/2 of `w`, where
    scale = max|w| / (2**(bits-1) - 1). Gradients pass straight through (see `FakeQuantize`).
    `w` must be finite: an inf would make the scale inf and every other value 0 or NaN.
    """
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"bits must be an int, got {type(bits).__name__}")
    if bits < 2:
        raise ValueError(
            f"bits must be >= 2, got {bits}: symmetric quantization keeps 2**(bits-1) - 1 "
            "levels each side of zero, and fewer than 2 bits leaves none"
        )
    if not w.is_floating_point():
        raise TypeError(f"fake_quantize needs a floating-point tensor, got {w.dtype}")
    return FakeQuantize.apply(w, bits)


class MaskedSoftmax(torch.autograd.Function):
    """Softmax over the positions where `mask` is True; exactly 0 elsewhere."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: torch.Tensor, dim: int) -> torch.Tensor:
        # masked_fill also ignores whatever sits at masked positions (even NaN).
        z = x.masked_fill(~mask, float("-inf"))  # (..., n, ...)
        m = z.amax(dim, keepdim=True)  # (..., 1, ...)
        m = m.masked_fill(torch.isneginf(m), 0.0)  # fully masked: -inf - -inf would be NaN
        e = (z - m).exp()  # (..., n, ...); masked -> exp(-inf) = 0 exactly
        s = e.sum(dim, keepdim=True)  # (..., 1, ...)
        # s >= 1 whenever the slice has an unmasked entry (the max contributes exp(0) = 1), so
        # the clamp only changes fully masked slices, where 0 / 1 = 0 replaces 0 / 0 = NaN.
        y = e / s.clamp(min=1.0)
        ctx.dim = dim
        ctx.save_for_backward(y)  # an output: double backward goes through this node again
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (y,) = ctx.saved_tensors
        # J = diag(y) - y y^T, applied without forming it: J^T g = y * (g - <g, y>). O(n) per
        # slice. Masked positions and fully masked slices have y = 0, hence gradient 0, which
        # is right: their outputs are constant.
        dot = (grad_out * y).sum(ctx.dim, keepdim=True)  # (..., 1, ...)
        return y * (grad_out - dot), None, None


def masked_softmax(x: torch.Tensor, mask: torch.Tensor, dim: int) -> torch.Tensor:
    """Softmax of `x` along `dim` over positions where `mask` (bool, broadcastable) is True.

    Masked positions get probability exactly 0; a slice with no unmasked position gives all
    zeros rather than NaN, so padding-only rows don't poison a batch. Twice differentiable.
    """
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {mask.dtype}")
    return MaskedSoftmax.apply(x, mask, dim)
