"""Canary clients in the batched engine: clients whose update is ``C c_j``, through the pipeline every client uses.

The server samples the canaries like any client (``q = r / n``, :func:`dpfedavg.server.run.canary_federation`);
client ``n + i`` is the ``i``-th inserted canary (:class:`dpfedavg.privacy.canary.CanarySet`). Its local
"training" is the fixed update ``u = C_k c_j``; the rest is :func:`dpfedavg.core.private_block_update`, the same
bound (Alg. 1 line 9 / Alg. 2's normalisation) and the same noise law with the client's own generator
``noise_rng(noise_seed, client_id)`` (Alg. 1 line 10). The task never sees a canary: no data, no evaluation.
"""

from __future__ import annotations

import numpy as np

from dpfedavg.core import noise_rng, private_block_update, round_noise_law
from dpfedavg.core.types import ClientResult, RoundInstructions

__all__ = ["canary_results"]


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
    u = ins.clip * directions[ids - num_clients]
    updates = private_block_update(
        u,
        algorithm=ins.algorithm,
        clip=ins.clip,
        noise_std=ins.noise_std,
        rngs=[noise_rng(ins.noise_seed, int(cid)) for cid in ids],
        law=round_noise_law(ins),
        count_scale=ins.count_scale,
    )
    clean = ins.diagnostics
    return [
        ClientResult(int(cid), upd.noisy, upd.update_norm, upd.clean if clean else None)
        for cid, upd in zip(ids, updates, strict=True)
    ]
