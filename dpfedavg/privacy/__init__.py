"""Privacy: the accountant (dp-accounting) and the privacy plan of a run. No Flower import.

The noise placements themselves (what is added and what is accounted) are
:mod:`dpfedavg.core.mechanism`; the empirical auditor is :mod:`dpfedavg.privacy.audit`.
"""

from dpfedavg.privacy.accounting import (
    PrivacyPlan,
    RoundAccountant,
    RoundEvent,
    calibrate_noise_multiplier,
    epsilon_for,
    plan_privacy,
)

__all__ = ["PrivacyPlan", "RoundAccountant", "RoundEvent", "calibrate_noise_multiplier", "epsilon_for", "plan_privacy"]
