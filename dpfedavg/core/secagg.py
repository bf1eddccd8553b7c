"""Encoding a client's noisy update for secure aggregation (SecAgg+), in pure numpy.

Secure aggregation sums integers modulo ``M``; the server learns the sum of
the sampled clients' vectors and nothing else. Alg. 1 line 10 (each client
adds its share of the noise) is only private under it: without it the server
sees every ``g_i + zeta_i``, whose own noise is ``z C / sqrt(r)`` per
client. This module turns ``g`` into a vector on an integer grid so that the
integer sum the protocol computes *is* the sum of what the clients meant to
send, and so that the accountant's guarantee still applies:

1. **Grid** (`SecAggGrid`): step ``Delta = 2^e`` and range
   ``c = (Q/2) Delta >= C + k s`` with ``Q = 2^bits`` levels, where ``s`` is
   the client's noise std and ``k`` the ``clip-stds``. Powers of two make
   Flower's quantizer (``(y + c) Q / (2c)``, then stochastic rounding) exact
   on grid points, so the protocol adds no error of its own.
2. **Rounding before noise** (`conditional_round()`): ``g`` is rounded
   stochastically (unbiased) to the grid, redrawn until ``||g~|| <= C``
   (Kairouz, Liu, Steinke 2021, "The distributed discrete Gaussian
   mechanism", conditional randomized rounding), so the sensitivity stays
   ``C`` and the accountant is unchanged. Every coordinate moves by less than
   ``Delta``.
3. **Discrete Gaussian noise** (`discrete_gaussian()`) on the grid, with
   the client's noise std (Canonne, Kamath, Steinke 2020, Algorithm 3). The
   sum of ``N`` such draws is within ``tau`` (`ddg_tau()`) of a discrete
   Gaussian of the summed variance (Kairouz et al. 2021, Prop. 14), whose
   privacy is that of the continuous Gaussian the accountant uses (Canonne et
   al. 2020, Thm. 4 / Prop. 5) -- ``tau`` is reported and is ``0.0`` in
   floating point at every setting we ship.
4. **Clipping to ``[-c, c]``** (`encode()`): happens only if a noise
   coordinate exceeds ``k s``; discrete Gaussians are sub-Gaussian, so each
   coordinate clips with probability at most ``2 exp(-k^2/2)``
   (`SecAggGrid.clip_probability()`). On the event that nothing clips the
   output is exactly the unclipped mechanism's, so the run's guarantee is
   ``(epsilon, delta + (1 + e^epsilon) p)`` with ``p`` the union bound over
   the run (reported in ``config.json``).

The integer sum of ``N`` clients must stay below ``M``: ``N Q < M``
(`SecAggGrid.max_participants`), checked against ``n`` when the run
config is validated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dpfedavg.core.types import Vector

__all__ = [
    "SecAggGrid",
    "SecAggPrivacyTerms",
    "privacy_terms",
    "conditional_round",
    "ddg_tau",
    "discrete_gaussian",
    "encode",
    "quantization_error_bound",
]

#: Stochastic-rounding draws before falling back to rounding toward zero (never needed in practice).
MAX_ROUNDING_TRIES = 64


@dataclass(frozen=True)
class SecAggGrid:
    """The integer grid one round's updates are encoded on.

    Attributes
    ----------
    step:
        ``Delta``, a power of two.
    clipping_range:
        ``c = (levels / 2) * step``: coordinates live in ``[-c, c]``; Flower's
        ``clipping_range``.
    levels:
        ``Q = 2^bits``: a coordinate becomes an integer in ``[0, Q]``; Flower's
        ``quantization_range``.
    modulus:
        ``M = 2^modulus_bits``: the protocol's arithmetic is mod ``M``; Flower's ``modulus_range``.
    """

    step: float
    clipping_range: float
    levels: int
    modulus: int

    @classmethod
    def for_round(cls, clip: float, noise_std: float, clip_stds: float, bits: int, modulus_bits: int) -> SecAggGrid:
        """The grid for ``C = clip``, per-client noise std ``s`` and ``k = clip_stds``: ``c >= C + k s``."""
        if not clip > 0 or noise_std < 0 or clip_stds < 0:
            raise ValueError(f"need clip > 0, noise_std >= 0, clip_stds >= 0; got {clip}, {noise_std}, {clip_stds}")
        if not 1 <= bits < modulus_bits <= 62:
            raise ValueError(f"need 1 <= bits < modulus_bits <= 62; got bits={bits}, modulus_bits={modulus_bits}")
        levels = 2**bits
        needed = clip + clip_stds * noise_std
        exponent = math.ceil(math.log2(2 * needed / levels))
        step = math.ldexp(1.0, exponent)
        return cls(step=step, clipping_range=levels * step / 2, levels=levels, modulus=2**modulus_bits)

    @property
    def max_participants(self) -> int:
        """The most clients whose integer sum cannot wrap around: ``N Q < M``."""
        return (self.modulus - 1) // self.levels

    def clip_probability(self, clip: float, noise_std: float, coordinates: int) -> float:
        """Union bound on the probability that any of ``coordinates`` noisy coordinates is clipped.

        ``|g~_j| <= C`` always, so a coordinate clips only if its noise
        exceeds ``c - C``; a discrete Gaussian with parameter ``s`` has
        ``P(|X| >= t) <= 2 exp(-t^2 / (2 s^2))`` (Canonne et al. 2020, Prop. 25).
        """
        margin = self.clipping_range - clip
        if noise_std == 0:
            return 0.0
        if margin <= 0:
            return 1.0
        return min(1.0, coordinates * 2.0 * math.exp(-(margin**2) / (2 * noise_std**2)))


def quantization_error_bound(grid: SecAggGrid, num_clients: int, dim: int) -> float:
    """Bound on ``||sum_i (g~_i - g_i)||_2`` for ``num_clients`` clients: ``N Delta sqrt(d)``.

    The secure sum equals ``sum_i g~_i + sum_i zeta_i`` exactly (no error from
    the protocol when nothing clips); rounding moves each coordinate of each
    ``g_i`` by less than ``Delta``. The rounding is unbiased apart from the
    rare redraws, so the typical error is ``~ sqrt(N d) Delta / 2``.
    """
    return num_clients * grid.step * math.sqrt(dim)


def _stochastic_round(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Round each entry up with probability equal to its fractional part (unbiased)."""
    low = np.floor(x)
    return low + (rng.random(x.shape) < (x - low))


def conditional_round(g: Vector, step: float, bound: float, rng: np.random.Generator) -> Vector:
    """Round ``g`` to the grid ``step * Z^d`` so that the result has norm ``<= bound``.

    Stochastic (unbiased) rounding, redrawn until ``||g~|| <= bound``
    (Kairouz et al. 2021, Alg. 1 "conditional randomized rounding"); after
    `MAX_ROUNDING_TRIES` failed draws, rounding toward zero, which never
    increases any coordinate's magnitude. Requires ``||g|| <= bound``.
    """
    if float(np.linalg.norm(g)) > bound * (1 + 1e-12):
        raise ValueError(f"||g|| = {np.linalg.norm(g):.6g} exceeds the bound {bound:g}; clip or normalize first")
    scaled = np.asarray(g, dtype=np.float64) / step
    for _ in range(MAX_ROUNDING_TRIES):
        rounded = _stochastic_round(scaled, rng) * step
        if float(np.linalg.norm(rounded)) <= bound:
            return rounded
    return np.trunc(scaled) * step


def discrete_gaussian(size: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """``size`` draws of the discrete Gaussian ``N_Z(0, sigma^2)`` (integers), ``P(x) ~ exp(-x^2 / (2 sigma^2))``.

    Canonne, Kamath, Steinke 2020, Algorithm 3: a discrete Laplace proposal
    with scale ``t = floor(sigma) + 1`` (the difference of two geometric
    variables), accepted with probability
    ``exp(-(|y| - sigma^2/t)^2 / (2 sigma^2))``; vectorized, in floating
    point. ``sigma = 0`` gives zeros.
    """
    if sigma < 0 or not math.isfinite(sigma):
        raise ValueError(f"sigma must be finite and >= 0, got {sigma!r}")
    if sigma == 0 or size == 0:
        return np.zeros(size, dtype=np.int64)
    t = math.floor(sigma) + 1
    p = -math.expm1(-1.0 / t)  # 1 - exp(-1/t), accurate for large t
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        batch = max(16, int(1.3 * (size - filled)) + 8)
        y = (rng.geometric(p, batch) - rng.geometric(p, batch)).astype(np.int64)
        accept = rng.random(batch) < np.exp(-((np.abs(y) - sigma**2 / t) ** 2) / (2 * sigma**2))
        take = y[accept][: size - filled]
        out[filled : filled + len(take)] = take
        filled += len(take)
    return out


def ddg_tau(sigma_steps: float, num_clients: int) -> float:
    """``tau`` of Kairouz et al. 2021, Prop. 14: how far a sum of ``N`` discrete Gaussians is from one.

    ``tau = 10 sum_{k=1}^{N-1} exp(-2 pi^2 sigma^2 k / (k + 1))`` with
    ``sigma`` in grid steps; it enters the guarantee as an additive slack and
    underflows to ``0.0`` once ``sigma`` is a few steps.
    """
    if sigma_steps <= 0 or num_clients <= 1:
        return 0.0 if num_clients <= 1 else math.inf
    k = np.arange(1, num_clients, dtype=np.float64)
    return float(10.0 * np.sum(np.exp(-2 * math.pi**2 * sigma_steps**2 * k / (k + 1))))


def encode(g: Vector, grid: SecAggGrid, clip: float, noise_std: float, rng: np.random.Generator) -> tuple[Vector, int]:
    """``g`` -> ``g~ + zeta~`` on ``grid``, clipped to ``[-c, c]``; returns it and the number of clipped coordinates.

    The replacement of Alg. 1 line 10 under secure aggregation:
    `conditional_round()` (``||g~|| <= C``), then discrete Gaussian noise
    with std ``noise_std`` on the grid. Every entry is an exact multiple of
    ``grid.step`` in ``[-c, c]``.
    """
    g_tilde = conditional_round(g, grid.step, clip, rng)
    noise = discrete_gaussian(g_tilde.shape[0], noise_std / grid.step, rng) * grid.step
    y = g_tilde + noise
    clipped = int(np.count_nonzero(np.abs(y) > grid.clipping_range))
    if clipped:
        y = np.clip(y, -grid.clipping_range, grid.clipping_range)
    return y, clipped


@dataclass(frozen=True)
class SecAggPrivacyTerms:
    """What the encoding adds to a run's ``(epsilon, delta)`` (the discrete Gaussian's side of the accounting).

    Attributes
    ----------
    tau:
        Kairouz et al. 2021, Prop. 14, at the worst case ``|S_k| = n`` (the smallest per-client std).
    tau_slack:
        ``tau sqrt(d) z``: how much the concentrated-DP epsilon ``1/z`` the accountant assumes can grow
        (Kairouz et al. 2021, Thm. 1), relative to ``1/z``.
    clip_probability:
        Union bound ``p`` on any of the ``K n d`` coordinates being clipped to ``[-c, c]``.
    delta_including_clipping:
        ``delta + (1 + e^epsilon) p``: the run's delta once clipping is counted.
    """

    tau: float
    tau_slack: float
    clip_probability: float
    delta_including_clipping: float


def privacy_terms(
    *,
    clip: float,
    noise_multiplier: float,
    std_at_n: float,
    clip_stds: float,
    bits: int,
    modulus_bits: int,
    num_clients: int,
    dim: int,
    rounds: int,
    epsilon: float,
    delta: float,
) -> SecAggPrivacyTerms:
    """The `SecAggPrivacyTerms` of a run; ``std_at_n`` is a client's noise std when all ``n`` are sampled."""
    if std_at_n <= 0:
        return SecAggPrivacyTerms(0.0, 0.0, 0.0, delta)
    grid = SecAggGrid.for_round(clip, std_at_n, clip_stds, bits, max(modulus_bits, bits + 1))
    tau = ddg_tau(std_at_n / grid.step, num_clients)
    per_coordinate = 2.0 * math.exp(-(clip_stds**2) / 2)
    p_clip = min(1.0, rounds * num_clients * dim * per_coordinate)
    extra = (1 + math.exp(min(epsilon, 700.0))) * p_clip
    return SecAggPrivacyTerms(tau, tau * math.sqrt(dim) * noise_multiplier, p_clip, delta + extra)
