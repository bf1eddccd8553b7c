"""Private selection of hyperparameters (Papernot & Steinke 2022): the number of trials and its accounting.

Papernot & Steinke 2022 ("Hyperparameter tuning with Renyi differential privacy", ICLR 2022) make
releasing the best of several trials cheap: run a *random* number ``T`` of trials and release only the
best one. If one trial is ``(lambda, eps(lambda))``-RDP for every order ``lambda``, the whole procedure is

* ``T`` truncated negative binomial (shape ``eta >= 0``, ``gamma`` in (0, 1); ``eta = 1`` geometric,
  ``eta = 0`` logarithmic), their Theorem 2::

      eps'(lambda) = eps(lambda) + (1 + eta)(1 - 1/lambda^) eps(lambda^)
                     + (1 + eta) log(1/gamma) / lambda^ + log(E[T]) / (lambda - 1)

  for any ``lambda^ >= 1``;
* ``T ~ Poisson(mu)``, their Theorem 6: ``eps'(lambda) = eps(lambda) + mu delta^ + log(mu) / (lambda - 1)``
  with the trial ``(eps^, delta^)``-DP at ``eps^ = log(1 + 1/(lambda - 1))``.

`TrialCount` is the law of ``T``; `SelectionAccountant` composes one trial's rounds and
reports the epsilon of the whole procedure through dp-accounting's ``RepeatAndSelectDpEvent(event, mean,
shape)`` (``shape = inf`` is Poisson), in its RDP accountant only (its PLD accountant rejects the event).
The experiment that runs the trials is `dpfedavg.experiments.private_tuning`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar

import numpy as np

from dpfedavg.errors import ConfigError
from dpfedavg.privacy.accountants import AccountantBase, RdpAccountant, RoundEvent, rdp_epsilon
from dpfedavg.privacy.calibration import smallest_noise_multiplier

__all__ = [
    "DEFAULT_DISTRIBUTION",
    "DEFAULT_MEAN",
    "DEFAULT_SHAPE",
    "TRIAL_DISTRIBUTIONS",
    "SelectionAccountant",
    "TrialCount",
    "calibrate_tuning_noise",
    "trial_epsilon",
    "tuning_epsilon",
]

#: The trial-count distributions (Papernot & Steinke 2022, §3).
TRIAL_DISTRIBUTIONS = ("negative-binomial", "poisson")
#: Defaults of ``run_sim.py table1 --private-tuning``.
DEFAULT_DISTRIBUTION = "negative-binomial"
DEFAULT_MEAN = 10.0
DEFAULT_SHAPE = 1.0  # geometric


@dataclass(frozen=True)
class TrialCount:
    """The distribution of the number of trials ``T`` (Papernot & Steinke 2022, §3).

    ``negative-binomial``: the truncated negative binomial ``D_{eta, gamma}``,
    ``P[T = k] = (1 - gamma)^k / (gamma^-eta - 1) prod_{l<k} (l + eta)/(l + 1)``
    for ``k >= 1`` (``eta = shape > 0``; ``eta = 0`` is the logarithmic
    distribution ``P[T = k] = (1 - gamma)^k / (k log(1/gamma))``), ``gamma``
    set by the ``mean``. ``poisson``: ``T ~ Poisson(mean)`` (``shape`` unused).
    """

    distribution: str = DEFAULT_DISTRIBUTION
    mean: float = DEFAULT_MEAN
    shape: float = DEFAULT_SHAPE

    def __post_init__(self) -> None:
        errors = []
        if self.distribution not in TRIAL_DISTRIBUTIONS:
            errors.append(
                f"'trials-distribution' = {self.distribution!r}: expected one of {', '.join(TRIAL_DISTRIBUTIONS)}"
            )
        elif self.distribution == "negative-binomial":
            if not (math.isfinite(self.mean) and self.mean > 1):
                errors.append(
                    f"'trials-mean' = {self.mean!r}: expected a number > 1 for the truncated negative binomial "
                    "(T >= 1 always; mean 1 is a single run)"
                )
            if not (math.isfinite(self.shape) and self.shape >= 0):
                errors.append(
                    f"'trials-shape' = {self.shape!r}: expected a finite number >= 0 "
                    "(0 = logarithmic, 1 = geometric; for shape -> infinity use --trials-distribution poisson)"
                )
        elif not (math.isfinite(self.mean) and self.mean >= 1):
            errors.append(f"'trials-mean' = {self.mean!r}: expected a number >= 1 for the Poisson distribution")
        if errors:
            raise ConfigError("invalid private tuning: " + "; ".join(errors))

    @property
    def accounting_shape(self) -> float:
        """The ``shape`` of dp-accounting's ``RepeatAndSelectDpEvent`` (``inf`` = Poisson)."""
        return math.inf if self.distribution == "poisson" else float(self.shape)

    @property
    def gamma(self) -> float:
        """``gamma`` of the truncated negative binomial with this mean (bisection; its mean <= ``mean``).

        Rounding ``gamma`` up makes the sampled ``T`` no larger on average than
        the accounted one and ``log(1/gamma)`` no larger than the accounted
        one, so the accounted bound (Theorem 2) holds for what is sampled.
        """
        if self.distribution != "negative-binomial":
            raise ValueError("gamma is a parameter of the truncated negative binomial only")
        return _tnb_gamma(float(self.shape), float(self.mean))

    def pmf(self, k: int) -> float:
        """``P[T = k]``."""
        if k < 0:
            return 0.0
        if self.distribution == "poisson":
            return math.exp(-self.mean + k * math.log(self.mean) - math.lgamma(k + 1))
        if k == 0:
            return 0.0
        gamma, eta = self.gamma, float(self.shape)
        if eta == 0:
            return math.exp(k * math.log1p(-gamma)) / (k * math.log(1.0 / gamma))
        log_binom = math.lgamma(k + eta) - math.lgamma(eta) - math.lgamma(k + 1)
        return math.exp(log_binom + k * math.log1p(-gamma)) / math.expm1(-eta * math.log(gamma))

    def sample(self, rng: np.random.Generator) -> int:
        """One draw of ``T``: Poisson, or a negative binomial conditioned on ``T >= 1`` (rejection)."""
        if self.distribution == "poisson":
            return int(rng.poisson(self.mean))
        gamma, eta = self.gamma, float(self.shape)
        if eta == 0:
            return int(rng.logseries(1.0 - gamma))
        while True:  # NB(eta, gamma) = failures before eta successes; P[0] = gamma^eta
            t = int(rng.negative_binomial(eta, gamma))
            if t >= 1:
                return t

    @property
    def slug(self) -> str:
        """A folder name for this distribution: ``negative-binomial-mean10-shape1``, ``poisson-mean10``."""
        if self.distribution == "poisson":
            return f"poisson-mean{self.mean:g}"
        return f"negative-binomial-mean{self.mean:g}-shape{self.shape:g}"

    def describe(self) -> str:
        if self.distribution == "poisson":
            return f"T ~ Poisson(mean {self.mean:g})"
        kind = {0.0: "logarithmic", 1.0: "geometric"}.get(float(self.shape), "")
        return (
            f"T ~ truncated negative binomial (shape {self.shape:g}{', ' + kind if kind else ''}; "
            f"mean {self.mean:g}, gamma = {self.gamma:.4g})"
        )


def _tnb_mean(gamma: float, eta: float) -> float:
    """``E[T]`` of the truncated negative binomial: ``eta (1 - gamma) / (gamma (1 - gamma^eta))``."""
    if eta == 0:
        return (1.0 - gamma) / (gamma * math.log(1.0 / gamma))
    return eta * (1.0 - gamma) / (gamma * -math.expm1(eta * math.log(gamma)))


@lru_cache(maxsize=64)
def _tnb_gamma(eta: float, mean: float) -> float:
    if eta == 1.0:
        return 1.0 / mean  # geometric
    lo, hi = 0.0, 1.0  # the mean decreases from inf (gamma -> 0) to 1 (gamma -> 1)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if _tnb_mean(mid, eta) > mean:
            lo = mid
        else:
            hi = mid
    return hi  # mean(hi) <= mean


# ------------------------------------------------------------------ accounting
class SelectionAccountant(AccountantBase):
    """Epsilon of running ``T`` trials (`TrialCount`) and releasing the best one.

    `step()` composes the rounds of *one* trial (as a run's accountant does); `epsilon` is the
    RDP epsilon of dp-accounting's ``RepeatAndSelectDpEvent`` over that trial, i.e. of the whole tuning
    procedure whose trials each run those rounds.
    """

    name: ClassVar[str] = "repeat-and-select"

    def __init__(self, delta: float, count: TrialCount) -> None:
        self.count = count
        super().__init__(delta)

    def _reset(self) -> None:
        pass

    def _compose(self, event: RoundEvent, count: int) -> None:
        pass  # the history is the state: the trial's event is rebuilt from it

    def _trial_event(self, history: list[RoundEvent]) -> Any:
        from dp_accounting import dp_event

        runs: list[tuple[RoundEvent, int]] = []
        for event in history:
            if runs and runs[-1][0] == event:
                runs[-1] = (event, runs[-1][1] + 1)
            else:
                runs.append((event, 1))
        parts = [dp_event.SelfComposedDpEvent(e.dp_event(), n) for e, n in runs]
        return parts[0] if len(parts) == 1 else dp_event.ComposedDpEvent(parts)

    def _epsilon_of(self, history: list[RoundEvent]) -> float:
        from dp_accounting import dp_event
        from dp_accounting.rdp import rdp_privacy_accountant

        if not history:
            return 0.0
        accountant = rdp_privacy_accountant.RdpAccountant()
        event = self._trial_event(history)
        accountant.compose(dp_event.RepeatAndSelectDpEvent(event, self.count.mean, self.count.accounting_shape))
        return rdp_epsilon(accountant.rdp, self.delta)

    def _epsilon_now(self) -> float:
        return self._epsilon_of(self.history)

    def _epsilon_with(self, event: RoundEvent, count: int) -> float:
        return self._epsilon_of([*self.history, *([event] * count)])

    def state_dict(self) -> dict[str, Any]:
        count = {"distribution": self.count.distribution, "mean": self.count.mean, "shape": self.count.shape}
        return {**super().state_dict(), "count": count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        count = TrialCount(**state["count"])
        if count != self.count:
            raise ValueError(f"the state is for {count.describe()}, this accountant's is {self.count.describe()}")
        super().load_state_dict(state)


@lru_cache(maxsize=256)
def tuning_epsilon(z: float, q: float, rounds: int, delta: float, count: TrialCount) -> float:
    """End-to-end epsilon of releasing the best of ``T`` trials of ``rounds`` rounds with noise multiplier ``z``."""
    accountant = SelectionAccountant(delta, count)
    accountant.step(RoundEvent(q, z), rounds)
    return accountant.epsilon


@lru_cache(maxsize=256)
def trial_epsilon(z: float, q: float, rounds: int, delta: float) -> float:
    """Epsilon of one trial alone, with the same (RDP) accountant."""
    accountant = RdpAccountant(delta)
    accountant.step(RoundEvent(q, z), rounds)
    return accountant.epsilon


@lru_cache(maxsize=64)
def calibrate_tuning_noise(
    epsilon: float, delta: float, q: float, rounds: int, count: TrialCount, rel_tol: float = 1e-3
) -> float:
    """The smallest ``z`` (to ``rel_tol`` relative) whose tuning procedure is ``(epsilon, delta)``-DP end to end.

    Bisection on `tuning_epsilon()` (`smallest_noise_multiplier()`):
    the returned ``z`` satisfies the target.
    """
    if not epsilon > 0:
        raise ConfigError(f"invalid private tuning: 'epsilon' = {epsilon!r}: expected a number > 0")
    try:
        return smallest_noise_multiplier(
            lambda z: tuning_epsilon(z, q, rounds, delta, count), epsilon, rel_tol, f" (delta = {delta:g})"
        )
    except ValueError as err:
        raise ConfigError(f"invalid private tuning: {err} for {count.describe()}") from None
