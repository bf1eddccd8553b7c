"""The server side of Alg. 1 / Alg. 2 without Flower: state, per-round math, budget, secure-aggregation checks.

The Flower strategy (:mod:`dpfedavg.flower.strategy`) and the batched engine
(:mod:`dpfedavg.engines.batched`) both drive :class:`DPServer`. No Flower import.
"""

from dpfedavg.server.dp_server import DPServer, PrivacyBudgetExhausted, RoundStats, check_secure_aggregation

__all__ = ["DPServer", "PrivacyBudgetExhausted", "RoundStats", "check_secure_aggregation"]
