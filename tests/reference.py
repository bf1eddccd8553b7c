"""A plain-numpy implementation of Alg. 1 / Alg. 2 on the quadratic task.

Written from the paper and the documented seeding contract
(`dpfedavg.core.seeding`) only: it imports nothing from ``dpfedavg`` so
that a bug in the package's core cannot cancel out in a comparison.
Stream numbers: 0 task data (per client), 1 init, 2 sampling (per round),
3 noise (per round seed, then per client), 4 random iterate (per round,
reservoir sampling), 5 server noise (per round).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _rng(*entropy: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(list(entropy)))


@dataclass
class ReferenceResult:
    w_final: np.ndarray
    w_random_iterate: np.ndarray
    random_iterate_round: int
    trajectory: list[np.ndarray]


def quadratic_data(seed: int, n: int, d: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``Q_i = A_i A_i^T`` (dense) and ``w_i*`` for every client (paper §4.4)."""
    qs, w_stars = [], []
    for i in range(n):
        g = _rng(seed, 0, i)
        w_star = g.standard_normal(d)
        a = g.normal(0.0, 1.0 / 20, size=(d, 20))
        qs.append(a @ a.T)
        w_stars.append(w_star)
    return qs, w_stars


def quadratic_optimum(qs: list[np.ndarray], w_stars: list[np.ndarray]) -> np.ndarray:
    h = sum(qs)
    b = sum(q @ w for q, w in zip(qs, w_stars, strict=True))
    return np.linalg.lstsq(h, b, rcond=None)[0]


def run_reference(
    *,
    seed: int,
    n: int,
    d: int,
    init: str,
    num_rounds: int,
    local_steps: int,
    local_lr: float,
    lr_decay: float,
    server_lr: float | None,
    server_momentum: float,
    clients_per_round: float,
    algorithm: str,
    clip: float,
    noise_multiplier: float,
    noise_placement: str = "client",
) -> ReferenceResult:
    qs, w_stars = quadratic_data(seed, n, d)
    w_opt = quadratic_optimum(qs, w_stars)
    z = _rng(seed, 1).uniform(0.0, 1.0, size=d)
    w = w_opt + (z if init == "I1" else z / 5)
    q = clients_per_round / n
    z = 0.0 if algorithm == "none" else noise_multiplier
    m = np.zeros(d)
    w_random, k_random = None, -1
    trajectory = [w.copy()]
    for k in range(num_rounds):
        if _rng(seed, 4, k).random() * (k + 1) < 1.0:  # reservoir: uniform over w_0..w_{K-1}
            w_random, k_random = w.copy(), k
        eta = local_lr * lr_decay**k
        beta = eta if server_lr is None else server_lr
        sampled = np.flatnonzero(_rng(seed, 2, k).random(n) < q)
        noise_seed = int(_rng(seed, 3, k).integers(0, 2**63 - 1))
        noise_std = {
            "client": z * clip / np.sqrt(clients_per_round),
            "client-calibrated": z * clip / np.sqrt(max(len(sampled), 1)),
            "server": 0.0,
        }[noise_placement]
        total = np.zeros(d)
        for i in sampled:  # Alg. 1 lines 4-11
            w_local = w.copy()
            for _ in range(local_steps):
                w_local = w_local - eta * (qs[i] @ (w_local - w_stars[i]))
            u = (w - w_local) / eta
            norm_u = np.linalg.norm(u)
            if algorithm == "clip":
                g = u * min(1.0, clip / norm_u)
            elif algorithm == "norm":
                g = clip * u / norm_u
            else:
                g = u
            zeta = _rng(noise_seed, 3, int(i)).standard_normal(d) * noise_std if noise_std > 0 else 0.0
            total = total + g + zeta
        if noise_placement == "server" and z > 0:
            total = total + _rng(seed, 5, k).standard_normal(d) * z * clip
        a = total / clients_per_round  # line 12, fixed denominator r
        m = server_momentum * m + a
        w = w - beta * m
        trajectory.append(w.copy())
    assert w_random is not None
    return ReferenceResult(w, w_random, k_random, trajectory)


def run_reference_for(cfg, noise_multiplier: float | None = None) -> ReferenceResult:
    """Run the reference with the fields of a ``dpfedavg.config.RunConfig``.

    ``noise_multiplier`` defaults to the config's fixed one (pass the calibrated
    z when the config has ``noise-multiplier = "auto"``).
    """
    z = cfg.noise_multiplier if noise_multiplier is None else noise_multiplier
    return run_reference(
        seed=cfg.seed,
        n=cfg.num_clients,
        d=cfg.dim,
        init=cfg.init,
        num_rounds=cfg.num_rounds,
        local_steps=cfg.local_steps,
        local_lr=cfg.local_lr,
        lr_decay=cfg.lr_decay,
        server_lr=cfg.server_lr,
        server_momentum=cfg.server_momentum,
        clients_per_round=cfg.clients_per_round,
        algorithm=cfg.algorithm,
        clip=cfg.clip,
        noise_multiplier=z or 0.0,
        noise_placement=cfg.noise_placement,
    )
