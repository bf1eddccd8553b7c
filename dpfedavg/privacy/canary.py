"""Canary clients and two empirical epsilons from one training run (pure numpy / scipy).

A run with ``canary-clients = m`` draws ``m`` fixed random unit directions ``c_1 .. c_m`` in ``R^d``; each
is inserted into the federation independently with probability 1/2 (Steinke, Nasr, Jagielski 2023,
"Privacy Auditing with One (1) Training Run", NeurIPS 2023: the randomness their theorem needs). An inserted
canary is a client whose update is ``C c_j`` every round it is sampled (bounded, sampled and noised like any
client); the canaries that were not inserted are the null set of Andrew, Kairouz, Oh, Oprea, McMahan,
Suriyakumar, "One-shot Empirical Privacy Estimation for Federated Learning" (ICLR 2024, arXiv 2302.03098).

After the run each canary has three scores, from the model's movement:

* final model: ``cos(c_j, w_0 - w_K)`` (Andrew et al.'s first variant);
* all iterates: the log-likelihood ratio of the released rounds, ``sum_k log(1 - q + q exp(mu z_jk - mu^2 / 2))`` with
  ``z_jk = sqrt(d) cos(c_j, w_{k-1} - w_k)`` (about ``N(0, 1)`` for a direction that was never inserted), ``q`` the
  run's sampling rate and ``mu = 1 / z`` (``z`` the noise multiplier): the Neyman-Pearson test of "inserted" against
  "not inserted" for the mechanism the accountant models (Poisson-sampled Gaussian releases, every round observed);
  at ``q = 1`` it is the sum ``sum_k z_jk``;
* largest one-round cosine: ``max_k cos(c_j, w_{k-1} - w_k)`` (Andrew et al.'s all-iterates statistic, their
  reference code's ``max_model_delta_cosines``). It tests one round at a time, so it stays below the accountant
  where a canary takes part in many rounds.

Two numbers come from the scores:

* ``gaussian_fit_epsilon`` (Andrew et al. §3): fit Gaussians to the inserted canaries' scores and to the
  null scores; the estimate is the epsilon at ``delta`` of the pair (``epsilon_two_gaussians``), with the
  null's std for both (a shift: mu-GDP). A measurement, not a bound.
* ``one_run_lower_bound`` (Steinke et al. Thm 5.2 with ``delta``): guess "inserted" for the ``g`` highest
  scores; with ``W`` correct guesses, any ``(epsilon, delta)``-DP mechanism has
  ``P[W >= v] <= beta + 2 m delta alpha`` (``beta = P[Bin(g, e^eps / (1 + e^eps)) >= v]``,
  ``alpha = max_{i=1..v} (P[Bin >= v - i] - beta) / i``); the largest epsilon rejected at ``significance``
  is a lower bound on the run's true epsilon with confidence ``1 - significance``. The guess count is taken
  from a fixed grid with a Bonferroni correction, so choosing the best one keeps the confidence.

No Flower import; the engines insert the canaries (``dpfedavg.core.canaries``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import scipy.optimize
import scipy.stats

from dpfedavg.core.canaries import canary_directions, inserted_canaries

__all__ = [
    "CanaryAudit",
    "CanaryScores",
    "CanarySet",
    "GaussianFit",
    "epsilon_two_gaussians",
    "gaussian_fit_band",
    "gaussian_fit_epsilon",
    "gaussian_fit_mu",
    "gdp_epsilon",
    "one_run_lower_bound",
    "one_run_p_value",
    "round_log_likelihood_ratio",
]

#: Fractions of the canaries the one-run audit may guess "inserted" for (Bonferroni over them).
GUESS_FRACTIONS: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.5)
#: Epsilons above this are reported as this (the bisection's upper end).
MAX_EPSILON = 100.0


@dataclass(frozen=True)
class CanarySet:
    """The run's canary directions and which of them are inserted.

    Attributes
    ----------
    directions:
        ``(m, d)``: unit rows ``c_j``, i.i.d. uniform on the sphere.
    inserted:
        ``(m,)`` bool: canary ``j`` is a client of the federation (probability 1/2 each, independently).
    """

    directions: np.ndarray
    inserted: np.ndarray

    @classmethod
    def draw(cls, seed: int, count: int, dim: int) -> CanarySet:
        """The run's ``count`` canaries in ``R^dim`` from its ``seed`` (``dpfedavg.core.canaries``)."""
        if count < 0 or dim < 1:
            raise ValueError(f"canaries: count = {count} must be >= 0 and dim = {dim} >= 1")
        return cls(canary_directions(seed, count, dim), inserted_canaries(seed, count))

    @property
    def count(self) -> int:
        """``m``: every canary drawn, inserted or not."""
        return len(self.inserted)

    @property
    def inserted_directions(self) -> np.ndarray:
        """The rows of the inserted canaries, in order: canary client ``n + i`` sends ``C`` times row ``i``."""
        return self.directions[self.inserted]

    @property
    def num_inserted(self) -> int:
        return int(self.inserted.sum())


def cosines(directions: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``cos(c_j, v)`` for every row ``c_j`` (unit rows); 0 where ``v`` is 0."""
    norm = float(np.linalg.norm(v))
    if norm == 0 or not math.isfinite(norm):
        return np.zeros(len(directions))
    return directions @ (np.asarray(v, dtype=np.float64) / norm)


def round_log_likelihood_ratio(z: np.ndarray, sampling_rate: float, noise_multiplier: float) -> np.ndarray:
    """``log(1 - q + q exp(mu z - mu^2 / 2))``, ``mu = 1 / noise_multiplier``: one round's evidence that a canary was
    inserted, from its standardised projection ``z`` on the round's movement.

    A canary sampled in the round (probability ``q``) shifts ``z`` by ``C / (noise std) = 1 / noise_multiplier`` when
    the noise dominates the movement; otherwise ``z ~ N(0, 1)``. At ``q = 1`` this is ``mu z - mu^2 / 2`` (affine in
    ``z``); with ``noise_multiplier = 0`` (no noise, ``mu`` infinite) the ratio's ranking is that of ``z`` itself,
    which is returned.
    """
    q = float(sampling_rate)
    if not 0 < q <= 1:
        raise ValueError(f"sampling_rate = {q} must be in (0, 1]")
    if noise_multiplier < 0 or not math.isfinite(noise_multiplier):
        raise ValueError(f"noise_multiplier = {noise_multiplier} must be finite and >= 0")
    z = np.asarray(z, dtype=np.float64)
    if noise_multiplier == 0:
        return z
    mu = 1.0 / noise_multiplier
    if q == 1:
        return mu * z - mu * mu / 2
    return np.logaddexp(math.log1p(-q), math.log(q) + mu * z - mu * mu / 2)


@dataclass
class CanaryScores:
    """The running scores of a run's canaries: fed ``w_k`` round after round (``observe``).

    ``final`` is ``cos(c_j, w_0 - w_K)``; ``all_iterates`` the sum over rounds of ``round_log_likelihood_ratio`` at the
    run's ``sampling_rate`` and ``noise_multiplier`` (the accountant's per-round ``PoissonSampled(q, Gaussian(z))``);
    ``max_cosine`` is ``max_k cos(c_j, w_{k-1} - w_k)``. With ``noise_multiplier = 0`` and ``q < 1`` the all-iterates
    score is the largest ``z_jk`` (the ranking the ratio tends to as the noise vanishes).
    """

    canaries: CanarySet
    w0: np.ndarray
    sampling_rate: float
    noise_multiplier: float
    w_last: np.ndarray = field(init=False)
    all_iterates: np.ndarray = field(init=False)
    max_cosine: np.ndarray = field(init=False)
    rounds: int = 0

    def __post_init__(self) -> None:
        round_log_likelihood_ratio(np.zeros(0), self.sampling_rate, self.noise_multiplier)  # the two checks
        self.w0 = np.array(self.w0, dtype=np.float64)
        self.w_last = self.w0.copy()
        self.all_iterates = np.full(self.canaries.count, -np.inf if self._largest_z else 0.0)
        self.max_cosine = np.full(self.canaries.count, -np.inf)

    @property
    def _largest_z(self) -> bool:
        """No noise and ``q < 1``: the all-iterates score is the largest ``z_jk``, not a sum of ratios."""
        return self.noise_multiplier == 0 and self.sampling_rate < 1

    def observe(self, w_k: np.ndarray) -> None:
        """Round ``k`` released ``w_k``: update the all-iterates scores with ``w_{k-1} - w_k``."""
        w_k = np.asarray(w_k, dtype=np.float64)
        step = cosines(self.canaries.directions, self.w_last - w_k)
        z = math.sqrt(self.canaries.directions.shape[1]) * step
        if self._largest_z:
            self.all_iterates = np.maximum(self.all_iterates, z)
        else:
            self.all_iterates = self.all_iterates + round_log_likelihood_ratio(
                z, self.sampling_rate, self.noise_multiplier
            )
        self.max_cosine = np.maximum(self.max_cosine, step)
        self.w_last = w_k.copy()
        self.rounds += 1

    @property
    def final(self) -> np.ndarray:
        return cosines(self.canaries.directions, self.w0 - self.w_last)


@dataclass(frozen=True)
class GaussianFit:
    """A Gaussian fitted to scores: their mean and standard deviation (ddof = 1)."""

    mean: float
    std: float

    @classmethod
    def of(cls, scores: Sequence[float]) -> GaussianFit:
        x = np.asarray(scores, dtype=np.float64)
        if len(x) < 2:
            raise ValueError(f"a Gaussian fit needs at least 2 scores, got {len(x)}")
        return cls(float(x.mean()), float(x.std(ddof=1)))


def _hockey_stick(p: GaussianFit, q: GaussianFit, eps: float) -> float:
    """``sup_S P(S) - e^eps Q(S)`` for ``P = N(p)``, ``Q = N(q)``: the mass where ``log dP/dQ > eps``.

    ``log dP/dQ(x) = a x^2 + b x + c``; the set where it exceeds ``eps`` is an interval or its complement
    (or a half-line when the stds are equal), whose ``P`` and ``Q`` masses are normal cdfs.
    """
    a = 0.5 * (1 / q.std**2 - 1 / p.std**2)
    b = p.mean / p.std**2 - q.mean / q.std**2
    c = 0.5 * (q.mean**2 / q.std**2 - p.mean**2 / p.std**2) + math.log(q.std / p.std) - eps

    def mass(g: GaussianFit, lo: float, hi: float) -> float:  # tails by sf / cdf: no 1 - (1 - tiny)
        if lo > g.mean:
            return float(scipy.stats.norm.sf(lo, g.mean, g.std) - scipy.stats.norm.sf(hi, g.mean, g.std))
        return float(scipy.stats.norm.cdf(hi, g.mean, g.std) - scipy.stats.norm.cdf(lo, g.mean, g.std))

    def outside(g: GaussianFit, lo: float, hi: float) -> float:
        return float(scipy.stats.norm.cdf(lo, g.mean, g.std) + scipy.stats.norm.sf(hi, g.mean, g.std))

    if abs(a) < 1e-12 * max(abs(b), 1e-300):
        if b == 0:
            return max(0.0, 1 - math.exp(eps)) if c > 0 else 0.0
        t = -c / b  # b x + c > 0
        lo, hi = (t, math.inf) if b > 0 else (-math.inf, t)
        return max(0.0, mass(p, lo, hi) - math.exp(eps) * mass(q, lo, hi))
    disc = b * b - 4 * a * c
    if disc <= 0:
        if a > 0:  # always above eps
            return max(0.0, 1 - math.exp(eps))
        return 0.0
    half = -0.5 * (b + math.copysign(math.sqrt(disc), b))  # the roots without cancellation
    r1, r2 = sorted((half / a, c / half if half != 0 else 0.0))
    if a > 0:  # above eps outside the roots
        pm, qm = outside(p, r1, r2), outside(q, r1, r2)
    else:
        pm, qm = mass(p, r1, r2), mass(q, r1, r2)
    return max(0.0, pm - math.exp(eps) * qm)


def epsilon_two_gaussians(null: GaussianFit, canary: GaussianFit, delta: float) -> float:
    """The smallest epsilon with ``delta(epsilon) <= delta`` between ``N(null)`` and ``N(canary)``, both ways.

    The exact privacy profile of the pair (Andrew et al. §3 fit the null and the canary scores with Gaussians
    and report this epsilon); for equal stds it is the mu-GDP epsilon with ``mu = |difference of means| / std``.
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta = {delta} must be in (0, 1)")
    if null.std <= 0 or canary.std <= 0:
        return math.inf if null.mean != canary.mean else 0.0

    def excess(eps: float) -> float:
        return max(_hockey_stick(canary, null, eps), _hockey_stick(null, canary, eps)) - delta

    if excess(0.0) <= 0:
        return 0.0
    if excess(MAX_EPSILON) > 0:
        return MAX_EPSILON
    return float(scipy.optimize.brentq(excess, 0.0, MAX_EPSILON, xtol=1e-9))


def gaussian_fit_epsilon(canary_scores: Sequence[float], null_scores: Sequence[float], delta: float) -> float:
    """Andrew et al.'s estimate: the epsilon of ``N(mean_null, s^2)`` vs ``N(mean_canary, s^2)``, ``s`` the null's std.

    That is mu-GDP with ``mu = (mean_canary - mean_null) / s``: the privacy loss of a Gaussian mechanism is a shift.
    Andrew et al. also fit the canaries' own std; with a few hundred canaries that ratio of stds is uncertain by
    about 10%, and at ``delta = 1e-6`` the tails of two Gaussians of unequal stds turn such an error into epsilons
    several units too large (``epsilon_two_gaussians`` computes that case exactly), so the run's estimate
    fits the shift only.
    """
    null = GaussianFit.of(null_scores)
    return epsilon_two_gaussians(null, GaussianFit(GaussianFit.of(canary_scores).mean, null.std), delta)


def gaussian_fit_mu(canary_scores: Sequence[float], null_scores: Sequence[float]) -> tuple[float, float]:
    """``mu = (mean_canary - mean_null) / s`` (``s`` the null's std, as in ``gaussian_fit_epsilon``) and its standard
    error.

    The error by the delta method: the two means (``r^2 / n_in + 1 / n_null``, ``r`` the ratio of the stds) and the
    null's std (``mu^2 / (2 (n_null - 1))``), all in units of ``s``.
    """
    canary, null = GaussianFit.of(canary_scores), GaussianFit.of(null_scores)
    if null.std <= 0:
        raise ValueError("the null scores are all equal: no Gaussian fit")
    n_in, n_null = len(canary_scores), len(null_scores)
    mu = (canary.mean - null.mean) / null.std
    ratio = canary.std / null.std
    se = math.sqrt(ratio**2 / n_in + 1 / n_null + mu**2 / (2 * (n_null - 1)))
    return mu, se


def gdp_epsilon(mu: float, delta: float) -> float:
    """The epsilon at ``delta`` of mu-GDP (``N(0, 1)`` against ``N(mu, 1)``); 0 for ``mu <= 0``.

    The one place the project writes it (the canary audit's band, the banded-MF audit's exact epsilon); the
    closed form of its privacy profile is Dong, Roth, Su 2022, Corollary 2.13.
    """
    if mu <= 0:
        return 0.0
    return epsilon_two_gaussians(GaussianFit(0.0, 1.0), GaussianFit(mu, 1.0), delta)


def gaussian_fit_band(
    canary_scores: Sequence[float], null_scores: Sequence[float], delta: float, confidence: float = 0.95
) -> tuple[float, float]:
    """The two-sided ``confidence`` interval of Andrew et al.'s estimate: ``mu +- z se`` (``gaussian_fit_mu``),
    mapped through the mu-GDP epsilon (increasing in ``mu``). The band of one run's measurement, not of the mechanism.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence = {confidence} must be in (0, 1)")
    mu, se = gaussian_fit_mu(canary_scores, null_scores)
    z = float(scipy.stats.norm.isf((1 - confidence) / 2))
    return gdp_epsilon(mu - z * se, delta), gdp_epsilon(mu + z * se, delta)


def one_run_p_value(num_canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """Steinke et al. Thm 5.2: ``P[W >= correct]`` is at most this for any ``(epsilon, delta)``-DP mechanism.

    ``num_canaries`` is ``m`` (each inserted with probability 1/2), ``guesses`` the canaries guessed
    "inserted", ``correct`` how many of them were.
    """
    p = 1.0 / (1.0 + math.exp(-epsilon))
    tail = scipy.stats.binom.sf(correct - np.arange(0, correct + 1) - 1, guesses, p)  # P[Bin >= correct - i]
    beta = float(tail[0])
    if delta == 0 or correct == 0:
        return beta
    alpha = float(np.max((tail[1:] - beta) / np.arange(1, correct + 1)))
    return min(1.0, beta + 2 * num_canaries * delta * alpha)


def _epsilon_rejected(num_canaries: int, guesses: int, correct: int, significance: float, delta: float) -> float:
    """The largest epsilon whose ``(epsilon, delta)`` claim the guesses reject at ``significance`` (0 if none)."""

    def gap(eps: float) -> float:
        return significance - one_run_p_value(num_canaries, guesses, correct, eps, delta)

    if gap(0.0) <= 0:
        return 0.0
    if gap(MAX_EPSILON) > 0:
        return MAX_EPSILON
    return float(scipy.optimize.brentq(gap, 0.0, MAX_EPSILON, xtol=1e-9))


def guess_counts(num_canaries: int) -> list[int]:
    """The guess counts the one-run audit tries (fixed before the scores are seen)."""
    return sorted({max(1, round(f * num_canaries)) for f in GUESS_FRACTIONS})


def one_run_lower_bound(
    scores: Sequence[float], inserted: Sequence[bool], delta: float, significance: float = 0.05
) -> float:
    """Steinke et al.'s lower bound on epsilon from one run, with confidence ``1 - significance``.

    The audit ranks the canaries by score and guesses "inserted" for the top ``g``, for each ``g`` in
    ``guess_counts``; each count is tested at ``significance / len(counts)`` (Bonferroni), and the best
    rejected epsilon is returned.
    """
    s = np.asarray(scores, dtype=np.float64)
    truth = np.asarray(inserted, dtype=bool)
    m = len(s)
    if m == 0:
        return 0.0
    order = np.argsort(-s, kind="stable")
    counts = guess_counts(m)
    level = significance / len(counts)
    best = 0.0
    for g in counts:
        correct = int(truth[order[:g]].sum())
        best = max(best, _epsilon_rejected(m, g, correct, level, delta))
    return best


@dataclass(frozen=True)
class CanaryAudit:
    """The run's empirical epsilons (``config.json`` ``final.audit``; ``RunResult.audit``).

    Attributes
    ----------
    epsilon_final, epsilon_all_iterates, epsilon_max_cosine:
        Andrew et al.'s Gaussian-fit estimate from each score of ``CanaryScores`` (the final model, the all-iterates
        likelihood ratio, the largest one-round cosine); ``nan`` with fewer than 2 inserted or 2 null canaries.
    epsilon_lower_bound:
        Steinke et al.'s one-run lower bound at ``confidence``: the larger of the bounds from the final-model and
        the all-iterates scores, each computed at half the significance.
    final_band, all_iterates_band, max_cosine_band:
        Each estimate's ``confidence`` interval (``gaussian_fit_band``; ``(nan, nan)`` where there is no estimate).
    """

    canaries: int
    inserted: int
    delta: float
    confidence: float
    epsilon_final: float
    epsilon_all_iterates: float
    epsilon_max_cosine: float
    epsilon_lower_bound: float
    final_band: tuple[float, float]
    all_iterates_band: tuple[float, float]
    max_cosine_band: tuple[float, float]
    final_scores: np.ndarray = field(repr=False)
    all_iterates_scores: np.ndarray = field(repr=False)
    max_cosine_scores: np.ndarray = field(repr=False)
    inserted_mask: np.ndarray = field(repr=False)

    @classmethod
    def of(cls, scores: CanaryScores, delta: float, significance: float = 0.05) -> CanaryAudit:
        """The audit of a finished run's scores at ``delta``."""
        mask = scores.canaries.inserted
        final, iterates, largest = scores.final, scores.all_iterates, scores.max_cosine
        enough = mask.sum() >= 2 and (~mask).sum() >= 2 and scores.rounds > 0

        def usable(x: np.ndarray) -> bool:
            return bool(enough and np.all(np.isfinite(x)) and np.std(x[~mask]) > 0)

        def fit(x: np.ndarray) -> float:
            return gaussian_fit_epsilon(x[mask], x[~mask], delta) if usable(x) else math.nan

        def band(x: np.ndarray) -> tuple[float, float]:
            return gaussian_fit_band(x[mask], x[~mask], delta, 1 - significance) if usable(x) else (math.nan, math.nan)

        bound = 0.0
        if scores.rounds > 0:  # both scores, each at significance / 2 (Bonferroni): the larger bound keeps the level
            bound = max(one_run_lower_bound(x, mask, delta, significance / 2) for x in (final, iterates))
        return cls(
            canaries=scores.canaries.count,
            inserted=int(mask.sum()),
            delta=delta,
            confidence=1 - significance,
            epsilon_final=fit(final),
            epsilon_all_iterates=fit(iterates),
            epsilon_max_cosine=fit(largest),
            epsilon_lower_bound=bound,
            final_band=band(final),
            all_iterates_band=band(iterates),
            max_cosine_band=band(largest),
            final_scores=final,
            all_iterates_scores=iterates,
            max_cosine_scores=largest,
            inserted_mask=mask.copy(),
        )

    def summary(self) -> dict[str, float | int | list[float | None]]:
        """The numbers ``config.json`` records (JSON-safe: ``nan`` becomes ``None`` there)."""

        def number(x: float) -> float | None:
            return None if math.isnan(x) else x

        return {
            "canaries": self.canaries,
            "inserted": self.inserted,
            "delta": self.delta,
            "confidence": self.confidence,
            "epsilon_final": number(self.epsilon_final),
            "epsilon_all_iterates": number(self.epsilon_all_iterates),
            "epsilon_max_cosine": number(self.epsilon_max_cosine),
            "epsilon_lower_bound": self.epsilon_lower_bound,
            "epsilon_final_band": [number(x) for x in self.final_band],
            "epsilon_all_iterates_band": [number(x) for x in self.all_iterates_band],
            "epsilon_max_cosine_band": [number(x) for x in self.max_cosine_band],
        }

