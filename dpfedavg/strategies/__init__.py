"""Server strategies: DP-FedAvg / DP-NormFedAvg with Poisson sampling and fixed denominator."""

from dpfedavg.strategies.dp_fedavg import DPFedAvg, FederationError, RoundStats

__all__ = ["DPFedAvg", "FederationError", "RoundStats"]
