"""A round as values: what the clients brought back (`RoundReplies`) and what the round made (`RoundRecord`).

A `dpfedavg.server.loop.ClientRunner` reaches the sampled clients and returns one frozen `RoundReplies`;
`dpfedavg.server.dp_server.DPServer.close_round()` is the one way to close a round (Alg. 1 lines 11-12) and
returns one frozen `RoundRecord`, which the round loop passes on (the session, the health check, the metrics).
Nothing edits either after it is made. Light (numpy only): the batched engine's client side imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpfedavg.core.types import ClientResult, Vector
from dpfedavg.io.metrics import RoundStats

__all__ = ["RoundRecord", "RoundReplies"]


@dataclass(frozen=True)
class RoundReplies:
    """What a runner got from one round's sampled clients.

    Either each client's ``g_i + zeta_i`` (``results``, ascending client id: a fixed summation order) or their
    sum formed elsewhere (``total``: SecAgg+'s secure sum, a device's sum) over ``num_summed`` clients, with their
    ``||u_i||`` when known (``norms``; a secure sum has none) and ``sum_i g_i`` (``clean_total``, diagnostics).
    ``halted``: why no update could be summed (secure aggregation could not finish; the round releases the
    server's noise alone). Sampled clients neither summed, failed nor rejected are dropouts.

    The counts are per sampled client; the reasons one per failed, rejected or unexpected reply (a node's
    reply may stand for several of its clients). ``num_unexpected``: replies nobody asked for (a node not
    sampled, a second reply): rejected, never counted against a sampled client.
    """

    results: tuple[ClientResult, ...] = ()
    total: Vector | None = None
    num_summed: int = 0
    norms: tuple[float, ...] | np.ndarray = ()
    clean_total: Vector | None = None
    num_failed: int = 0
    num_rejected: int = 0
    num_unexpected: int = 0
    failed_reasons: tuple[str, ...] = ()
    rejected_reasons: tuple[str, ...] = ()
    halted: str | None = None

    def __post_init__(self) -> None:
        for name in ("results", "failed_reasons", "rejected_reasons"):
            value = getattr(self, name)
            if type(value) is not tuple:  # a list or generator given: kept as a tuple (frozen, like the rest)
                object.__setattr__(self, name, tuple(value))
        if self.total is not None and self.results:
            raise ValueError("RoundReplies holds either the clients' results or their sum, not both")


@dataclass(frozen=True)
class RoundRecord:
    """A closed round: ``w_{k+1}`` and the round's statistics (``metrics.csv``'s row)."""

    w: Vector
    stats: RoundStats

    @property
    def round(self) -> int:
        return self.stats.round
