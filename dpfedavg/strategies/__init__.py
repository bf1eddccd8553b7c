"""The Flower strategy: DP-FedAvg / DP-NormFedAvg on Flower's Message API, and its SecAgg+ glue.

Everything here imports Flower; the server math it drives is :class:`dpfedavg.server.DPServer`
and the accounting :mod:`dpfedavg.privacy`.
"""

from dpfedavg.strategies.dp_fedavg import DPFedAvg, FlowerRunner
from dpfedavg.strategies.federation import Federation, FederationError

__all__ = ["DPFedAvg", "Federation", "FederationError", "FlowerRunner"]
