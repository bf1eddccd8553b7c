"""Canary clients: clients whose update is ``C c_j``, through the pipeline every client uses.

The server samples the canaries like any client (``q = r / n``, ``dpfedavg.privacy.setup.FederationSize``);
client ``n + i`` is the ``i``-th inserted canary (``dpfedavg.privacy.canary.CanarySet``). Its local
"training" is the fixed update ``u = C_k c_j``; the rest is ``dpfedavg.core.private_block_update``, the same
bound (Alg. 1 line 9 / Alg. 2's normalisation) and the same noise law with the client's own generator
``noise_rng(noise_seed, client_id)`` (Alg. 1 line 10). The task never sees a canary: no data, no evaluation.
"""

from __future__ import annotations

import numpy as np

from dpfedavg.core import round_block_update
from dpfedavg.core.seeding import Stream, make_rng
from dpfedavg.core.types import ClientResult, RoundInstructions

__all__ = ["canary_directions", "canary_federation_size", "canary_results", "canary_updates", "inserted_canaries"]


def inserted_canaries(seed: int, count: int) -> np.ndarray:
    """Which of the ``count`` canaries are inserted: each independently with probability 1/2 (bool, ``(count,)``).

    From ``(seed, CANARY, 0)`` alone, so that a SuperNode can check the federation's size from its run config.
    """
    return make_rng(seed, Stream.CANARY, 0).random(count) < 0.5


def canary_directions(seed: int, count: int, dim: int) -> np.ndarray:
    """``(count, dim)``: the canaries' unit directions ``c_j``, uniform on the sphere, from ``(seed, CANARY, 1)``."""
    g = make_rng(seed, Stream.CANARY, 1).standard_normal((count, dim))
    norms = np.linalg.norm(g, axis=1, keepdims=True)
    return g / np.where(norms > 0, norms, 1.0)


def canary_federation_size(num_clients: int, clients_per_round: float, inserted: int) -> tuple[int, float]:
    """``(n', r')``: ``n' = n + inserted`` clients, each sampled with the same ``q = r / n``, so ``r' = q n'``."""
    if inserted == 0:
        return num_clients, clients_per_round
    total = num_clients + inserted
    return total, clients_per_round / num_clients * total


def canary_updates(directions: np.ndarray, ids: np.ndarray, num_clients: int, clip: float) -> np.ndarray:
    """The sampled canaries' updates ``u = C c_j`` (rows, before the bound and the noise): row ``id - n`` of
    ``directions`` for each of ``ids`` (all ``>= num_clients``), times the round's ``C``."""
    return clip * directions[np.asarray(ids, dtype=np.int64) - num_clients]


def canary_results(
    directions: np.ndarray, ids: np.ndarray, num_clients: int, ins: RoundInstructions
) -> list[ClientResult]:
    """The sampled canaries' ``g + zeta``, in ascending id (``ids >= num_clients``; row ``id - n`` of ``directions``).

    Parameters
    ----------
    directions:
        The inserted canaries' unit directions ``c_j`` (rows), in client-id order.
    ids:
        The sampled canary client ids, ascending.
    num_clients:
        ``n``: the federation's real clients are ``0 .. n - 1``.
    ins:
        The round's instructions (the same every sampled client gets).
    """
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) == 0:
        return []
    updates = round_block_update(canary_updates(directions, ids, num_clients, ins.clip), ins, ids)
    clean = ins.diagnostics
    return [
        ClientResult(int(cid), upd.noisy, upd.update_norm, upd.clean if clean else None)
        for cid, upd in zip(ids, updates, strict=True)
    ]
