"""Banded matrix-factorization (DP-FTRL) noise: the strategy ``C``, its streamed inverse and its sensitivity.

The matrix mechanism for a run of ``K`` rounds releases ``C x + Z`` and uses ``x + C^{-1} Z`` (Kairouz et
al. 2021, "Practical and private (deep) learning without sampling or shuffling"; Choquette-Choo et al. 2023,
"(Amplified) Banded Matrix Factorization: a unified approach to private training"). Here ``x`` is the
``K x d`` matrix whose row ``k`` is round ``k``'s sum of bounded client updates, the rows of ``Z`` are
i.i.d. ``N(0, sigma^2 I_d)``, and ``C`` is a ``K x K`` lower-triangular **b-banded Toeplitz** strategy
matrix, ``C[i, j] = c_{i-j}`` for ``0 <= i - j < b`` and 0 otherwise.

* `sqrt_prefix_coefficients()` is the default strategy: ``c_j = binom(2j, j) / 4^j``, the Toeplitz
  square root of the prefix-sum matrix (``C C = A``; Fichtenberger, Henzinger, Upadhyay 2023, "Constant
  matters: fine-grained error bound on differentially private continual observation"), cut to ``b`` bands
  (Choquette-Choo et al. 2023, §4).
* `BandedNoiseStream` releases ``(C^{-1} Z)_k`` one round at a time by forward substitution,
  ``w_k = (z_k - sum_{j=1}^{b-1} c_j w_{k-j}) / c_0`` (Choquette-Choo et al. 2023, Algorithm 9): O(b d)
  time and memory per round, with ``state_dict`` / ``load_state_dict`` for a bit-identical resume.
* `minsep_sensitivity()` is the sensitivity of ``C x`` when one client's participations are at least
  ``b`` rounds apart: the columns of a b-banded ``C`` at distance ``>= b`` touch disjoint rows, so
  ``||C (x - x')||_F^2 = sum_t ||C[:, t]||^2 ||g_t||^2`` and the worst case is the sum of the largest
  allowed squared column norms (Choquette-Choo et al. 2023, §3, the b-min-sep participation schema;
  Kalinin & Lampert 2024, arXiv 2405.13763, Theorem 2; jax-privacy's ``toeplitz.minsep_sensitivity_squared``).
  `brute_force_sensitivity()` enumerates every allowed pattern for small ``K`` (it also bounds patterns
  closer than ``b``, where the closed form is wrong).

Pure numpy; no Flower, no dp-accounting. The privacy accounting is
`dpfedavg.privacy.banded_mf_accounting`; the participation rules are `dpfedavg.core.participation`.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpfedavg.core.types import Vector

__all__ = [
    "BandedNoiseStream",
    "SensitivityBounds",
    "brute_force_sensitivity",
    "check_bands",
    "check_coefficients",
    "column_norms_squared",
    "default_bands",
    "max_column_norm",
    "inverse_coefficients",
    "minsep_sensitivity",
    "noise_norm_bounds",
    "sqrt_prefix_coefficients",
    "toeplitz_matrix",
]

logger = logging.getLogger(__name__)

#: Largest ``K`` `brute_force_sensitivity()` accepts (``2^K`` patterns at ``b = 1``).
BRUTE_FORCE_MAX_ROUNDS = 16
#: ``p`` of ``noise_norm_bounds``: an honest noise vector's norm is outside its bounds with probability at most
#: ``p`` on each side, so an honest checkpoint's buffer is refused with probability at most ``2 (b - 1) p``.
NOISE_NORM_FAILURE_PROBABILITY = 1e-12


# ------------------------------------------------------------------------------------------ strategy coefficients
def sqrt_prefix_coefficients(bands: int) -> tuple[float, ...]:
    """``c_j = binom(2j, j) / 4^j`` for ``j < bands``: the square root of the prefix-sum matrix, banded.

    The lower-triangular Toeplitz ``C`` with these coefficients (not banded) satisfies ``C C = A``, the
    all-ones lower-triangular prefix-sum matrix (Fichtenberger, Henzinger, Upadhyay 2023; jax-privacy's
    ``toeplitz.optimal_max_error_strategy_coefs``): ``c_j`` are the Taylor coefficients of ``(1 - x)^{-1/2}``,
    whose square is ``(1 - x)^{-1} = sum_k x^k``, so ``sum_{i+j=k} c_i c_j = 1``. Computed as the
    product ``c_j = c_{j-1} (2j - 1) / (2j)``, which stays exact in binary for every ``j`` a run can use.

    Raises
    ------
    ValueError
        ``bands < 1``.
    """
    check_bands(bands)
    coefficients = [1.0]
    for j in range(1, bands):
        coefficients.append(coefficients[-1] * (2 * j - 1) / (2 * j))
    return tuple(coefficients)


def check_bands(bands: int, num_rounds: int | None = None) -> None:
    """Raise ``ValueError`` naming ``bands`` unless it is an integer with ``1 <= bands`` (and ``<= num_rounds``)."""
    if isinstance(bands, bool) or not isinstance(bands, int | np.integer) or bands < 1:
        raise ValueError(f"bands = {bands!r}: the number of bands b must be an integer >= 1")
    if num_rounds is not None and bands > num_rounds:
        raise ValueError(
            f"bands = {bands} exceeds num-rounds = {num_rounds}: allowed 1 <= bands <= num-rounds "
            f"(a b-banded K x K strategy has at most K bands)"
        )


def check_coefficients(coefficients: Sequence[float], num_rounds: int | None = None) -> tuple[float, ...]:
    """Validate strategy coefficients ``c_0 .. c_{b-1}`` and return them as a tuple of floats.

    Parameters
    ----------
    coefficients:
        The first column of the b-banded Toeplitz ``C`` (``b = len(coefficients)``).
    num_rounds:
        ``K``; when given, ``b <= K`` is required.

    Raises
    ------
    ValueError
        No coefficient (``b < 1``), ``b > K``, a non-finite coefficient, or ``c_0 = 0``
        (``det C = c_0^K``, so ``C`` is singular and ``C^{-1} Z`` does not exist).
    """
    coefs = np.asarray(coefficients, dtype=np.float64).ravel()
    check_bands(int(coefs.size), num_rounds)
    if not np.all(np.isfinite(coefs)):
        raise ValueError(f"strategy-coefficients = {coefs.tolist()}: every coefficient must be finite")
    if coefs[0] == 0.0:
        raise ValueError(
            f"strategy-coefficients = {coefs.tolist()}: c_0 = 0 makes C singular (det C = c_0^K); "
            f"allowed: any finite coefficients with c_0 != 0"
        )
    _warn_if_unstable(coefs)
    return tuple(float(c) for c in coefs)


def _warn_if_unstable(coefs: np.ndarray) -> None:
    """Log when ``C^{-1}``'s entries grow geometrically (a root of ``sum_j c_j x^j`` inside the unit disk).

    Not a privacy problem (the release is ``C x + Z`` whatever ``C^{-1}`` looks like) but the noise the
    model sees then explodes with ``K``. Positive non-increasing coefficients, such as the default, never
    trigger it (Eneström-Kakeya theorem).
    """
    if coefs.size < 2:
        return
    roots = np.roots(coefs[::-1])
    smallest = float(np.min(np.abs(roots)))
    if smallest < 1.0 - 1e-9:
        logger.warning(
            "strategy coefficients %s: C^{-1} grows like %.4g^k (a root of sum c_j x^j has modulus %.4g < 1); "
            "the correlated noise will blow up over long runs",
            coefs.tolist(),
            1.0 / smallest,
            smallest,
        )


def inverse_coefficients(coefficients: Sequence[float], length: int) -> np.ndarray:
    """The first ``length`` entries ``e_0 .. e_{length-1}`` of ``C^{-1}``'s Toeplitz column: ``C^{-1}[i, j] = e_{i-j}``.

    ``C^{-1}`` of a lower-triangular Toeplitz ``C`` is lower-triangular Toeplitz, its entries the power series
    ``1 / (c_0 + c_1 x + ...)``: ``e_0 = 1 / c_0`` and ``e_n = -(sum_{j=1}^{min(n, b-1)} c_j e_{n-j}) / c_0``.
    """
    coefs = np.asarray(check_coefficients(coefficients), dtype=np.float64)
    inverse = np.zeros(max(0, int(length)))
    for n in range(inverse.size):
        tail = sum(coefs[j] * inverse[n - j] for j in range(1, min(n, coefs.size - 1) + 1))
        inverse[n] = ((1.0 if n == 0 else 0.0) - tail) / coefs[0]
    return inverse


def noise_norm_bounds(std: float, dim: int, p: float = NOISE_NORM_FAILURE_PROBABILITY) -> tuple[float, float]:
    """``(low, high)`` with ``P(||g|| < low) <= p`` and ``P(||g|| > high) <= p`` for ``g ~ N(0, std^2 I_dim)``.

    ``||g|| / std`` is chi-distributed with ``dim`` degrees of freedom. Laurent & Massart 2000 (Lemma 1) give,
    for ``x = ln(1/p)``, ``P(chi^2 >= d + 2 sqrt(d x) + 2 x) <= p`` and ``P(chi^2 <= d - 2 sqrt(d x)) <= p``;
    since ``d + 2 sqrt(d x) + 2 x <= (sqrt(d) + sqrt(2 x))^2``:

    ``high = std (sqrt(d) + sqrt(2 ln(1/p)))``, ``low = std sqrt(max(0, d - 2 sqrt(d ln(1/p))))``

    (the lower bound is 0 below ``d = 4 ln(1/p)``, about 111 at ``p = 1e-12``).
    """
    if not 0 < p < 1:
        raise ValueError(f"p = {p!r}: must lie in (0, 1)")
    x, d = math.log(1 / p), float(dim)
    return std * math.sqrt(max(0.0, d - 2 * math.sqrt(d * x))), std * (math.sqrt(d) + math.sqrt(2 * x))


def toeplitz_matrix(coefficients: Sequence[float], num_rounds: int) -> np.ndarray:
    """The ``K x K`` lower-triangular b-banded Toeplitz ``C``: ``C[i, j] = c_{i-j}`` for ``0 <= i-j < b``."""
    coefs = check_coefficients(coefficients, num_rounds)
    c = np.zeros((num_rounds, num_rounds))
    for j, value in enumerate(coefs):
        c += value * np.eye(num_rounds, k=-j)
    return c


def default_bands(num_clients: int, clients_per_round: float, num_rounds: int) -> int:
    """``b = floor(n / r)`` clipped to ``[1, K]``: ``n`` clients in ``b`` cyclic groups of about ``r``.

    Every client then takes part once every ``b`` rounds (the most separation a cohort of ``r`` allows, since
    on average at most ``n / b`` clients are eligible per round). ``r = n`` gives ``b = 1``, today's
    independent mechanism with full participation.
    """
    if num_clients < 1:
        raise ValueError(f"num-clients = {num_clients!r}: need at least 1 client")
    if not 0 < clients_per_round <= num_clients:
        raise ValueError(f"clients-per-round = {clients_per_round!r}: allowed 0 < clients-per-round <= {num_clients}")
    if num_rounds < 1:
        raise ValueError(f"num-rounds = {num_rounds!r}: need at least 1 round")
    b = math.floor(num_clients / clients_per_round * (1 + 1e-12))  # 100 / 33.333... is 3, not 2.9999
    return max(1, min(num_rounds, b))


# -------------------------------------------------------------------------------------------------- sensitivity
def column_norms_squared(coefficients: Sequence[float], num_rounds: int) -> np.ndarray:
    """``||C[:, t]||^2 = sum_{j < min(b, K - t)} c_j^2`` for ``t = 0 .. K-1`` (non-increasing in ``t``)."""
    coefs = np.asarray(check_coefficients(coefficients, num_rounds))
    cumulative = np.cumsum(coefs**2)
    rows_left = np.minimum(coefs.size, num_rounds - np.arange(num_rounds))  # rows of column t inside C
    return cumulative[rows_left - 1]


def max_column_norm(coefficients: Sequence[float], num_rounds: int) -> float:
    """``max_t ||C[:, t]|| = ||c||_2`` (column 0): the single-participation sensitivity per unit clip."""
    return float(math.sqrt(column_norms_squared(coefficients, num_rounds)[0]))


def minsep_sensitivity(
    coefficients: Sequence[float],
    num_rounds: int,
    max_participations: int | None = None,
    clip: float = 1.0,
) -> float:
    """Sensitivity of ``C x`` over ``K`` rounds when a client's participations are at least ``b`` apart.

    Closed form (Choquette-Choo et al. 2023, §3; Kalinin & Lampert 2024, Theorem 2): with ``k`` the
    largest allowed number of participations, ``min(max_participations, ceil(K / b))``,

    ``sensitivity = clip * sqrt( sum_{i < k} ||C[:, i b]||^2 )``.

    Two participations ``t < t'`` with ``t' - t >= b`` touch rows ``[t, t+b)`` and ``[t', t'+b)`` of ``C``,
    which are disjoint, so a client whose bounded updates ``g_t`` (``||g_t|| <= clip``) enter the sum in
    rounds ``P`` moves ``C x`` by ``sum_{t in P} ||C[:, t]||^2 ||g_t||^2 <= clip^2 sum_{t in P} ||C[:, t]||^2``
    (any signs of ``c_j``). Column norms do not increase with ``t`` and the ``i``-th participation is at round
    ``>= i b``, so the pattern ``0, b, 2b, ...`` is the worst. Under add/remove-one-client adjacency this is
    the whole run's L2 sensitivity; the released ``x + C^{-1} Z`` is a post-processing of ``C x + Z``.

    Parameters
    ----------
    coefficients:
        ``c_0 .. c_{b-1}``.
    num_rounds:
        ``K`` (or a prefix length: the sensitivity of the first ``K`` rounds' release).
    max_participations:
        ``k``; ``None`` for no cap beyond the separation.
    clip:
        ``C_clip``, the norm bound of one client's update in one round.
    """
    coefs = check_coefficients(coefficients, num_rounds)
    k = _participations(len(coefs), num_rounds, max_participations)
    if not clip >= 0:
        raise ValueError(f"clip = {clip!r}: must be >= 0")
    norms2 = column_norms_squared(coefs, num_rounds)
    return float(clip * math.sqrt(float(np.sum(norms2[: k * len(coefs) : len(coefs)]))))


def _participations(min_separation: int, num_rounds: int, max_participations: int | None) -> int:
    most = -(-num_rounds // min_separation)  # ceil(K / b): rounds 0, b, 2b, ... < K
    if max_participations is None:
        return most
    if isinstance(max_participations, bool) or not isinstance(max_participations, int | np.integer):
        raise ValueError(f"max-participations = {max_participations!r}: must be an integer >= 1 (or None)")
    if max_participations < 1:
        raise ValueError(f"max-participations = {max_participations}: must be >= 1")
    return min(int(max_participations), most)


@dataclass(frozen=True)
class SensitivityBounds:
    """Brute-force bounds on the sensitivity over every allowed pattern (equal when the closed form holds).

    ``lower`` is attained by some allowed pattern and some updates (so a true sensitivity is at least this);
    ``upper`` holds for every allowed pattern and every update.
    """

    lower: float
    upper: float
    worst_pattern: tuple[int, ...]

    @property
    def exact(self) -> bool:
        return math.isclose(self.lower, self.upper, rel_tol=1e-12, abs_tol=0.0)


def brute_force_sensitivity(
    coefficients: Sequence[float],
    num_rounds: int,
    min_separation: int,
    max_participations: int | None = None,
    clip: float = 1.0,
) -> SensitivityBounds:
    """Sensitivity of ``C x`` by enumerating every allowed participation pattern (test support, ``K <= 16``).

    A pattern is a non-empty set ``P`` of rounds, pairwise at least ``min_separation`` apart, of size at most
    ``max_participations``. With ``X = C^T C``, one client's effect on ``C x`` is
    ``||sum_{t in P} C[:, t] g_t^T||_F^2 = sum_{s, t in P} X[s, t] <g_s, g_t>`` with ``||g_t|| <= clip``;
    its supremum (an SDP over the Gram matrix of the ``g_t``) lies between

    * ``clip^2 max(trace X_PP, sum X_PP)``: orthogonal ``g_t`` give the trace, equal ``g_t`` the sum; and
    * ``clip^2 sum |X_PP|``, since ``|<g_s, g_t>| <= clip^2``.

    Both bounds are maximised over all patterns. With ``min_separation >= b`` every ``X_PP`` is diagonal and
    the bounds meet (`minsep_sensitivity()` must then equal them). With ``min_separation < b`` they
    show how far the disjoint-columns formula under-estimates.
    """
    coefs = check_coefficients(coefficients, num_rounds)
    if num_rounds > BRUTE_FORCE_MAX_ROUNDS:
        raise ValueError(
            f"num-rounds = {num_rounds}: brute force enumerates patterns for K <= {BRUTE_FORCE_MAX_ROUNDS}"
        )
    if min_separation < 1:
        raise ValueError(f"min_separation = {min_separation}: must be >= 1")
    k = _participations(min_separation, num_rounds, max_participations)
    c = toeplitz_matrix(coefs, num_rounds)
    gram = c.T @ c
    best_lower, best_upper, worst = 0.0, 0.0, ()
    for pattern in _patterns(num_rounds, min_separation, k):
        block = gram[np.ix_(pattern, pattern)]
        lower = max(float(np.trace(block)), float(block.sum()))
        upper = float(np.abs(block).sum())
        if lower > best_lower:
            best_lower, worst = lower, tuple(pattern)
        best_upper = max(best_upper, upper)
    return SensitivityBounds(clip * math.sqrt(best_lower), clip * math.sqrt(best_upper), worst)


def _patterns(num_rounds: int, min_separation: int, most: int):
    """Every non-empty increasing tuple of rounds in ``[0, K)`` with gaps ``>= min_separation``, size ``<= most``."""
    for size in range(1, most + 1):
        for combo in itertools.combinations(range(num_rounds), size):
            if all(b - a >= min_separation for a, b in itertools.pairwise(combo)):
                yield list(combo)


# ------------------------------------------------------------------------------------------------ noise stream
class BandedNoiseStream:
    """Round ``k``'s correlated noise ``w_k = (C^{-1} Z)_k`` from ``z_k ~ N(0, sigma^2 I_d)`` and the last b-1 w's.

    ``C w = Z`` row by row gives ``c_0 w_k + sum_{j=1}^{b-1} c_j w_{k-j} = z_k`` (``w_{<0} = 0``), so

    ``w_k = (z_k - sum_{j=1}^{b-1} c_j w_{k-j}) / c_0``

    (Choquette-Choo et al. 2023, Algorithm 9; jax-privacy ``toeplitz.inverse_as_streaming_matrix``): O(b d)
    time per round and a buffer of b-1 vectors. Round ``k``'s ``z_k`` is drawn from the generator the caller
    passes for that round (the project derives it from ``(seed, Stream.SERVER_NOISE, k)``), exactly as
    `dpfedavg.core.dp.gaussian_noise()` draws: ``rng.standard_normal(d) * sigma``. With ``b = 1`` and
    ``c_0 = 1`` the stream therefore returns bit for bit the independent server noise of today's mechanism.

    Parameters
    ----------
    coefficients:
        ``c_0 .. c_{b-1}`` (validated by `check_coefficients()`).
    dim:
        ``d``, the length of the released sum.
    noise_std:
        ``sigma``, the std of each coordinate of ``Z``'s rows, in the sum's units (0: no noise, no draws).
    """

    def __init__(self, coefficients: Sequence[float], dim: int, noise_std: float) -> None:
        self.coefficients = check_coefficients(coefficients)
        if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim < 1:
            raise ValueError(f"dim = {dim!r}: the released sum needs dimension >= 1")
        if not (math.isfinite(noise_std) and noise_std >= 0):
            raise ValueError(f"noise_std = {noise_std!r}: must be finite and >= 0")
        self.dim = int(dim)
        self.noise_std = float(noise_std)
        self.position = 0  #: the next round this stream releases
        self._ring = np.zeros((self.bands - 1, self.dim))  # w_t sits in row t mod (b-1)
        self._scratch = np.empty(self.dim) if self.bands > 1 else None

    @property
    def bands(self) -> int:
        return len(self.coefficients)

    def next(self, round_index: int, rng: np.random.Generator) -> Vector:
        """``w_k`` for ``k = round_index`` (0-based), which must be the stream's `position`.

        Every round consumes one draw of ``z_k`` (an empty or skipped round too), so rounds stay aligned
        with their generators whatever happened in earlier rounds.
        """
        if round_index != self.position:
            raise ValueError(
                f"the banded noise stream is at round {self.position}, asked for round {round_index}: "
                f"rounds must be released in order, each exactly once"
            )
        if self.noise_std == 0.0:
            w = np.zeros(self.dim)
        else:
            w = rng.standard_normal(self.dim) * self.noise_std
            for j in range(1, min(self.bands, self.position + 1)):  # fixed order j = 1 .. b-1 (w_{<0} = 0)
                np.multiply(self._ring[(self.position - j) % (self.bands - 1)], self.coefficients[j], out=self._scratch)
                w -= self._scratch
            if self.bands > 1 or self.coefficients[0] != 1.0:
                w /= self.coefficients[0]
        if self.bands > 1:
            self._ring[self.position % (self.bands - 1)] = w
        self.position += 1
        return w  # the ring holds its own copy: the caller may modify w

    # -------------------------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Everything round ``position`` depends on: the buffer ``w_{k-1} .. w_{k-b+1}`` (rows, newest first),
        the position and the strategy (checked on load). Plain numpy arrays and Python scalars (``np.savez``-able).
        """
        return {
            "position": self.position,
            "history": self._history(),
            "coefficients": np.asarray(self.coefficients),
            "noise_std": self.noise_std,
            "dim": self.dim,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; refuse one written for another strategy, dimension or noise std.

        Raises
        ------
        ValueError
            The checkpoint's coefficients, ``d`` or ``sigma`` differ from this stream's (resuming with a
            different strategy would not be the same mechanism continued), its buffer has the wrong shape, or a
            buffered vector's norm is outside what its law allows (``_check_buffer_law``).
        """
        saved = tuple(float(c) for c in np.asarray(state["coefficients"], dtype=np.float64).ravel())
        if saved != self.coefficients:
            raise ValueError(
                f"strategy-coefficients = {list(self.coefficients)} but the checkpoint was written with "
                f"{list(saved)}: resume with the same strategy"
            )
        if int(state["dim"]) != self.dim or float(state["noise_std"]) != self.noise_std:
            raise ValueError(
                f"the checkpoint's noise stream has d = {int(state['dim'])}, sigma = {float(state['noise_std'])!r}; "
                f"this run has d = {self.dim}, sigma = {self.noise_std!r}: resume with the same settings"
            )
        history = np.asarray(state["history"], dtype=np.float64)
        if history.shape != self._ring.shape:
            raise ValueError(f"the checkpoint's noise buffer has shape {history.shape}, expected {self._ring.shape}")
        if not np.all(np.isfinite(history)):
            raise ValueError("the checkpoint's noise buffer holds NaN or Inf")
        position = int(state["position"])
        if position < 0:
            raise ValueError(f"the checkpoint's noise stream position is {position}, must be >= 0")
        self._check_buffer_law(history, position)
        self.position = position
        for j in range(1, self.bands):
            self._ring[(position - j) % (self.bands - 1)] = history[j - 1]

    def _check_buffer_law(self, history: np.ndarray, position: int) -> None:
        """Each buffered ``w_t = (C^{-1} Z)_t`` must look like a draw of its law: ``N(0, s_t^2 I_d)`` with
        ``s_t = sigma ||C^{-1}[t, :]||``, so its norm within ``noise_norm_bounds`` (``p`` =
        ``NOISE_NORM_FAILURE_PROBABILITY``); rows before round 0 (and every row without noise) exactly 0.

        A scaled or replaced buffer (``x 1e6``, ``1e300``) would add to the coming rounds noise the accounting does
        not describe (or, scaled down, remove some of it); the bounds refuse it while an honest buffer passes but
        with probability ``2 (b - 1) p``. Below ``d = 4 ln(1/p)`` the lower bound is 0: a buffer scaled down is
        then refused only if it is 0 where noise was due (a Gaussian draw is 0 with probability 0).
        """
        inverse = inverse_coefficients(self.coefficients, max(position, 1))
        row_norms = np.sqrt(np.cumsum(inverse**2))  # ||C^{-1}[t, :]|| = sqrt(e_0^2 + ... + e_t^2)
        for j in range(1, self.bands):
            t, row = position - j, history[j - 1]
            scale = float(np.abs(row).max())  # scaled first: a row of 1e300s has a finite norm
            norm = scale * float(np.linalg.norm(row / scale)) if scale > 0 else 0.0
            if t < 0 or self.noise_std == 0.0:
                if norm != 0.0:
                    raise ValueError(
                        f"the checkpoint's noise buffer row {j - 1} (round {t}) has norm {norm:.6g}, but "
                        + ("no noise is drawn in this run" if t >= 0 else "there is no round before 0")
                        + ": it must be 0"
                    )
                continue
            std = self.noise_std * float(row_norms[t])
            low, high = noise_norm_bounds(std, self.dim)
            if not low <= norm <= high or norm == 0.0:  # a Gaussian draw is 0 with probability 0
                raise ValueError(
                    f"the checkpoint's noise buffer row {j - 1} (round {t}'s (C^-1 Z)_t, N(0, s^2 I_{self.dim}) with "
                    f"s = {std:.6g}) has norm {norm:.6g}, outside [{low:.6g}, {high:.6g}] (an honest draw is outside "
                    f"with probability <= {2 * NOISE_NORM_FAILURE_PROBABILITY:g}): an edited buffer would add noise "
                    "the accounting does not describe"
                )

    def _history(self) -> np.ndarray:
        """``w_{k-1}, ..., w_{k-b+1}`` (newest first; zeros before round 0) for ``k`` = `position`."""
        history = np.zeros((self.bands - 1, self.dim))
        for j in range(1, self.bands):
            history[j - 1] = self._ring[(self.position - j) % (self.bands - 1)]
        return history
