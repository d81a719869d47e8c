"""Hand-written autograd functions: values against independent references, gradients against
finite differences (gradcheck / gradgradcheck in float64), and the properties each one exists
for: no overflow (logsumexp), no NaN and no n x n Jacobian (masked_softmax), a straight-through
gradient and a true quantization grid (fake_quantize).

References are plain torch computations written here, not the code under test: `torch.logsumexp`
and `x.masked_fill(~mask, -inf).softmax(dim)` with its NaN rows set to 0.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine.numerics.functional import fake_quantize, logsumexp, masked_softmax

F64 = torch.float64
# (shape, dim): 1-D, both dims of 2-D, a middle and a negative dim of 3-D, a size-1 reduced dim.
CASES = [((7,), 0), ((3, 5), 0), ((3, 5), 1), ((3, 5), -1), ((2, 3, 4), 1), ((2, 3, 4), -3)]
CASES += [((4, 1, 3), 1)]


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = F64, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)


def random_mask(shape: tuple[int, ...], dim: int, seed: int = 1) -> torch.Tensor:
    """~60% True; with more than one slice, the first slice along `dim` is fully masked (the
    NaN trap). A 1-D tensor is a single slice, so it stays partially masked."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(*shape, generator=g) < 0.6
    if len(shape) > 1:
        first: list[Any] = [0] * len(shape)
        first[dim] = slice(None)
        mask[tuple(first)] = False
    return mask


def ref_masked_softmax(x: torch.Tensor, mask: torch.Tensor, dim: int) -> torch.Tensor:
    y = x.masked_fill(~mask, float("-inf")).softmax(dim)
    return torch.nan_to_num(y, nan=0.0)  # fully masked slices: softmax of all -inf is NaN


def softmax_vjp(y: torch.Tensor, g: torch.Tensor, dim: int) -> torch.Tensor:
    """The softmax VJP written out: J^T g with J = diag(y) - y y^T."""
    return y * (g - (g * y).sum(dim, keepdim=True))


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op produces while active (what backward allocates)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


# ---------------------------------------------------------------- logsumexp


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize(("shape", "dim"), CASES)
def test_logsumexp_matches_torch(shape: tuple[int, ...], dim: int, keepdim: bool) -> None:
    x = randn(*shape) * 5
    ours, ref = logsumexp(x, dim, keepdim), torch.logsumexp(x, dim, keepdim)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize(("shape", "dim"), CASES)
def test_logsumexp_gradcheck(shape: tuple[int, ...], dim: int, keepdim: bool) -> None:
    x = randn(*shape, grad=True)
    assert gradcheck(lambda t: logsumexp(t, dim, keepdim), (x,))
    assert gradgradcheck(lambda t: logsumexp(t, dim, keepdim), (x,))


def test_logsumexp_no_overflow_in_fp32() -> None:
    x = torch.tensor([100.0, 200.0, 1000.0], requires_grad=True)
    naive = x.detach().exp().sum().log()
    assert torch.isinf(naive), "premise: exp(1000) overflows fp32, so the naive form is inf"
    ours = logsumexp(x, 0)
    assert ours.dtype == torch.float32 and torch.isfinite(ours)
    exact = 1000 + math.log1p(math.exp(-800) + math.exp(-900))  # == 1000 in any float
    assert ours.item() == pytest.approx(exact, rel=1e-7)
    # The gradient is the softmax, (e^-900, e^-800, 1) -> (0, 0, 1) in fp32, and finite.
    (grad,) = torch.autograd.grad(ours, x)
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, 1.0]), rtol=0, atol=1e-30)


def test_logsumexp_batched_large_fp32_matches_float64() -> None:
    x = randn(4, 9, dtype=torch.float32) * 300 + 500  # values in ~[-400, 1400]
    assert torch.isinf(x.exp().sum(1).log()).any()
    ref = torch.logsumexp(x.double(), 1)
    torch.testing.assert_close(logsumexp(x, 1).double(), ref, rtol=1e-6, atol=0)


def test_logsumexp_all_neg_inf_slice_is_neg_inf() -> None:
    x = torch.tensor([[float("-inf")] * 3, [0.0, 1.0, 2.0]], dtype=F64)
    torch.testing.assert_close(logsumexp(x, 1), torch.logsumexp(x, 1), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- masked_softmax

MASKED_CASES = [((4, 6), -1), ((4, 6), 0), ((2, 3, 5), 1), ((3, 2, 4), 2), ((9,), 0)]


def test_random_mask_has_what_the_tests_need() -> None:
    for shape, dim in MASKED_CASES:
        mask = random_mask(shape, dim)
        assert mask.any(dim).any(), f"{shape}: need some unmasked slice"
        assert (~mask.any(dim)).any() or len(shape) == 1, f"{shape}: need a fully masked slice"
        assert (~mask & mask.any(dim, keepdim=True)).any(), f"{shape}: need partial masking"


@pytest.mark.parametrize(("shape", "dim"), MASKED_CASES)
def test_masked_softmax_values(shape: tuple[int, ...], dim: int) -> None:
    x, mask = randn(*shape) * 3, random_mask(shape, dim)
    y = masked_softmax(x, mask, dim)
    torch.testing.assert_close(y, ref_masked_softmax(x, mask, dim), rtol=0, atol=1e-12)
    assert not torch.isnan(y).any()
    assert (y[~mask] == 0).all(), "masked positions must be exactly 0"
    live = mask.any(dim).to(F64)  # 1 where the slice has an unmasked entry, else 0
    torch.testing.assert_close(y.sum(dim), live, rtol=0, atol=1e-12)


def test_masked_softmax_fully_masked_row_is_zero_and_ignores_nan() -> None:
    x = torch.tensor([[1.0, float("nan"), 3.0], [float("nan"), 5.0, 6.0]], dtype=F64)
    mask = torch.tensor([[False, False, False], [False, True, True]])
    y = masked_softmax(x, mask, 1)
    assert torch.equal(y[0], torch.zeros(3, dtype=F64))
    expected = torch.tensor([0.0, math.exp(-1), 1.0], dtype=F64) / (1 + math.exp(-1))
    torch.testing.assert_close(y[1], expected, rtol=0, atol=1e-15)


def test_masked_softmax_broadcast_mask() -> None:
    x = randn(3, 5)
    mask = torch.tensor([True, False, True, True, False])  # (5,) broadcast over rows
    ref = ref_masked_softmax(x, mask.expand(3, 5), 1)
    torch.testing.assert_close(masked_softmax(x, mask, 1), ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("shape", "dim"), MASKED_CASES)
def test_masked_softmax_gradcheck(shape: tuple[int, ...], dim: int) -> None:
    x, mask = randn(*shape, grad=True), random_mask(shape, dim)
    assert gradcheck(lambda t: masked_softmax(t, mask, dim), (x,))
    assert gradgradcheck(lambda t: masked_softmax(t, mask, dim), (x,))


@pytest.mark.parametrize(("shape", "dim"), MASKED_CASES)
def test_masked_softmax_grad_matches_reference(shape: tuple[int, ...], dim: int) -> None:
    x, mask = randn(*shape, grad=True), random_mask(shape, dim)
    g = randn(*shape, seed=2)
    y = masked_softmax(x, mask, dim)
    (dx,) = torch.autograd.grad(y, x, g)
    ref_y = ref_masked_softmax(x.detach(), mask, dim)
    torch.testing.assert_close(dx, softmax_vjp(ref_y, g, dim), rtol=0, atol=1e-12)
    assert (dx[~mask] == 0).all()


def test_masked_softmax_grad_matches_torch_autograd_without_empty_rows() -> None:
    # torch's own softmax backward is the independent reference where it has no NaN rows.
    x, g = randn(5, 7, grad=True), randn(5, 7, seed=3)
    mask = torch.rand(5, 7, generator=torch.Generator().manual_seed(4)) < 0.6
    mask[:, 0] = True
    (ours,) = torch.autograd.grad(masked_softmax(x, mask, 1), x, g)
    (ref,) = torch.autograd.grad(x.masked_fill(~mask, float("-inf")).softmax(1), x, g)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)


def test_masked_softmax_backward_is_linear_memory() -> None:
    # A dense Jacobian for one row of n = 20000 would be n * n * 8 bytes = 3.2 GB in float64.
    n = 20_000
    x, g = randn(1, n, grad=True), randn(1, n, seed=5)
    mask = torch.rand(1, n, generator=torch.Generator().manual_seed(6)) < 0.7
    y = masked_softmax(x, mask, -1)
    with LargestTensor() as largest:
        (dx,) = torch.autograd.grad(y, x, g)
    assert 0 < largest.numel <= n, f"backward produced a tensor of {largest.numel} elements"
    ref_y = ref_masked_softmax(x.detach(), mask, -1)
    torch.testing.assert_close(dx, softmax_vjp(ref_y, g, -1), rtol=0, atol=1e-12)
    (ref,) = torch.autograd.grad(x.masked_fill(~mask, float("-inf")).softmax(-1), x, g)
    torch.testing.assert_close(dx, ref, rtol=0, atol=1e-12)


def test_masked_softmax_rejects_non_bool_mask() -> None:
    with pytest.raises(TypeError, match="bool"):
        masked_softmax(randn(2, 3), torch.ones(2, 3), 1)


# ---------------------------------------------------------------- fake_quantize

BITS = [2, 3, 4, 8]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_fake_quantize_grid(bits: int, dtype: torch.dtype) -> None:
    w = randn(64, 33, seed=bits, dtype=dtype)
    q = fake_quantize(w, bits)
    assert q.dtype == dtype and q.shape == w.shape
    qmax = 2 ** (bits - 1) - 1
    scale = w.abs().max() / qmax
    levels = q / scale
    eps = 8 * torch.finfo(dtype).eps * qmax  # round-off of the divide/multiply, in grid units
    assert (levels - levels.round()).abs().max() <= eps, "values must lie on the grid"
    assert levels.abs().max() <= qmax + eps
    assert q.unique().numel() <= 2**bits - 1
    assert (q - w).abs().max() <= scale / 2 * (1 + eps)
    # The extremes are representable: max|w| itself maps to +-qmax * scale = +-max|w|.
    i = w.abs().argmax()
    torch.testing.assert_close(q.flatten()[i], w.flatten()[i])


def test_fake_quantize_two_bits_is_ternary() -> None:
    w = torch.tensor([-1.0, -0.6, -0.4, 0.0, 0.3, 0.51, 0.9], dtype=F64)
    assert torch.equal(fake_quantize(w, 2), torch.tensor([-1.0, -1, 0, 0, 0, 1, 1], dtype=F64))


def test_fake_quantize_zero_tensor() -> None:
    w = torch.zeros(5, requires_grad=True)
    q = fake_quantize(w, 4)
    assert torch.equal(q, torch.zeros(5))
    (dw,) = torch.autograd.grad(q, w, torch.arange(5.0))
    assert torch.equal(dw, torch.arange(5.0))


@pytest.mark.parametrize("bits", BITS)
def test_fake_quantize_backward_is_straight_through(bits: int) -> None:
    w, g = randn(8, 5, grad=True), randn(8, 5, seed=7)
    (dw,) = torch.autograd.grad(fake_quantize(w, bits), w, g)
    assert torch.equal(dw, g), "STE: the gradient passes through unchanged"


def test_fake_quantize_vjp_is_identity() -> None:
    # gradcheck compares the backward with finite differences of the forward. For an STE that
    # comparison is meant to fail: the forward is a step function whose finite differences are 0
    # (or huge across a step, or nonzero everywhere when max|w| moves the scale), while the
    # backward is the identity by choice, not by derivation. So instead check what the STE
    # promises: its VJP is v -> v for every v, i.e. the Jacobian it reports is exactly I.
    w = randn(6, seed=8)

    def fq(t: torch.Tensor) -> torch.Tensor:
        return fake_quantize(t, 3)

    for seed in range(3):
        v = randn(6, seed=10 + seed)
        out, vjp = torch.autograd.functional.vjp(fq, w, v)
        assert torch.equal(out, fq(w))
        assert torch.equal(vjp, v)
    jac = torch.autograd.functional.jacobian(fq, w)  # built row by row from the backward
    assert torch.equal(jac, torch.eye(6, dtype=F64))
    # The premise above, checked: finite differences disagree with the STE.
    assert not gradcheck(fq, (w.clone().requires_grad_(),), raise_exception=False)


@pytest.mark.parametrize("bits", [1, 0, -3])
def test_fake_quantize_rejects_too_few_bits(bits: int) -> None:
    with pytest.raises(ValueError, match=r"bits must be >= 2, got -?\d+"):
        fake_quantize(randn(3), bits)


@pytest.mark.parametrize("bits", [2.0, True, "4"])
def test_fake_quantize_rejects_non_int_bits(bits: Any) -> None:
    with pytest.raises(TypeError, match="bits must be an int"):
        fake_quantize(randn(3), bits)


def test_fake_quantize_rejects_integer_tensor() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        fake_quantize(torch.arange(4), 4)
