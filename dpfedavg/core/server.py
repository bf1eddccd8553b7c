"""Server-side math: Poisson sampling, fixed-denominator aggregation, momentum, schedules."""

from __future__ import annotations

import numpy as np

from dpfedavg.core.types import Vector

__all__ = [
    "poisson_sample",
    "fixed_denominator_mean",
    "momentum_step",
    "local_lr_at",
    "server_lr_at",
    "keep_random_iterate",
]


def poisson_sample(num_clients: int, q: float, rng: np.random.Generator) -> np.ndarray:
    """Sample each client in ``[0, n)`` independently with probability ``q = r/n``.

    Alg. 1 line 3. Returns the sorted indices of the sampled clients; the count
    is ``Binomial(n, q)`` and may be 0. Consumes exactly ``n`` uniforms.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"sampling probability q must be in [0, 1], got {q!r}")
    return np.flatnonzero(rng.random(num_clients) < q)


def fixed_denominator_mean(total: Vector, clients_per_round: float) -> Vector:
    """``a_k = (1/r) * (sum_{i in S_k} (g_i + zeta_i) [+ the server's noise])`` (Alg. 1 line 12).

    The denominator is the *expected* cohort size ``r``, not the number of
    replies: dividing by ``|S_k|`` would make a client's influence depend on the
    others' participation and break the sensitivity bound ``C/r``. An empty
    sum (all zeros) gives ``a_k = 0``.
    """
    if not clients_per_round > 0:
        raise ValueError(f"clients-per-round r must be > 0, got {clients_per_round!r}")
    return np.asarray(total, dtype=np.float64) / clients_per_round


def momentum_step(w: Vector, momentum: Vector, a: Vector, server_lr: float, mu: float) -> tuple[Vector, Vector]:
    """Server momentum: ``m_{k+1} = mu m_k + a_k``, ``w_{k+1} = w_k - beta_k m_{k+1}``.

    With ``mu = 0`` this is exactly Alg. 1 line 12 (``w_{k+1} = w_k - beta_k a_k``).
    Returns ``(w_{k+1}, m_{k+1})``; inputs are not modified.
    """
    new_momentum = mu * momentum + a
    return w - server_lr * new_momentum, new_momentum


def local_lr_at(round_index: int, lr0: float, decay: float) -> float:
    """``eta_k = eta_0 * gamma^k`` for the 0-based round ``k`` (paper App. "Experimental Details")."""
    return lr0 * decay**round_index


def server_lr_at(round_index: int, lr0: float, decay: float, server_lr: float | None) -> float:
    """``beta_k``: a constant ``server_lr`` or, when it is ``None``, ``beta_k = eta_k`` (paper §4.4, §5)."""
    if server_lr is None:
        return local_lr_at(round_index, lr0, decay)
    return server_lr


def keep_random_iterate(round_index: int, rng: np.random.Generator) -> bool:
    """Reservoir sampling of ``w_{k~}``: keep ``w_k`` instead of the iterate held so far w.p. ``1/(k+1)``.

    Applied at every round ``k = 0, 1, ...``, the iterate held after rounds
    ``0..m-1`` is uniform over ``w_0 .. w_{m-1}``: after a full run it is Alg. 1
    line 13's ``w_{k~}``, ``k~ ~ unif[0, K-1]``, and after a run stopped early
    by the privacy budget it is uniform over the rounds that ran.
    """
    return bool(rng.random() * (round_index + 1) < 1.0)
