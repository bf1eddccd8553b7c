"""An empirical privacy auditor: a lower bound on epsilon from running the mechanism on neighbours.

The accountant (`dpfedavg.privacy.accountants`) gives an *upper* bound
on epsilon, and it is only as right as the model of the mechanism it
composes. This module checks that model from the other side, the way
Jagielski, Ullman and Oprea (2020) and Nasr et al. (2021) audit DP training:
run the project's own release many times on two neighbouring federations,
try to tell them apart, and turn the distinguisher's error rates into a
statistically valid *lower* bound on epsilon. A lower bound above the reported
epsilon proves the reported epsilon wrong (up to the stated confidence); a
lower bound below it proves nothing about tightness.

The experiment
--------------
* Neighbours follow the placement's stated adjacency
  (`adjacency`): under
  add/remove the canary is absent from world 0 and present in world 1; under
  zero-out it is present in both and sends ``g = 0`` in world 0 and
  ``g = C e_1`` in world 1 (its noise in both).
* The canary's update is the worst case, norm ``C`` in a fixed direction
  ``e_1``; the other ``n - 1`` clients send ``g = 0`` (the adversary knows
  them, so this loses no generality for the distinguisher).
* Every round every client (the canary too) is Poisson-sampled with
  ``q = r / n`` (`dpfedavg.core.server.poisson_sample()`), every sampled
  client's noisy update enters the sum (no dropouts), each adds
  ``N(0, client_std^2 I)`` and the server adds ``N(0, server_std^2 I)``, the
  stds coming from the placement object (`released_sums_batch()`). The
  adversary sees the ``K`` released sums (``d``-dimensional).

The statistic
-------------
The log-likelihood ratio of world 1 against world 0 summed over rounds, which
sees the variance of the release as well as its mean. Per round, with ``t =
<y, e_1>``, ``s = ||y||^2`` and the sum's variance ``a0`` (world 0) and ``a1``
(world 1, canary sampled)::

    L1(y) = -d/2 log(a1/a0) - (s - 2 C t + C^2) / (2 a1) + s / (2 a0)
    LLR(y) = log((1 - q) + q exp(L1(y)))

which is the exact per-round LLR for ``q = 1`` (``N(0, a0 I)`` against
``N(C e_1, a1 I)``) and, for ``q < 1``, the exact LLR of the round's mixture
whenever the sum's variance does not depend on who was sampled (every
placement with the server's top-up). By Neyman-Pearson it is the most powerful
test of the product laws in those cases; the variances come from the
placement at full participation (``q = 1`` counts), which is exact in all
the cases the auditor accepts.

The bound
---------
A test that says "world 1" with false-positive rate ``FPR`` and
false-negative rate ``FNR`` must satisfy, under ``(eps, delta)``-DP,
``FPR + e^eps FNR >= 1 - delta`` and ``FNR + e^eps FPR >= 1 - delta``
(Kairouz, Oh, Viswanath 2015; as used by Jagielski et al. 2020 and Nasr et
al. 2021), so ``eps >= log((1 - delta - FNR) / FPR)`` and the same with the
roles swapped. With finite trials we substitute Clopper-Pearson upper bounds
for both rates, each at confidence ``1 - alpha/2`` so that both hold together
with confidence ``1 - alpha`` (union bound), and report the larger of the two
resulting bounds (both are implied by DP, so the maximum needs no further
correction). The threshold and the direction are chosen on the first half of
each world's trials and the bound is evaluated once, on the second half: the
chosen test is independent of the evaluation data, so no correction for the
search over thresholds is needed (Jagielski et al. 2020, §4). Steinke, Nasr
and Jagielski (2023) audit with one training run and many canaries; this
auditor runs the (cheap) release itself many times with one canary.

What it does not do: one canary and one statistic give a lower bound, not a
proof of privacy; the bound is limited by the number of trials (about
``log(trials / 2)`` at most with no errors); and only the release of the sums
is audited, not the engines' bookkeeping around it.

References
----------
M. Jagielski, J. Ullman, A. Oprea. Auditing differentially private machine learning: how private is
private SGD? NeurIPS 2020.
M. Nasr, S. Song, A. Thakurta, N. Papernot, N. Carlini. Adversary instantiation: lower bounds for
differentially private machine learning. IEEE S&P 2021.
T. Steinke, M. Nasr, M. Jagielski. Privacy auditing with one (1) training run. NeurIPS 2023.
B. Balle, Y.-X. Wang. Improving the Gaussian mechanism for differential privacy: analytical
calibration and optimal denoising. ICML 2018.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy import optimize, special, stats

from dpfedavg.core.mechanism import Neighbouring, NoisePlacement, get_placement
from dpfedavg.core.server import poisson_sample
from dpfedavg.privacy.accountants import PldAccountant, accountant_class
from dpfedavg.privacy.calibration import epsilon_for

__all__ = [
    "AuditOutcome",
    "AuditSetting",
    "AuditResult",
    "ThresholdTest",
    "released_sums_batch",
    "llr_statistic",
    "clopper_pearson_upper",
    "epsilon_lower_bound",
    "roc_curve",
    "run_audit",
    "reported_epsilon",
    "delta_of_gaussian_pair",
    "exact_epsilon_gaussian_pair",
    "exact_epsilon_variance_leak",
    "plot_roc",
]

logger = logging.getLogger(__name__)

#: Numbers drawn per chunk of trials (``chunk * K * max(d, n)``): bounds the memory of `released_sums_batch()`.
_CHUNK_FLOATS = 1 << 22


@dataclass(frozen=True)
class AuditSetting:
    """One audited configuration.

    Attributes
    ----------
    placement:
        The `NoisePlacement` audited, or the name of one in
        `dpfedavg.core.mechanism.PLACEMENTS` (the tests also audit a deliberately mis-accounted one).
    num_clients:
        ``n``: the larger federation's size, canary included (under add/remove the other has ``n - 1``).
    clients_per_round:
        ``r``; every client is sampled with ``q = r / n`` each round.
    dim, rounds:
        ``d`` and ``K``.
    noise_multiplier, clip, delta:
        ``z``, ``C`` and the ``delta`` at which epsilon is bounded and reported.
    accountant:
        A name in `dpfedavg.privacy.accountants.ACCOUNTANTS`: the accountant behind the reported epsilon.
    """

    placement: NoisePlacement
    num_clients: int
    clients_per_round: float
    dim: int
    rounds: int
    noise_multiplier: float
    clip: float
    delta: float
    accountant: str = PldAccountant.name

    def __post_init__(self) -> None:
        if isinstance(self.placement, str):
            object.__setattr__(self, "placement", get_placement(self.placement))
        if self.num_clients < 2:
            raise ValueError(f"num_clients must be >= 2 (the canary and at least one other), got {self.num_clients}")
        if not 0 < self.clients_per_round <= self.num_clients:
            raise ValueError(f"clients_per_round must be in (0, num_clients], got {self.clients_per_round}")
        if self.dim < 1 or self.rounds < 1:
            raise ValueError(f"dim and rounds must be >= 1, got {self.dim} and {self.rounds}")
        if not self.noise_multiplier > 0 or not self.clip > 0:
            raise ValueError(f"noise_multiplier and clip must be > 0, got {self.noise_multiplier}, {self.clip}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        accountant_class(self.accountant)  # an unknown method: its one error
        participation = self.placement.participation_error(self.num_clients, self.clients_per_round)
        if participation:
            raise ValueError(f"placement {self.placement.name!r} {participation}")

    @property
    def q(self) -> float:
        """The sampling rate ``r / n``."""
        return self.clients_per_round / self.num_clients

    @property
    def adjacency(self) -> Neighbouring:
        """The placement's neighbouring relation."""
        return self.placement.adjacency

    def sum_variance(self, num_sampled: int) -> float:
        """Per-coordinate variance of the released sum when ``num_sampled`` clients were sampled (all included).

        Built only from the placement's `client_std()` and `server_std()`.
        """
        p, z, c, r = self.placement, self.noise_multiplier, self.clip, self.clients_per_round
        client = p.client_std(z, c, r, num_sampled)
        server = p.server_std(z, c, r, num_sampled, num_sampled)
        return num_sampled * client**2 + server**2

    def model_variances(self) -> tuple[float, float]:
        """``(a0, a1)``: the sum's variance in world 0 and in world 1 with the canary sampled, at ``q = 1`` counts."""
        n = self.num_clients
        a1 = self.sum_variance(n)
        a0 = self.sum_variance(n - 1) if self.adjacency is Neighbouring.ADD_REMOVE else a1
        if math.isclose(a0, a1, rel_tol=1e-9):  # the top-up's (zC)^2, up to rounding
            a0 = a1
        return a0, a1


def released_sums_batch(
    setting: AuditSetting, world: int, trials: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Run the round's release ``trials x K`` times in one world; return ``<y, e_1>`` and ``||y||^2``.

    A vectorized version of `dpfedavg.core.mechanism.released_sum()` with every sampled client
    included and the other clients' ``g = 0``: the sum of independent Gaussians ``N(0, client_std^2 I)``
    (one per sampled client) and ``N(0, server_std^2 I)`` is drawn as one Gaussian with the summed
    variance (`AuditSetting.sum_variance()`), plus the canary's ``C e_1`` when it is sampled and
    sends it. Sampling is `poisson_sample()` over all ``trials * K * n``
    (trial, round, client) cells at once, which is the same independent ``Bernoulli(q)`` per cell.
    Client 0 is the canary; in world 0 under add/remove it is not in the federation.

    Parameters
    ----------
    world:
        0 (canary absent, or sending ``g = 0`` under zero-out) or 1 (canary sending ``C e_1``).

    Returns
    -------
    ``(t, s)``, both ``(trials, K)``: the released sums' first coordinate and squared norm.
    """
    if world not in (0, 1):
        raise ValueError(f"world must be 0 or 1, got {world!r}")
    n, k, d = setting.num_clients, setting.rounds, setting.dim
    picked = poisson_sample(trials * k * n, setting.q, rng)
    cell = picked // n
    counts = np.bincount(cell, minlength=trials * k)
    canary = np.zeros(trials * k, dtype=bool)
    canary[cell[picked % n == 0]] = True
    if world == 0 and setting.adjacency is Neighbouring.ADD_REMOVE:
        counts = counts - canary  # the canary is not in world 0's federation
    sends = canary if world == 1 else np.zeros_like(canary)
    values, inverse = np.unique(counts, return_inverse=True)
    var = np.array([setting.sum_variance(int(m)) for m in values])[inverse.ravel()]
    std = np.sqrt(var).reshape(trials, k)
    y = rng.standard_normal((trials, k, d))
    y *= std[:, :, None]
    y[:, :, 0] += setting.clip * sends.reshape(trials, k)
    return y[:, :, 0].copy(), np.einsum("tkd,tkd->tk", y, y)


def llr_statistic(setting: AuditSetting, t: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The log-likelihood ratio of world 1 against world 0, summed over rounds (see the module docstring).

    Parameters
    ----------
    t, s:
        ``(trials, K)``: ``<y, e_1>`` and ``||y||^2`` of each released sum.
    """
    a0, a1 = setting.model_variances()
    c, d, q = setting.clip, setting.dim, setting.q
    l1 = -0.5 * d * math.log(a1 / a0) - (s - 2.0 * c * t + c * c) / (2.0 * a1) + s / (2.0 * a0)
    per_round = l1 if q >= 1.0 else np.logaddexp(math.log1p(-q), math.log(q) + l1)
    return per_round.sum(axis=1)


def clopper_pearson_upper(successes: np.ndarray | int, trials: int, confidence: float) -> np.ndarray:
    """One-sided Clopper-Pearson upper bound on a binomial rate at ``confidence`` (1 when all succeed)."""
    k = np.asarray(successes, dtype=np.float64)
    upper = stats.beta.ppf(confidence, k + 1.0, np.maximum(trials - k, 1e-300))
    return np.where(k >= trials, 1.0, upper)


def _bounds(fp_up: np.ndarray, fn_up: np.ndarray, delta: float) -> np.ndarray:
    """``max(log((1-delta-FNR)/FPR), log((1-delta-FPR)/FNR))``, ``-inf`` where no numerator is positive."""
    with np.errstate(divide="ignore", invalid="ignore"):
        one = np.where(
            1.0 - delta - fn_up > 0, np.log(np.maximum(1.0 - delta - fn_up, 1e-300)) - np.log(fp_up), -np.inf
        )
        two = np.where(
            1.0 - delta - fp_up > 0, np.log(np.maximum(1.0 - delta - fp_up, 1e-300)) - np.log(fn_up), -np.inf
        )
    return np.maximum(one, two)


@dataclass(frozen=True)
class ThresholdTest:
    """The chosen test and its evaluation: "world 1" iff ``statistic > threshold`` (``sign = 1``) or
    ``statistic < threshold`` (``sign = -1``).

    ``fpr``/``fnr`` are the empirical rates on the evaluation half, ``*_upper`` their Clopper-Pearson upper
    bounds at ``1 - alpha/2`` each, and ``epsilon_lower_bound`` the bound (>= 0) they give.
    """

    sign: int
    threshold: float
    fpr: float
    fnr: float
    fpr_upper: float
    fnr_upper: float
    epsilon_lower_bound: float
    evaluation_trials: int


def _rates(stat0: np.ndarray, stat1: np.ndarray, thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Counts of ``stat0 > threshold`` (false positives) and ``stat1 <= threshold`` (false negatives)."""
    s0, s1 = np.sort(stat0), np.sort(stat1)
    fp = s0.size - np.searchsorted(s0, thresholds, side="right")
    fn = np.searchsorted(s1, thresholds, side="right")
    return fp, fn


def epsilon_lower_bound(
    stat0: np.ndarray, stat1: np.ndarray, delta: float, confidence: float = 0.95, max_thresholds: int = 2000
) -> ThresholdTest:
    """A lower bound on epsilon, valid with probability ``confidence``, from a statistic on both worlds.

    The first half of each world's trials chooses the direction and the threshold (the one whose bound,
    computed the same way, is largest); the second half evaluates that single test. See the module
    docstring for the bound and its validity.

    Parameters
    ----------
    stat0, stat1:
        The statistic on independent trials of world 0 and world 1 (larger means "world 1" for ``sign = 1``).
    max_thresholds:
        Candidate thresholds: at most this many quantiles of the pooled selection half.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if min(stat0.size, stat1.size) < 4:
        raise ValueError("need at least 4 trials per world")
    level = 1.0 - (1.0 - confidence) / 2.0  # each rate's bound: both hold together at `confidence`
    h0, h1 = stat0.size // 2, stat1.size // 2
    sel0, ev0, sel1, ev1 = stat0[:h0], stat0[h0:], stat1[:h1], stat1[h1:]
    best: tuple[float, int, float] = (-np.inf, 1, float(np.median(np.concatenate([sel0, sel1]))))
    for sign in (1, -1):
        pooled = np.unique(sign * np.concatenate([sel0, sel1]))
        if pooled.size > max_thresholds:
            pooled = np.unique(np.quantile(pooled, np.linspace(0.0, 1.0, max_thresholds)))
        fp, fn = _rates(sign * sel0, sign * sel1, pooled)
        eps = _bounds(clopper_pearson_upper(fp, h0, level), clopper_pearson_upper(fn, h1, level), delta)
        i = int(np.argmax(eps))
        if eps[i] > best[0]:
            best = (float(eps[i]), sign, float(pooled[i]))
    _, sign, threshold = best
    fp, fn = _rates(sign * ev0, sign * ev1, np.array([threshold]))
    n0, n1 = ev0.size, ev1.size
    fp_up = clopper_pearson_upper(fp, n0, level)
    fn_up = clopper_pearson_upper(fn, n1, level)
    eps_lb = float(_bounds(fp_up, fn_up, delta)[0])
    return ThresholdTest(
        sign=sign,
        threshold=sign * threshold,  # back on the statistic's scale
        fpr=float(fp[0]) / n0,
        fnr=float(fn[0]) / n1,
        fpr_upper=float(fp_up[0]),
        fnr_upper=float(fn_up[0]),
        epsilon_lower_bound=max(eps_lb, 0.0),
        evaluation_trials=min(n0, n1),
    )


def roc_curve(stat0: np.ndarray, stat1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Empirical ROC of "world 1 iff statistic > threshold" over all thresholds: ``(fpr, tpr)``, increasing."""
    thresholds = np.unique(np.concatenate([stat0, stat1]))[::-1]
    fp, fn = _rates(stat0, stat1, thresholds)
    fpr = np.concatenate([[0.0], fp / stat0.size])
    tpr = np.concatenate([[0.0], 1.0 - fn / stat1.size])
    return fpr, tpr


def reported_epsilon(setting: AuditSetting) -> float:
    """What the project's accountant reports for the setting: the placement's own accounting.

    Every round is charged the placement's `accounted_noise_multiplier()` with all
    clients of the larger federation sampled and included (``z`` for every placement with the top-up).
    """
    n, r = setting.num_clients, setting.clients_per_round
    z_acc = setting.placement.accounted_noise_multiplier(setting.noise_multiplier, r, n, n)
    if z_acc is None:  # pragma: no cover - a round that releases nothing about anyone
        return 0.0
    return float(epsilon_for(z_acc, setting.q, setting.rounds, setting.delta, setting.accountant))


@dataclass
class AuditOutcome:
    """What every audit reports: its threshold test and the epsilons it stands against (`run_audit()`,
    `dpfedavg.privacy.audit_banded.run_banded_audit()`)."""

    trials: int
    seed: int
    confidence: float
    test: ThresholdTest
    epsilon_reported: float
    epsilon_exact: float | None
    seconds: float

    @property
    def epsilon_lower_bound(self) -> float:
        """The empirical lower bound."""
        return self.test.epsilon_lower_bound


@dataclass
class AuditResult(AuditOutcome):
    """The outcome of `run_audit()` (`as_dict()` is the CLI's ``--json`` object)."""

    setting: AuditSetting
    roc_fpr: np.ndarray = field(repr=False)
    roc_tpr: np.ndarray = field(repr=False)

    def as_dict(self) -> dict[str, Any]:
        """Flat JSON-ready summary."""
        s = self.setting
        return {
            "epsilon_lower_bound": self.test.epsilon_lower_bound,
            "epsilon_reported": self.epsilon_reported,
            "epsilon_exact": self.epsilon_exact,
            "placement": s.placement.name,
            "adjacency": s.adjacency.value,
            "accountant": s.accountant,
            "trials": self.trials,
            "evaluation_trials": self.test.evaluation_trials,
            "n": s.num_clients,
            "r": s.clients_per_round,
            "q": s.q,
            "d": s.dim,
            "K": s.rounds,
            "z": s.noise_multiplier,
            "clip": s.clip,
            "delta": s.delta,
            "confidence": self.confidence,
            "seed": self.seed,
            "fpr": self.test.fpr,
            "tpr": 1.0 - self.test.fnr,
            "fpr_upper": self.test.fpr_upper,
            "fnr_upper": self.test.fnr_upper,
            "threshold": self.test.threshold,
            "direction": "llr > threshold" if self.test.sign > 0 else "llr < threshold",
            "seconds": self.seconds,
        }


def _world_statistic(
    setting: AuditSetting, world: int, trials: int, rng: np.random.Generator, bar: Any | None
) -> np.ndarray:
    chunk = max(1, _CHUNK_FLOATS // (setting.rounds * max(setting.dim, setting.num_clients)))
    out = np.empty(trials)
    for start in range(0, trials, chunk):
        size = min(chunk, trials - start)
        t, s = released_sums_batch(setting, world, size, rng)
        out[start : start + size] = llr_statistic(setting, t, s)
        if bar is not None:
            bar.update(size)
    return out


def run_audit(
    setting: AuditSetting, trials: int, *, seed: int = 0, confidence: float = 0.95, progress: bool = False
) -> AuditResult:
    """Audit ``setting`` with ``trials`` runs of ``K`` rounds in each world.

    Parameters
    ----------
    trials:
        Runs per world (half choose the test, half evaluate it).
    seed:
        Seeds the two worlds' independent generators (``SeedSequence(seed).spawn(2)``).
    progress:
        Show a tqdm progress bar over trials (on stderr).
    """
    if trials < 4:
        raise ValueError(f"need at least 4 trials, got {trials}")
    t0 = time.perf_counter()
    rngs = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2)]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=2 * trials, desc=f"audit {setting.placement.name}", unit="trial")
    try:
        stat0 = _world_statistic(setting, 0, trials, rngs[0], bar)
        stat1 = _world_statistic(setting, 1, trials, rngs[1], bar)
    finally:
        if bar is not None:
            bar.close()
    test = epsilon_lower_bound(stat0, stat1, setting.delta, confidence)
    reported = reported_epsilon(setting)
    exact = None
    if setting.q == 1.0:
        a0, a1 = setting.model_variances()
        exact = exact_epsilon_gaussian_pair(
            mean_norm=setting.clip * math.sqrt(setting.rounds),
            var0=a0,
            var1=a1,
            dim=setting.dim * setting.rounds,
            delta=setting.delta,
        )
    fpr, tpr = roc_curve(stat0, stat1)
    seconds = time.perf_counter() - t0
    logger.info(
        "audit %s: epsilon >= %.3f (confidence %g, %d trials per world), reported %.3f, %.1f s",
        setting.placement.name,
        test.epsilon_lower_bound,
        confidence,
        trials,
        reported,
        seconds,
    )
    return AuditResult(trials, seed, confidence, test, reported, exact, seconds, setting, fpr, tpr)


# ------------------------------------------------------------------ exact epsilon, independent of the accountant
def delta_of_gaussian_pair(eps: float, mean_norm: float, var0: float, var1: float, dim: int, grid: int) -> float:
    """``max(delta_{P||Q}(eps), delta_{Q||P}(eps))`` for ``P = N(0, var0 I_D)``, ``Q = N(mu, var1 I_D)``.

    ``var0 <= var1``. The privacy loss depends on ``y`` only through its projection ``t`` on ``mu`` (a 1-D
    Gaussian) and the squared norm ``R`` of the rest (``var * chi2(D - 1)``); for fixed ``t`` it is linear in
    ``R``, so the expectation over ``R`` is a chi-square cdf and a gamma cdf in closed form (the chi-square
    law tilted by ``e^{lambda R}`` is a gamma law), and the one over ``t`` is a trapezoid rule on a grid.
    """
    a, b, m, big_d = var0, var1, mean_norm, dim
    u = np.linspace(-14.0, 14.0, grid)
    w = stats.norm.pdf(u)
    out = []
    if b == a:
        for loc, var, sgn in ((0.0, a, 1.0), (m, b, -1.0)):
            t = loc + math.sqrt(var) * u
            loss = sgn * (m * m - 2.0 * m * t) / (2.0 * a)
            inner = np.where(loss > eps, -np.expm1(np.minimum(eps - loss, 0.0)), 0.0)
            out.append(np.trapezoid(inner * w, u))
        return float(max(out))
    k = big_d - 1
    kappa = 0.5 / a - 0.5 / b
    half_log = 0.5 * math.log(b / a)
    # P || Q: t ~ N(0, a), R = a X; loss = c(t) - kappa R.
    t = math.sqrt(a) * u
    c = big_d * half_log - t * t / (2 * a) + (t - m) ** 2 / (2 * b)
    x_star = np.maximum((c - eps) / kappa, 0.0) / a
    expo = eps - half_log + t * t / (2 * a) - (t - m) ** 2 / (2 * b)
    with np.errstate(divide="ignore"):
        tilt = np.exp(np.minimum(expo + np.log(special.gammainc(k / 2, x_star * a / (2 * b))), 700.0))
    inner = np.maximum(special.gammainc(k / 2, x_star / 2) - tilt, 0.0)
    out.append(np.trapezoid(inner * w, u))
    # Q || P: t ~ N(m, b), R = b X; loss = -c(t) + kappa R.
    t = m + math.sqrt(b) * u
    c = big_d * half_log - t * t / (2 * a) + (t - m) ** 2 / (2 * b)
    x_star = np.maximum((eps + c) / kappa, 0.0) / b
    expo = eps + half_log - t * t / (2 * a) + (t - m) ** 2 / (2 * b)
    with np.errstate(divide="ignore"):
        tilt = np.exp(np.minimum(expo + np.log(special.gammaincc(k / 2, x_star * b / (2 * a))), 700.0))
    inner = np.maximum(special.gammaincc(k / 2, x_star / 2) - tilt, 0.0)
    out.append(np.trapezoid(inner * w, u))
    return float(max(out))


def exact_epsilon_gaussian_pair(
    *, mean_norm: float, var0: float, var1: float, dim: int, delta: float, grid: int = 20001
) -> float:
    """The exact epsilon at ``delta`` of the pair ``N(0, var0 I_dim)`` vs ``N(mu, var1 I_dim)``, ``||mu|| = mean_norm``.

    Computed by numerical integration of ``delta(eps) = E_P[(1 - e^{eps - L})_+]`` in both directions
    (``L`` the privacy loss), without the project's accountant; with ``var0 == var1`` it is the Gaussian
    mechanism's exact epsilon (Balle and Wang 2018). The pair is symmetric in ``(var0, var1)`` (shift by
    ``mu`` and reflect), so their order does not matter.
    """
    if not (var0 > 0 and var1 > 0 and dim >= 1 and 0 < delta < 1 and mean_norm >= 0):
        raise ValueError("need var0, var1 > 0, dim >= 1, 0 < delta < 1, mean_norm >= 0")
    a, b = min(var0, var1), max(var0, var1)
    if math.isclose(a, b, rel_tol=1e-12):
        a = b

    def excess(eps: float) -> float:
        return delta_of_gaussian_pair(eps, mean_norm, a, b, dim, grid) - delta

    if excess(0.0) <= 0:
        return 0.0
    hi = 1.0
    while excess(hi) > 0:
        hi *= 2.0
        if hi > 1e4:
            return math.inf
    return float(optimize.brentq(excess, 0.0, hi, xtol=1e-6, rtol=1e-8))


def exact_epsilon_variance_leak(
    *,
    noise_multiplier: float,
    clip: float,
    clients_per_round: float,
    num_others: int,
    dim: int,
    rounds: int,
    delta: float,
) -> float:
    """Exact epsilon of ``K`` rounds at ``q = 1`` under add/remove when each client adds ``(zC)^2/r``, no top-up.

    The variance of the sum then tells whether the canary took part (the leak the server's top-up closes).

    ``num_others`` clients each add ``N(0, (zC)^2/r I_d)`` and send known updates; the canary adds the same
    noise and ``C e_1``. Over ``K`` rounds the two neighbours are ``N(0, m s^2 I_D)`` and
    ``N(mu, (m + 1) s^2 I_D)`` with ``s^2 = (zC)^2 / r``, ``D = K d`` and ``||mu||^2 = K C^2``.
    """
    s2 = (noise_multiplier * clip) ** 2 / clients_per_round
    return exact_epsilon_gaussian_pair(
        mean_norm=clip * math.sqrt(rounds),
        var0=num_others * s2,
        var1=(num_others + 1) * s2,
        dim=dim * rounds,
        delta=delta,
    )


def plot_roc(result: AuditResult, path: str | Path) -> Path:
    """Write the audit's ROC (log-scale FPR) with the ``(eps, delta)``-DP limits of the reported and found eps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dpfedavg.io.log_axis import plain_log_labels

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    s, delta = result.setting, result.setting.delta
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    keep = result.roc_fpr > 0
    ax.plot(result.roc_fpr[keep], result.roc_tpr[keep], label="LLR test (all trials)")
    grid = np.logspace(math.log10(max(1.0 / (2 * result.trials), 1e-6)), 0, 200)
    for eps, style, label in (
        (result.epsilon_reported, "--", f"DP limit, reported eps = {result.epsilon_reported:.2f}"),
        (result.epsilon_lower_bound, ":", f"DP limit, eps lower bound = {result.epsilon_lower_bound:.2f}"),
    ):
        limit = np.minimum(1.0, np.minimum(math.exp(eps) * grid + delta, 1.0 - math.exp(-eps) * (1.0 - delta - grid)))
        ax.plot(grid, limit, style, label=label)
    ax.set_xscale("log")
    plain_log_labels(ax, "x")
    ax.set_xlabel("false-positive rate")
    ax.set_ylabel("true-positive rate")
    ax.set_title(
        f"{s.placement.name}: n={s.num_clients}, r={s.clients_per_round:g}, d={s.dim}, K={s.rounds}, "
        f"z={s.noise_multiplier:.3g}"
    )
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
