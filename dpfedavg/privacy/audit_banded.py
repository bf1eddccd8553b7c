"""The empirical auditor for banded-MF noise: a canary in a min-separated pattern, a lower bound on epsilon.

The same experiment as `dpfedavg.privacy.audit` (Jagielski, Ullman, Oprea 2020; Nasr et al. 2021), for
the correlated release of `dpfedavg.privacy.banded_mf_mechanism`: a run of ``K`` rounds releases
``y_k = x_k + (C^{-1} Z)_k``, ``x_k`` the round's sum of bounded updates, the rows of ``Z`` i.i.d.
``N(0, sigma^2 I_d)``, the noise drawn by the project's own stream
(`BandedNoiseStream`, all trials at once as one long vector: the stream is
linear, coordinate by coordinate).

* World 0: the canary is absent (add/remove); the other clients send ``g = 0`` (known to the adversary).
* World 1: the canary takes part in the rounds ``canary_rounds`` (at least ``b`` apart: the rule's worst
  pattern is ``0, b, 2b, ...``) and sends ``C_clip e_1`` each time.

The adversary sees the ``K`` released rows. Multiplying by ``C`` (post-processing) gives ``C y = C x + Z``, so
the exact log-likelihood ratio is ``<(C y)_{:,1}, m> / sigma^2 - ||m||^2 / (2 sigma^2)`` with
``m = C x^{(1)}_{:,1}`` the canary's shift, computed here with a dense ``C`` (not the stream's recurrence). By
Neyman-Pearson it is the most powerful test; the rest of the auditor (threshold chosen on half of the trials,
Clopper-Pearson bounds on the other half) is `dpfedavg.privacy.audit.epsilon_lower_bound()`'s.

The reported epsilon is the accountant's (`banded_mf_epsilon()`, the
closed-form min-separation sensitivity); ``epsilon_exact`` is the Gaussian DP epsilon of this canary's shift
``||m|| / sigma``, computed independently. A canary whose participations are closer than ``b`` rounds breaks the
closed form's assumption (its columns of ``C`` overlap): `BandedAuditSetting` refuses such a pattern, and
the tests audit one on purpose to show that the auditor catches the under-estimated sensitivity.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpfedavg.core.banded_mf import BandedNoiseStream, check_coefficients
from dpfedavg.core.participation import ParticipationRule, check_schedule
from dpfedavg.privacy.audit import ThresholdTest, epsilon_lower_bound
from dpfedavg.privacy.banded_mf_accounting import BandedMFParams, banded_mf_epsilon
from dpfedavg.privacy.canary import gdp_epsilon

__all__ = ["BandedAuditResult", "BandedAuditSetting", "run_banded_audit"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BandedAuditSetting:
    """One audited banded-MF configuration.

    Attributes
    ----------
    coefficients:
        ``c_0 .. c_{b-1}`` of the strategy.
    rounds:
        ``K``.
    canary_rounds:
        The rounds (0-based) the canary takes part in; ``None``: the worst allowed pattern ``0, b, 2b, ...``.
    noise_multiplier:
        ``z = sigma / C_clip``.
    clip:
        ``C_clip``.
    delta:
        The ``delta`` of the bound and of the reported epsilon.
    dim:
        ``d`` (only the canary's coordinate carries signal; more coordinates only cost time).
    accountant:
        ``pld`` or ``rdp``: the back-end of the reported epsilon.
    """

    coefficients: tuple[float, ...]
    rounds: int
    noise_multiplier: float
    clip: float = 1.0
    delta: float = 1e-6
    canary_rounds: tuple[int, ...] | None = None
    dim: int = 1
    accountant: str = "pld"

    def __post_init__(self) -> None:
        object.__setattr__(self, "coefficients", check_coefficients(self.coefficients, self.rounds))
        if self.canary_rounds is None:
            object.__setattr__(self, "canary_rounds", tuple(range(0, self.rounds, self.bands)))
        rounds = tuple(int(k) for k in self.canary_rounds)  # type: ignore[union-attr]
        if not rounds or any(not 0 <= k < self.rounds for k in rounds) or list(rounds) != sorted(set(rounds)):
            raise ValueError(f"canary rounds {rounds}: expected distinct increasing rounds in [0, {self.rounds})")
        object.__setattr__(self, "canary_rounds", rounds)
        if not (self.noise_multiplier > 0 and self.clip > 0 and 0 < self.delta < 1 and self.dim >= 1):
            raise ValueError("need noise_multiplier > 0, clip > 0, 0 < delta < 1 and dim >= 1")
        self._check_pattern()

    def _check_pattern(self) -> None:
        """The canary keeps the rule the reported epsilon assumes (participations >= b rounds apart)."""
        check_schedule([[0] if k in self.canary_rounds else [] for k in range(self.rounds)], self.bands)

    @property
    def bands(self) -> int:
        return len(self.coefficients)

    @property
    def sigma(self) -> float:
        return self.noise_multiplier * self.clip

    def params(self) -> BandedMFParams:
        """The accountant's view: the min-separation rule with ``b`` bands over ``K`` rounds."""
        rule = ParticipationRule("min-separation", 2, self.bands, self.rounds)
        return BandedMFParams.from_rule(
            rule, self.coefficients, clip=self.clip, noise_std=self.sigma, delta=self.delta, accountant=self.accountant
        )

    def reported_epsilon(self) -> float:
        """What the project reports for this run (`banded_mf_epsilon()`)."""
        return banded_mf_epsilon(self.params())

    def canary_shift(self) -> np.ndarray:
        """``m = C x^{(1)}``'s canary coordinate: the mean of ``(C y)_{:,1}`` in world 1 (dense ``C``)."""
        c = np.zeros((self.rounds, self.rounds))
        for j, value in enumerate(self.coefficients):
            c += value * np.eye(self.rounds, k=-j)
        x = np.zeros(self.rounds)
        x[list(self.canary_rounds)] = self.clip
        return c @ x


@dataclass
class BandedAuditResult:
    """The outcome of `run_banded_audit()` (`as_dict()` is ``run_sim.py audit``'s ``--json``)."""

    setting: BandedAuditSetting
    trials: int
    seed: int
    confidence: float
    test: ThresholdTest
    epsilon_reported: float
    epsilon_exact: float
    seconds: float

    @property
    def epsilon_lower_bound(self) -> float:
        return self.test.epsilon_lower_bound

    def as_dict(self) -> dict[str, Any]:
        s = self.setting
        return {
            "mechanism": "banded-mf",
            "epsilon_lower_bound": self.test.epsilon_lower_bound,
            "epsilon_reported": self.epsilon_reported,
            "epsilon_exact": self.epsilon_exact,
            "bands": s.bands,
            "strategy_coefficients": list(s.coefficients),
            "canary_rounds": list(s.canary_rounds or ()),
            "K": s.rounds,
            "z": s.noise_multiplier,
            "clip": s.clip,
            "delta": s.delta,
            "d": s.dim,
            "accountant": s.accountant,
            "trials": self.trials,
            "evaluation_trials": self.test.evaluation_trials,
            "confidence": self.confidence,
            "seed": self.seed,
            "fpr": self.test.fpr,
            "tpr": 1.0 - self.test.fnr,
            "seconds": self.seconds,
        }


def _world_statistic(setting: BandedAuditSetting, world: int, trials: int, rng: np.random.Generator) -> np.ndarray:
    """The LLR of ``trials`` runs of one world: the project's stream draws every trial's noise at once."""
    k_rounds, d = setting.rounds, setting.dim
    stream = BandedNoiseStream(setting.coefficients, trials * d, setting.sigma)
    released = np.empty((k_rounds, trials))  # the canary coordinate of every released row
    for k in range(k_rounds):
        row = stream.next(k, rng).reshape(trials, d)
        if world == 1 and k in setting.canary_rounds:
            row[:, 0] += setting.clip
        released[k] = row[:, 0]
    c = np.zeros((k_rounds, k_rounds))
    for j, value in enumerate(setting.coefficients):
        c += value * np.eye(k_rounds, k=-j)
    u = c @ released  # C y: the canary's shift plus i.i.d. N(0, sigma^2) entries
    m = setting.canary_shift()
    return (m @ u) / setting.sigma**2 - (m @ m) / (2.0 * setting.sigma**2)


def run_banded_audit(
    setting: BandedAuditSetting, trials: int, *, seed: int = 0, confidence: float = 0.95
) -> BandedAuditResult:
    """Audit ``setting`` with ``trials`` runs of ``K`` rounds in each world (seeded: ``SeedSequence(seed)``)."""
    if trials < 4:
        raise ValueError(f"need at least 4 trials, got {trials}")
    t0 = time.perf_counter()
    rngs = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2)]
    stat0 = _world_statistic(setting, 0, trials, rngs[0])
    stat1 = _world_statistic(setting, 1, trials, rngs[1])
    test = epsilon_lower_bound(stat0, stat1, setting.delta, confidence)
    reported = setting.reported_epsilon()
    exact = gdp_epsilon(float(np.linalg.norm(setting.canary_shift())) / setting.sigma, setting.delta)
    seconds = time.perf_counter() - t0
    logger.info(
        "banded audit: epsilon >= %.3f (confidence %g, %d trials per world), reported %.3f, exact %.3f, %.1f s",
        test.epsilon_lower_bound,
        confidence,
        trials,
        reported,
        exact,
        seconds,
    )
    return BandedAuditResult(setting, trials, seed, confidence, test, reported, exact, seconds)
