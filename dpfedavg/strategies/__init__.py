"""Server strategies: DP-FedAvg / DP-NormFedAvg with Poisson sampling and fixed denominator, and accounting."""

from dpfedavg.strategies.accounting import PrivacyPlan, RoundAccountant, RoundEvent, plan_privacy
from dpfedavg.strategies.dp_fedavg import DPFedAvg, FederationError, PrivacyBudgetExhausted, RoundStats

__all__ = [
    "DPFedAvg",
    "FederationError",
    "PrivacyBudgetExhausted",
    "PrivacyPlan",
    "RoundAccountant",
    "RoundEvent",
    "RoundStats",
    "plan_privacy",
]
