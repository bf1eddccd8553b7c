"""Alg. 1 / Alg. 2 lines 9-12 for several runs at once: a leading run axis over a block of clients.

A sweep runs many configurations ("runs") of the same federation: different ``C``, ``eta``, ``beta``,
``mu``, ``z``, initializations or algorithms over the same clients. Runs that share a ``seed`` also share,
in every round, the sampled clients (Alg. 1 line 3: ``make_rng(seed, SAMPLING, k)``) and every
client's noise stream (line 10: ``noise_rng(round_noise_seed(seed, k), i)``); only the scale of the noise
(``z C / sqrt(|S_k|)``, per run) differs. So the standard normal draws of a round are made once for all
of them (`shared_standard_normals()`, each client's row the one its own generator draws).

`released_sums()` then takes the client updates ``u`` of a ``(R, B, d)`` block (runs x clients),
bounds them with `dpfedavg.core.local.bound_block()` (line 9, the function every engine uses) and forms
each run's line-12 sum of ``g_i + zeta_i`` with ``zeta_i = s z_i`` (line 10) as ``sum_i g_i + s sum_i z_i``:
``sum_i g_i`` as one product of the bound's per-row factors with the clients' rows of ``u`` and the noise as one
`dpfedavg.core.noise.add_gaussian()` of the run's std times the clients' summed normals. That is the sum of
the same values the clients would send, rounded differently (a few units in the last place; a run gives
what it gives alone up to rounding, tested to 1e-9 over whole grids), without a ``(R, B, d)`` block of
noisy rows. Pure numpy, no Flower.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dpfedavg.core.local import BoundedBlock, bound_block
from dpfedavg.core.noise import add_gaussian
from dpfedavg.core.pipeline import client_normals
from dpfedavg.core.seeding import SECURE_NOISE_SEED

__all__ = ["RunSums", "released_sums", "shared_standard_normals"]


def shared_standard_normals(noise_seed: int, client_ids: np.ndarray, dim: int) -> np.ndarray:
    """Each client's standard normals of a round: row ``b`` is ``noise_rng(noise_seed, id_b).standard_normal(dim)``.

    ``GaussianLaw.add`` with std ``s`` adds exactly ``s * row`` (`dpfedavg.core.dp.gaussian_noise()`), so every
    run that shares ``noise_seed`` (the same ``seed``) noises with these rows scaled by its own std. A longer
    ``dim`` gives the same leading values (the generator fills the vector in order), so the ``d + 1``
    coordinates of an ``adaptive-clip`` run and the ``d`` of a ``clip`` run come from one draw.
    """
    if noise_seed == SECURE_NOISE_SEED:
        raise ValueError("secure-noise draws cannot be shared between runs (nobody can replay them)")
    return client_normals(noise_seed, client_ids, dim)


@dataclass
class RunSums:
    """What the server needs from one round of ``R`` runs, accumulated block by block (`released_sums()`).

    Attributes
    ----------
    noisy:
        Per run, ``sum_i (g_i + zeta_i)`` over its clients whose training did not diverge (length
        ``d``, or ``d + 1`` with ``adaptive-clip``'s count coordinate).
    clean:
        Per run, ``sum_i g_i`` (``None`` unless asked for: the SNR diagnostic).
    norms:
        Per run, the list of ``||u_i||`` of those clients, in ascending client id.
    failed:
        Per run, the ids of the clients whose local training diverged (NaN/Inf in ``u``): they send nothing.
    """

    noisy: list[np.ndarray]
    clean: list[np.ndarray | None]
    norms: list[list[np.ndarray]] = field(default_factory=list)
    failed: list[list[int]] = field(default_factory=list)

    @classmethod
    def zeros(cls, release_dims: Sequence[int], keep_clean: Sequence[bool]) -> RunSums:
        """Empty sums for runs whose vectors have ``release_dims`` coordinates."""
        return cls(
            noisy=[np.zeros(d) for d in release_dims],
            clean=[np.zeros(d) if keep else None for d, keep in zip(release_dims, keep_clean, strict=True)],
            norms=[[] for _ in release_dims],
            failed=[[] for _ in release_dims],
        )

    def update_norms(self, run: int) -> np.ndarray:
        """Run ``run``'s ``||u_i||`` of the clients that entered its sum, in client order."""
        parts = self.norms[run]
        if len(parts) == 1:  # one block of clients (a small round): its norms as they are
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0)


def released_sums(
    u: np.ndarray,
    client_ids: np.ndarray,
    *,
    algorithms: Sequence[str],
    clips: np.ndarray,
    noise_stds: np.ndarray,
    count_scales: np.ndarray,
    normals: np.ndarray | None,
    into: RunSums,
) -> RunSums:
    """Alg. 1 / Alg. 2 lines 9-10 and line 12's sum for a ``(R, B, d)`` block of ``R`` runs x ``B`` clients.

    Row ``(r, b)`` of ``u`` is client ``client_ids[b]``'s update ``u`` in run ``r``. Each run is bounded by
    its own algorithm and ``C`` (`bound_block()`; ``adaptive-clip`` appends the count
    coordinate with its ``s``) and noised with its own per-client std times the shared ``normals`` (``(B, D)``
    from `shared_standard_normals()`, ``D`` at least every run's vector length; ``None`` when every std
    is 0); `_accumulate()` adds ``sum_i g_i`` (one product of the bound's factors with the rows) and
    ``s sum_i z_i`` to ``into``. Blocks of clients of one round are passed one after the other with the same
    ``into``.
    """
    u = np.asarray(u)
    num_runs, num_clients, dim = u.shape
    if len(algorithms) != num_runs:
        raise ValueError(f"one algorithm per run: {num_runs} runs, {len(algorithms)} algorithms")
    if len(client_ids) != num_clients:
        raise ValueError(f"one client id per column: {num_clients} columns, {len(client_ids)} ids")
    stds = np.asarray(noise_stds, dtype=np.float64)
    if normals is None and np.any(stds != 0):
        raise ValueError("noise stds > 0 need the round's standard normal draws")
    if normals is not None and np.shape(normals)[0] != num_clients:  # a row per client: else less noise is summed
        raise ValueError(f"one row of normals per client: {num_clients} clients, {np.shape(normals)[0]} rows")
    clips, scales = np.asarray(clips, dtype=np.float64), np.asarray(count_scales, dtype=np.float64)
    for algorithm in dict.fromkeys(algorithms):
        runs = np.flatnonzero(np.asarray(algorithms) == algorithm)
        # a contiguous range of runs is a view of u; otherwise numpy copies those runs
        pick = slice(runs[0], runs[-1] + 1) if runs[-1] - runs[0] + 1 == len(runs) else runs
        picked = u[pick]
        block = bound_block(picked, algorithm=algorithm, clip=clips[pick], count_scale=scales[pick], rows=False)
        _accumulate(picked, block, runs, client_ids, stds[pick], normals, into, dim)
    return into


def _accumulate(
    u: np.ndarray,
    block: BoundedBlock,
    runs: np.ndarray,
    client_ids: np.ndarray,
    stds: np.ndarray,
    normals: np.ndarray | None,
    into: RunSums,
    dim: int,
) -> None:
    """Add one algorithm's runs of a block to their sums: ``sum_i g_i`` and ``sum_i (g_i + zeta_i)``.

    ``g_i = f_i u_i`` with the bound's per-row factor ``f_i`` (``block.factor``, `bound_block()` with
    ``rows=False``), so each run's ``sum_i g_i`` is one product of its factors with its rows of ``u`` (no ``g``
    block is formed); ``adaptive-clip``'s count coordinate is summed beside it. Each run's clients share their
    standard normals ``z_i`` (the rows of ``normals``) and differ only in the std ``s`` of the run, so
    ``sum_i (g_i + s z_i) = sum_i g_i + s sum_i z_i``: the normals are summed once per block and the noise
    enters as one `add_gaussian()` of ``s`` times their sum. These are the sums of the values the clients would
    send (`dpfedavg.core.local.private_block_update()`), rounded differently: the products and sums are
    ordered otherwise (a few units in the last place per round; tested against the client pipeline to 1e-12
    of the largest entry). A client whose training diverged (NaN/Inf in ``u``) sends nothing: its row and
    its normals leave that run's sums.
    """
    factor, count, finite = block.factor, block.count, block.finite
    assert factor is not None, "bound_block(..., rows=False) gives the factors"
    release = dim + (1 if count is not None else 0)
    lengths = sorted({into.noisy[r].shape[0] for r in runs})
    if lengths != [release]:  # every run's sum, as the stacked sums were checked before
        raise ValueError(f"the sums have length {', '.join(map(str, lengths))}, the runs' vectors {release}")
    all_finite = bool(finite.all())
    if not all_finite:  # a client whose training diverged sends nothing (its factor is finite, its row is not)
        u = np.where(finite[:, :, None], u, 0.0)
    clean = np.matmul(factor.transpose(0, 2, 1), u)[:, 0, :]  # (R, d): sum_i f_i u_i, each run one product
    if count is not None:
        counts = count if all_finite else np.where(finite, count, 0.0)
        clean = np.concatenate([clean, np.add.reduce(counts, axis=1)[:, None]], axis=1)  # (R, d + 1)
    if normals is None or not stds.any():  # none of these runs noises (e.g. an adaptive-clip run with server noise
        noisy = clean  # beside noised clip runs: the round's normals are only as long as the noised vectors)
    else:
        if normals.shape[1] < release:
            raise ValueError(f"the normals have {normals.shape[1]} columns, the runs' noised vectors {release}")
        z = normals[:, :release]
        if all_finite:  # one sum of the clients' normals for every run: (1, d')
            z_sum = np.add.reduce(z, axis=0, keepdims=True)
        else:  # each run leaves out its own diverged clients: (R, d')
            z_sum = np.add.reduce(np.where(finite[:, :, None], z[None], 0.0), axis=1)
        noisy = add_gaussian(clean, stds[:, None], z_sum)  # sum_i g_i + s sum_i z_i
    for j, r in enumerate(runs):
        into.noisy[r] = into.noisy[r] + noisy[j]  # 0 + x is x: a round of one block adds nothing to the bits
        if into.clean[r] is not None:
            into.clean[r] = into.clean[r] + clean[j]
        if all_finite:
            into.norms[r].append(block.norms[j])
            continue
        ok = finite[j]
        into.norms[r].append(block.norms[j][ok])
        if not ok.all():
            into.failed[r].extend(int(i) for i in np.asarray(client_ids)[~ok])
