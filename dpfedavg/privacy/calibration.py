"""Epsilon after ``K`` rounds, and the noise multiplier for a target ``(epsilon, delta)``.

Every round carries the nominal noise (the server tops up missing shares, see
`dpfedavg.core.mechanism`), so the epsilon after ``k`` rounds is known before a run starts and
``z`` is found by bisection with the run's own accountant: a run whose rounds all carry the nominal
noise ends at or below its target.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from dpfedavg.core.dp import server_noise_std
from dpfedavg.privacy.accountants import (
    ACCOUNTANTS,
    PLD_DISCRETIZATION,
    AccountingRangeError,
    RoundEvent,
    accountant_class,
    create_accountant,
)
from dpfedavg.privacy.cache import cached

__all__ = [
    "CALIBRATION_TIME_LIMIT_S",
    "MAX_NOISE_MULTIPLIER",
    "CalibrationError",
    "calibrate_noise_multiplier",
    "epsilon_for",
    "paper_sigma",
    "privacy_report",
    "smallest_noise_multiplier",
]


def epsilon_for(noise_multiplier: float, q: float, rounds: int, delta: float, accountant: str) -> float:
    """Epsilon after ``rounds`` rounds that all carry the nominal noise ``z`` (``accountant``: its name)."""
    if rounds == 0:
        return 0.0
    acc = create_accountant(accountant, delta)
    acc.step(RoundEvent(q, noise_multiplier), rounds)
    return acc.epsilon


#: The largest noise multiplier calibration considers (the ``noise-multiplier`` key's upper end).
MAX_NOISE_MULTIPLIER = 1e6
#: Wall seconds one calibration may take before it fails with `CalibrationError` (the slowest calibration
#: in the allowed ranges took 13 s on a loaded 2-core machine: see the benchmarks page).
CALIBRATION_TIME_LIMIT_S = 300.0


class CalibrationError(ValueError):
    """No noise multiplier in ``(0, MAX_NOISE_MULTIPLIER]`` reaches the target, or the search ran out of time."""


def smallest_noise_multiplier(
    epsilon_of: Callable[[float], float],
    epsilon: float,
    rel_tol: float = 1e-3,
    what: str = "",
    *,
    time_limit: float = CALIBRATION_TIME_LIMIT_S,
) -> float:
    """The smallest ``z`` (to ``rel_tol`` relative) with ``epsilon_of(z) <= epsilon``; ``epsilon_of`` decreasing.

    Bisection on ``z``: the returned ``z`` always satisfies the target, and ``z * (1 - rel_tol)`` may not.
    It first checks `MAX_NOISE_MULTIPLIER` (one evaluation: a target no ``z`` reaches fails at once),
    then doubles from 1 and bisects: at most about 20 + 10 evaluations. A ``z`` the accountant cannot compute in
    bounded memory (`AccountingRangeError`: too little noise) counts as
    missing the target, so the result is always a ``z`` whose epsilon was computed. Raises
    `CalibrationError` (naming ``what``) when ``epsilon <= 0``, when no ``z`` up to the maximum reaches
    it, or after ``time_limit`` seconds.
    """
    if not epsilon > 0:
        raise CalibrationError(f"epsilon must be > 0, got {epsilon!r}")
    deadline = time.monotonic() + time_limit

    def misses(z: float) -> bool:
        if time.monotonic() > deadline:
            raise CalibrationError(
                f"calibrating the noise multiplier for epsilon={epsilon:g}{what} took more than {time_limit:g} s"
            )
        try:
            return epsilon_of(z) > epsilon
        except AccountingRangeError:
            return True

    if misses(MAX_NOISE_MULTIPLIER):
        raise CalibrationError(
            f"no noise multiplier up to {MAX_NOISE_MULTIPLIER:g} reaches epsilon={epsilon:g}{what}: "
            "raise epsilon or delta, or lower num-rounds or the sampling rate"
        )
    lo, hi = 0.0, 1.0
    while misses(hi):
        lo, hi = hi, min(2.0 * hi, MAX_NOISE_MULTIPLIER)
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        if misses(mid):
            lo = mid
        else:
            hi = mid
    return hi


@lru_cache(maxsize=64)
def calibrate_noise_multiplier(
    epsilon: float, delta: float, q: float, rounds: int, accountant: str, rel_tol: float = 1e-3
) -> float:
    """The smallest ``z`` (to ``rel_tol`` relative) with `epsilon_for()` ``<= epsilon``, by bisection.

    Computed once per ``(epsilon, delta, q, K, accountant)`` and dp-accounting version, across processes
    and invocations (`dpfedavg.privacy.cache`).
    """
    accountant_class(accountant)  # an unknown method: its one error, before the bisection
    return cached(
        "noise-multiplier",
        (epsilon, delta, q, rounds, accountant, rel_tol, PLD_DISCRETIZATION),
        lambda: smallest_noise_multiplier(
            lambda z: epsilon_for(z, q, rounds, delta, accountant), epsilon, rel_tol, f" (delta={delta})"
        ),
    )


def paper_sigma(
    epsilon: float, delta: float, num_clients: int, rounds: int, clip: float, constant: float = 1.0
) -> float:
    """The paper's Theorem 1 (Abadi et al.) noise level ``sigma^2 = q K C^2 log(1/delta) / (n^2 eps^2)``.

    ``constant`` is the paper's unspecified absolute constant ``q``; with 1 it gives the shape of the
    formula, to compare with an accountant's sigma.
    """
    return math.sqrt(constant * rounds * clip**2 * math.log(1.0 / delta) / (num_clients**2 * epsilon**2))


def privacy_report(params: Any, clip: float) -> dict[str, Any]:
    """Calibrate ``z`` for ``params``' target and compare both accountants and the paper's formula.

    ``params`` is a `DpParams` (not imported here: the params import the noise
    mechanisms, which calibrate with this module).

    ``sigma = z C / r`` is the std of the noise in the average ``a_k`` (`server_noise_std()`).
    """
    if params.target_epsilon is None:
        raise ValueError("privacy_report needs a target epsilon > 0")
    q, rounds = params.q, params.rounds
    z = calibrate_noise_multiplier(params.target_epsilon, params.delta, q, rounds, params.accountant)
    sigma = server_noise_std(z, clip, params.clients_per_round)
    sigma_paper = paper_sigma(params.target_epsilon, params.delta, params.num_clients, rounds, clip)
    return {
        "noise_multiplier": z,
        "sigma": sigma,
        **{f"epsilon_{name}": epsilon_for(z, q, rounds, params.delta, name) for name in ACCOUNTANTS},
        "accountant": params.accountant,
        "target_epsilon": params.target_epsilon,
        "delta": params.delta,
        "q": q,
        "rounds": rounds,
        "clip": clip,
        "clients_per_round": params.clients_per_round,
        "num_clients": params.num_clients,
        "paper_sigma_constant_1": sigma_paper,
        "paper_constant_implied": (sigma / sigma_paper) ** 2,
    }
