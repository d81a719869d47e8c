"""Rényi-DP accounting of the Poisson-subsampled Gaussian mechanism (what DP-SGD is).

The same numbers as Opacus's `RDPAccountant` (itself TF Privacy's): the RDP of one step at
order α is log(A_α)/(α − 1) (Mironov, Talwar & Zhang 2019, "Rényi Differential Privacy of
the Sampled Gaussian Mechanism", section 3.3), computed by the binomial sum for integer α and
by the two-sided series with erfc terms for fractional α; RDP adds up over steps; and
ε(δ) = min over α of rdp − (log δ + log α)/(α − 1) + log((α − 1)/α) (Balle et al. 2020,
theorem 21), over Opacus's default orders. Written from the formulas with the standard
library only (no SciPy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Opacus's RDPAccountant.DEFAULT_ALPHAS.
DEFAULT_ALPHAS: list[float] = [1 + x / 10.0 for x in range(1, 100)] + [
    float(a) for a in range(12, 64)
]


def _log_add(a: float, b: float) -> float:
    """log(e^a + e^b)."""
    lo, hi = min(a, b), max(a, b)
    if lo == -math.inf:
        return hi
    return math.log1p(math.exp(lo - hi)) + hi


def _log_sub(a: float, b: float) -> float:
    """log(e^a − e^b) for a >= b."""
    if a < b:
        raise ValueError("log-space subtraction would be negative")
    if b == -math.inf:
        return a
    if a == b:
        return -math.inf
    try:
        return math.log(math.expm1(a - b)) + b
    except OverflowError:
        return a


def _log_erfc(x: float) -> float:
    """log(erfc(x)), accurate where erfc underflows (large x): asymptotic series there."""
    if x < 20.0:
        return math.log(math.erfc(x))
    # erfc(x) = e^{-x²}/(x√π) · Σ (−1)^n (2n−1)!! / (2x²)^n; 8 terms are exact to double
    # precision from x = 20 on.
    series, term = 1.0, 1.0
    for n in range(1, 8):
        term *= -(2 * n - 1) / (2 * x * x)
        series += term
    return -x * x - math.log(x * math.sqrt(math.pi)) + math.log(series)


def _log_a_int(q: float, sigma: float, alpha: int) -> float:
    log_a = -math.inf
    for i in range(alpha + 1):
        log_coef = math.log(math.comb(alpha, i)) + i * math.log(q) + (alpha - i) * math.log1p(-q)
        log_a = _log_add(log_a, log_coef + (i * i - i) / (2 * sigma**2))
    return log_a


def _log_a_frac(q: float, sigma: float, alpha: float) -> float:
    log_a0, log_a1 = -math.inf, -math.inf
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    coef, i = 1.0, 0  # binom(alpha, i), updated in place: alternates sign once i > alpha
    while True:
        j = alpha - i
        log_coef = math.log(abs(coef))
        log_t0 = log_coef + i * math.log(q) + j * math.log1p(-q)
        log_t1 = log_coef + j * math.log(q) + i * math.log1p(-q)
        log_e0 = math.log(0.5) + _log_erfc((i - z0) / (math.sqrt(2) * sigma))
        log_e1 = math.log(0.5) + _log_erfc((z0 - j) / (math.sqrt(2) * sigma))
        log_s0 = log_t0 + (i * i - i) / (2 * sigma**2) + log_e0
        log_s1 = log_t1 + (j * j - j) / (2 * sigma**2) + log_e1
        if coef > 0:
            log_a0, log_a1 = _log_add(log_a0, log_s0), _log_add(log_a1, log_s1)
        else:
            log_a0, log_a1 = _log_sub(log_a0, log_s0), _log_sub(log_a1, log_s1)
        coef *= (alpha - i) / (i + 1)
        i += 1
        if max(log_s0, log_s1) < -30:
            return _log_add(log_a0, log_a1)


def rdp_per_step(q: float, sigma: float, alpha: float) -> float:
    """RDP at order `alpha` of one step: sampling rate `q`, noise multiplier `sigma`."""
    if q == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    if q == 1.0:
        return alpha / (2 * sigma**2)
    log_a = _log_a_int(q, sigma, int(alpha)) if float(alpha).is_integer() else None
    if log_a is None:
        log_a = _log_a_frac(q, sigma, alpha)
    return log_a / (alpha - 1)


def epsilon_from_rdp(
    rdp: Sequence[float], delta: float, alphas: Sequence[float] = DEFAULT_ALPHAS
) -> tuple[float, float]:
    """(ε, the best order) for `delta` from the RDP at each order (Balle et al. 2020)."""
    best = (math.inf, math.nan)
    for a, r in zip(alphas, rdp):
        eps = r - (math.log(delta) + math.log(a)) / (a - 1) + math.log((a - 1) / a)
        if eps < best[0]:
            best = (eps, a)
    return best


class RDPAccountant:
    """ε after `steps` steps of one (sampling rate, noise multiplier): the per-step RDP is
    computed once, composition multiplies it by the step count."""

    def __init__(
        self, sample_rate: float, noise_multiplier: float, alphas: Sequence[float] = DEFAULT_ALPHAS
    ) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
        self.sample_rate, self.noise_multiplier = sample_rate, noise_multiplier
        self.alphas = list(alphas)
        self._rdp = [rdp_per_step(sample_rate, noise_multiplier, a) for a in self.alphas]

    def epsilon(self, steps: int, delta: float) -> float:
        if steps == 0:
            return 0.0
        return epsilon_from_rdp([r * steps for r in self._rdp], delta, self.alphas)[0]


MAX_SIGMA = 1e6  # Opacus's bound on the search


def noise_for_epsilon(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    tolerance: float = 0.01,
) -> float:
    """The noise multiplier that spends at most `target_epsilon` at `delta` over `steps`
    steps at `sample_rate`: Opacus's `get_noise_multiplier` (what `make_private_with_epsilon`
    uses), step for step: double σ from 20 until ε is within the target, then bisect until ε
    is at most `tolerance` below it, and return the upper end (ε never above the target).
    Raises ValueError (one line, naming `target_epsilon`) when σ up to MAX_SIGMA cannot."""

    def epsilon(sigma: float) -> float:
        return RDPAccountant(sample_rate, sigma).epsilon(steps, delta)

    low, high, eps_high = 0.0, 10.0, math.inf
    while eps_high > target_epsilon:
        high *= 2
        eps_high = epsilon(high)
        if high > MAX_SIGMA:
            raise ValueError(
                f"target_epsilon {target_epsilon:g} is out of reach: after {steps} "
                f"step{'s' if steps != 1 else ''} at "
                f"sampling rate {sample_rate:.4g} (global batch / training samples) and "
                f"delta={delta:g}, epsilon is still {eps_high:.3g} with noise multiplier "
                f"{high:.3g} (the RDP bound does not fall below it however large the noise). "
                "Ask for a larger step.target_epsilon or step.delta, or fewer steps "
                "(train.max_steps), or set step.noise_multiplier instead"
            )
    while target_epsilon - eps_high > tolerance:
        mid = (low + high) / 2
        eps = epsilon(mid)
        if eps < target_epsilon:
            high, eps_high = mid, eps
        else:
            low = mid
    return high
