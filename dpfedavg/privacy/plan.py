"""A run's privacy plan: ``z`` calibrated (or given) and every budget check, before anything starts."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dpfedavg.core.adaptive_clip import auto_count_stddev, min_count_stddev
from dpfedavg.core.dp import SensitivityBound
from dpfedavg.core.mechanism import Neighbouring
from dpfedavg.errors import ConfigError
from dpfedavg.privacy.accountants import Accountant, AccountingRangeError, create_accountant
from dpfedavg.privacy.calibration import CalibrationError
from dpfedavg.privacy.noise_mechanisms import NoiseMechanism
from dpfedavg.privacy.params import DpParams

__all__ = ["PrivacyPlan", "plan_privacy"]


@dataclass(frozen=True)
class PrivacyPlan:
    """The privacy plan of a run, derived from its `DpParams` (part of its `dpfedavg.privacy.setup.PrivacySetup`).

    Attributes
    ----------
    dp:
        The run adds noise (``z > 0``).
    noise_multiplier:
        ``z`` used by the run (calibrated from ``target_epsilon`` or given).
    calibrated:
        ``z`` was calibrated from ``target_epsilon``.
    nominal_epsilon:
        Epsilon after all rounds when every round carries the nominal noise (``inf`` without DP).
    """

    dp: bool
    noise_multiplier: float
    calibrated: bool
    target_epsilon: float | None
    delta: float
    q: float
    rounds: int
    accountant: str
    max_epsilon: float | None
    nominal_epsilon: float
    neighbouring: Neighbouring
    #: ``sigma_b`` of an adaptive bound's count (``clip-count-stddev``, "auto" resolved); ``None`` otherwise.
    count_stddev: float | None = None
    #: The narrow parameters the plan was made from (its noise mechanism's name and settings).
    params: DpParams | None = None
    #: The noise mechanism the plan was calibrated for (the object ``params.mechanism`` names).
    noise_mechanism: NoiseMechanism | None = None

    def new_accountant(self) -> Accountant:
        """A fresh accountant of the run's noise mechanism, method and delta."""
        if self.params is None or self.noise_mechanism is None:  # a plan built by hand: independent rounds
            return create_accountant(self.accountant, self.delta)
        return self.noise_mechanism.new_accountant(self.params, self.noise_multiplier)


def _count_stddev_error(
    bound: SensitivityBound, sigma_b: float, z: float, calibrated: bool, target: float | None
) -> ConfigError:
    """An adaptive bound with ``sigma_b <= z/2``: Andrew et al.'s noise split (Theorem 1) has no ``z_u``."""
    how = f"calibrated for epsilon = {target:g}" if calibrated else "the noise-multiplier"
    return ConfigError(
        f"invalid run config: 'clip-count-stddev' = {sigma_b:g} with 'algorithm' = {bound.name!r} and z = {z:.5g} "
        f"({how}): "
        "the count of unclipped updates alone would spend the round's whole budget (z_u = (z^-2 - (2 sigma_b)^-2)"
        f"^(-1/2) needs sigma_b > z/2); allowed: clip-count-stddev > {min_count_stddev(z):.5g} (the update's "
        "noise multiplier z_u grows as sigma_b approaches it)"
    )


def plan_privacy(
    params: DpParams, bound: SensitivityBound, noise_mechanism: NoiseMechanism, count_stddev: float | None = None
) -> PrivacyPlan:
    """Calibrate or take ``z`` and check the budget, before anything starts.

    ``bound`` is the run's sensitivity bound (no noise without a private one); ``noise_mechanism`` its noise mechanism
    (the object ``params.mechanism`` names: `dpfedavg.privacy.setup.PrivacySetup.resolve()` looks both up);
    ``count_stddev`` the
    ``sigma_b`` of an adaptive bound's count, ``None`` for "auto"
    (`auto_count_stddev()` of the run's ``z``).

    Raises
    ------
    dpfedavg.errors.ConfigError
        A budget ``max-epsilon`` that the first round already exceeds, or that cannot hold because the
        run has no noise; an adaptive bound with ``sigma_b <= z/2`` (checked after ``z`` is calibrated).
    """
    q, delta, accountant = params.q, params.delta, params.accountant
    where = f"num-rounds = {params.rounds}, q = r/n = {q:.4g}, delta = {delta:g}, accountant = {accountant!r}"
    if not bound.private:
        z, calibrated = 0.0, False
    elif params.target_epsilon is not None:
        try:
            z = noise_mechanism.calibrate(params)
        except CalibrationError as err:
            raise ConfigError(f"invalid run config: 'epsilon' = {params.target_epsilon:g} ({where}): {err}") from None
        calibrated = True
    else:
        z, calibrated = (params.noise_multiplier or 0.0), False
    dp = z > 0
    if bound.adaptive and count_stddev is None:
        count_stddev = auto_count_stddev(z, params.clients_per_round)
    if dp and bound.adaptive and not (count_stddev is not None and count_stddev > min_count_stddev(z)):
        raise _count_stddev_error(bound, count_stddev or 0.0, z, calibrated, params.target_epsilon)
    try:
        nominal = noise_mechanism.epsilon(params, z, params.rounds) if dp else math.inf
    except AccountingRangeError as err:
        raise ConfigError(f"invalid run config: 'noise-multiplier' = {z:g} ({where}): {err}") from None
    budget = params.max_epsilon
    if budget is not None:
        if not dp:
            raise ConfigError(
                f"invalid run config: 'max-epsilon' = {budget:g} but the run adds no noise "
                f"(algorithm {bound.name!r}, noise multiplier 0): its epsilon is infinite"
            )
        first = noise_mechanism.epsilon(params, z, 1)
        if first > budget:
            raise ConfigError(
                f"invalid run config: 'max-epsilon' = {budget:g} is exceeded by the first round already "
                f"(epsilon = {first:.4g} at z = {z:.4g}, q = {q:.4g}, delta = {delta:g})"
            )
    return PrivacyPlan(
        dp=dp,
        noise_multiplier=z,
        calibrated=calibrated,
        target_epsilon=params.target_epsilon,
        delta=delta,
        q=q,
        rounds=params.rounds,
        accountant=accountant,
        max_epsilon=budget,
        nominal_epsilon=nominal,
        neighbouring=params.neighbouring,
        count_stddev=count_stddev if bound.adaptive else None,
        params=params,
        noise_mechanism=noise_mechanism,
    )
