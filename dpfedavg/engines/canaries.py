"""The inserted canaries of a canary audit as a wrapper around any engine's `ClientRunner`.

A run with ``canary-clients = m`` samples from ``n + m'`` clients: the ``n`` real ones and the inserted
canaries, clients ``n ..`` (`dpfedavg.core.canaries`), whose ``g + zeta`` the server computes (Alg. 1 lines
4-10 on ``u = C c_j``). `WithCanaries` hands the real clients to the engine's runner (the batched engine's, or
Flower's: no node hosts a canary) and adds the sampled canaries' results after every real id, so a sum of
results stays in client-id order; a sum the runner formed (a device's) gets their vectors added.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from dpfedavg.core.canaries import canary_results
from dpfedavg.core.types import RoundInstructions, Vector
from dpfedavg.server.round import RoundReplies

if TYPE_CHECKING:
    from dpfedavg.server.loop import ClientRunner

__all__ = ["WithCanaries"]


class WithCanaries:
    """``inner`` with the inserted canaries: the `ClientRunner` of a run with ``canary-clients``.

    ``directions``: the inserted canaries' unit directions ``c_j`` (rows, client ids ``num_clients ..``).
    """

    def __init__(self, inner: ClientRunner, directions: np.ndarray, num_clients: int) -> None:
        self.inner, self.directions, self.num_clients = inner, directions, num_clients

    def run_round(self, server_round: int, clients: np.ndarray, w: Vector, ins: RoundInstructions) -> RoundReplies:
        n = self.num_clients
        replies = self.inner.run_round(server_round, clients[clients < n], w, ins)
        canaries = canary_results(self.directions, clients[clients >= n], n, ins)
        if not canaries or replies.halted is not None:
            return replies
        if replies.total is None:  # ids above every real one: the results stay in client-id order
            return dataclasses.replace(replies, results=(*replies.results, *canaries))
        clean = None if replies.clean_total is None else replies.clean_total + sum(r.clean for r in canaries)
        return dataclasses.replace(
            replies, total=replies.total + sum(r.noisy for r in canaries),
            num_summed=replies.num_summed + len(canaries),
            norms=np.concatenate([np.asarray(replies.norms, dtype=np.float64), [r.update_norm for r in canaries]]),
            clean_total=clean,
        )  # fmt: skip
