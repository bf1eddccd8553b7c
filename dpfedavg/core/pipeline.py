"""One client pipeline on the task's device: the bound, the noise and the sum of a block (Alg. 1/2 lines 9-12).

The batched engine's torch path keeps a round on the task's device: the local steps leave ``u`` there
(``TorchTask.device_block_update``), and `round_block_sum()` bounds it (line 9, `bound_block()`, the
function every engine uses), adds each client's noise (line 10) and adds the block into the round's
running sum (line 12's ``sum_i (g_i + zeta_i)``), all in the array library of ``u``. The host sees
``w_k`` go out and, once per round, the summed vector plus one norm and one finite flag per client
(`BlockSums.to_host()`): nothing per block or per client crosses.

A SuperNode hosting several virtual clients replies with each client's own ``g + zeta`` (the server sums):
`block_rows()` runs the same bound and noise (the code it shares with `round_block_sum()`) and keeps the rows;
the block crosses to the host as one array (`BlockRows.to_host()`).

Precision: the pipeline runs in ``u``'s dtype. A float64 ``u`` (the default of the torch tasks) gives the float64
reference; a float32 ``u`` (``torch-compile`` with ``torch-dtype = float32``) is bounded, noised and summed over its
block in float32, and the blocks' sums are added in float64. The noise is the same draws either way (float64 on the
host, cast once). Against the float64 pipeline on the same ``u``, the round's noisy sum agrees to
`FLOAT32_TOLERANCE` relative to its largest entry (float32's rounding of the bound, the noise and a block's sum;
``tests/test_fast_torch_path.py`` checks trajectories of the whole fast path against the eager float64 path).

The noise is each client's own stream ``noise_rng(noise_seed, i)`` (`client_normals()`): the same
standard normals `dpfedavg.core.noise.GaussianLaw.add()` draws for that client, added by the same function
(`dpfedavg.core.noise.add_gaussian()`), so ``g + std * z`` here is, element for element, what the ClientApp
sends. The rows are drawn on the host (numpy's generators, their states set for the whole block at once by
`dpfedavg.core.seed_rows`) and reach the device as one array per block. A numpy ``u`` runs the same code in numpy.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpfedavg.core.arrays import astype, concat, namespace, to_host
from dpfedavg.core.local import bound_block
from dpfedavg.core.noise import GaussianLaw, add_gaussian, round_noise_law
from dpfedavg.core.seed_rows import fill_noise_rows
from dpfedavg.core.threads import cpu_share
from dpfedavg.core.types import ClientResult, RoundInstructions

__all__ = [
    "FLOAT32_TOLERANCE",
    "NOISE_THREADS",
    "NOISE_THREAD_MIN_DIM",
    "BlockRows",
    "BlockSums",
    "HostRows",
    "HostSums",
    "block_rows",
    "client_normals",
    "noise_threads",
    "round_block_sum",
]

#: A float32 pipeline's round sum (and its norms) is within this of the float64 pipeline's on the same ``u``, relative
#: to the largest entry (``tests/test_fast_torch_path.py``: 40 clients, measured up to 1e-7; float32's unit roundoff
#: is 6e-8, and torch's sum of a block's rows is a cascade sum: the error grows slowly with the block's size).
FLOAT32_TOLERANCE = 1e-6

#: Threads drawing a block's noise rows, at most (and at most the process's `cpu_share()`).
NOISE_THREADS = 4
#: Rows at least this long are drawn on several threads. A row's cost is setting the client's generator
#: state (a few us, holding the GIL; `dpfedavg.core.seed_rows`) plus filling it (about 9 ns per value, the
#: GIL released): at d = 200 threads only add their overhead (CPU per 100 rows: 1.08 ms on one thread,
#: 1.37 ms with a pool created per call). 600 rows on 2 cores (2026-11-28): d = 1024 6.7 ms on one thread and
#: 5.0 on two, d = 2048 11.8 and 10.4, d = 4096 22.2 and 12.0, d = 7850 41 and 22.
NOISE_THREAD_MIN_DIM = 4096

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _noise_pool() -> ThreadPoolExecutor:
    """The process's one pool of noise threads, created on first use (never one per call)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=NOISE_THREADS, thread_name_prefix="dpfedavg-noise")
        return _pool


def _forget_pool() -> None:  # a forked child has the parent's pool object but none of its threads
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def noise_threads(rows: int, dim: int) -> int:
    """How many threads `client_normals()` uses for ``rows`` rows of ``dim`` values (1: the calling thread)."""
    if dim < NOISE_THREAD_MIN_DIM or rows < 2:
        return 1
    return min(NOISE_THREADS, cpu_share(), rows)


def client_normals(noise_seed: int, client_ids: Sequence[int] | np.ndarray, dim: int) -> np.ndarray:
    """Row ``b``: ``noise_rng(noise_seed, id_b).standard_normal(dim)``, client ``id_b``'s standard normals.

    `dpfedavg.core.dp.gaussian_noise()` with std ``s`` is ``s`` times this row, so ``g + s * row`` is what the
    client's `GaussianLaw.add()` returns. A longer ``dim`` gives the same leading values. Rows of at least
    `NOISE_THREAD_MIN_DIM` values are drawn on up to `NOISE_THREADS` threads of one pool the process keeps
    (each row from its own generator, so the result does not depend on them); shorter rows on the caller's.
    """
    out = np.empty((len(client_ids), dim))

    def fill(rows: range) -> None:  # in place: each client's generator state writes its row (seed_rows)
        fill_noise_rows(noise_seed, client_ids, out, rows)

    threads = noise_threads(len(client_ids), dim)
    if threads <= 1:
        fill(range(len(client_ids)))
        return out
    step = -(-len(client_ids) // threads)  # numpy's generators release the GIL while they fill a row
    chunks = [range(lo, min(lo + step, len(client_ids))) for lo in range(0, len(client_ids), step)]
    list(_noise_pool().map(fill, chunks))
    return out


def _wide(x: Any) -> Any:
    """A block's sum in float64 (a float32 block's sum is cast: the round's sum over blocks adds in float64)."""
    xp = namespace(x)
    return x if x.dtype == xp.float64 else astype(x, xp.float64)


@dataclass
class HostSums:
    """A round's `BlockSums` on the host: what the server's ``finish_round_block`` takes."""

    noisy: np.ndarray
    clean: np.ndarray | None
    norms: np.ndarray
    finite: np.ndarray


@dataclass
class BlockSums:
    """A round's running sums over its blocks of clients, in the array library (and on the device) of ``u``.

    Attributes
    ----------
    noisy:
        ``sum_i (g_i + zeta_i)`` over the clients whose ``u`` is finite (length ``d``, or ``d + 1`` with
        ``adaptive-clip``'s count coordinate).
    clean:
        ``sum_i g_i`` over the same clients (``None`` unless asked for: the SNR diagnostic).
    norms, finite:
        Per block, ``||u_i||`` and whether client ``i``'s ``u`` had no NaN/Inf (a client whose local training
        diverged sends nothing), in client order.
    """

    noisy: Any = None
    clean: Any = None
    norms: list[Any] | None = None
    finite: list[Any] | None = None

    def to_host(self) -> HostSums:
        """The round's sums as numpy arrays: the one crossing from the device per round."""
        norms = to_host(concat(self.norms)) if self.norms else np.zeros(0)
        finite = to_host(concat(self.finite)) if self.finite else np.zeros(0, dtype=bool)
        clean = None if self.clean is None else to_host(self.clean)
        return HostSums(noisy=to_host(self.noisy), clean=clean, norms=norms, finite=finite)


def _bounded_noisy(u: Any, ins: RoundInstructions, client_ids: Sequence[int] | np.ndarray) -> tuple[Any, Any, Any]:
    """Alg. 1 / Alg. 2 lines 9-10 for a ``(B, d)`` block: ``(g, g + zeta, bound_block(u))`` in ``u``'s library.

    ``g`` is `bound_block()`'s (with ``adaptive-clip``'s count coordinate appended), ``zeta`` row ``b`` client
    ``client_ids[b]``'s standard normals (`client_normals()`) times the per-client std ``ins.noise_std``
    (`add_gaussian()`). Rows
    whose ``u`` is not finite are left as they come (the callers mask or drop them).
    """
    law = round_noise_law(ins)
    if not isinstance(law, GaussianLaw):
        raise ValueError(f"the device pipeline adds Gaussian noise; the round's noise law is {law.name!r}")
    if len(client_ids) != u.shape[0]:
        raise ValueError(f"one client id per row: {u.shape[0]} rows, {len(client_ids)} ids")
    block = bound_block(u, algorithm=ins.algorithm, clip=ins.clip, count_scale=ins.count_scale)
    g = block.g if block.count is None else concat([block.g, block.count[:, None]], axis=1)
    if ins.noise_std < 0:
        raise ValueError(f"noise std must be >= 0, got {ins.noise_std!r}")
    normals = client_normals(ins.noise_seed, client_ids, g.shape[1]) if ins.noise_std > 0 else None  # std 0: none
    return g, add_gaussian(g, ins.noise_std, normals, scale_in_place=True), block


def round_block_sum(
    u: Any,
    ins: RoundInstructions,
    client_ids: Sequence[int] | np.ndarray,
    into: BlockSums | None = None,
    *,
    keep_clean: bool = False,
) -> BlockSums:
    """Alg. 1 / Alg. 2 lines 9-10 for a ``(B, d)`` block of clients, added into the round's sum (line 12).

    Row ``b`` of ``u`` (a numpy array or a tensor on the task's device) is client ``client_ids[b]``'s update.
    It is bounded as the round's instructions say (`bound_block()`; ``adaptive-clip`` appends its count
    coordinate), noised with client ``client_ids[b]``'s standard normals (`client_normals()`) times the
    per-client std ``ins.noise_std``, and, when finite, added to ``into`` (a fresh `BlockSums` when ``None``).
    Only the Gaussian law runs here: secure aggregation encodes each client's vector on its own.
    """
    xp = namespace(u)
    g, noisy, block = _bounded_noisy(u, ins, client_ids)
    finite = block.finite
    if xp is not np or not np.all(finite):  # a tensor's flags stay on the device: mask every block
        noisy = xp.where(finite[:, None], noisy, 0.0)
        g = xp.where(finite[:, None], g, 0.0) if keep_clean else g
    into = into if into is not None else BlockSums(norms=[], finite=[])
    block_noisy = _wide(xp.sum(noisy, axis=0))
    into.noisy = block_noisy if into.noisy is None else into.noisy + block_noisy
    if keep_clean:
        block_clean = _wide(xp.sum(g, axis=0))
        into.clean = block_clean if into.clean is None else into.clean + block_clean
    into.norms.append(block.norms)
    into.finite.append(finite)
    return into


@dataclass
class HostRows:
    """A block's `BlockRows` on the host: one row per client, in the block's order.

    Attributes
    ----------
    noisy:
        ``(B, d')``: row ``b`` is client ``b``'s ``g + zeta`` (``d' = d``, or ``d + 1`` with ``adaptive-clip``);
        meaningless where ``finite`` is false.
    clean:
        ``(B, d')``: the rows of ``g`` (``None`` unless asked for: the diagnostics).
    norms, finite:
        ``||u_b||`` and whether client ``b``'s ``u`` had no NaN/Inf.
    """

    noisy: np.ndarray
    clean: np.ndarray | None
    norms: np.ndarray
    finite: np.ndarray

    def client_results(self, client_ids: Sequence[int] | np.ndarray) -> tuple[list[ClientResult], list[int]]:
        """The finite clients' results (``g`` as ``clean`` when kept) and the ids whose ``u`` was not finite."""
        results, failed = [], []
        for row, client_id in enumerate(client_ids):
            if not self.finite[row]:
                failed.append(int(client_id))
                continue
            clean = None if self.clean is None else self.clean[row]
            results.append(ClientResult(int(client_id), self.noisy[row], float(self.norms[row]), clean))
        return results, failed


@dataclass
class BlockRows:
    """A block's per-client ``g + zeta`` (and ``g``, norms, finite flags) in the array library of ``u``.

    What a SuperNode hosting several virtual clients replies with: each client's own noisy vector, not
    their sum (the server sums). `to_host()` brings the whole block over in one crossing.
    """

    noisy: Any
    clean: Any
    norms: Any
    finite: Any

    def to_host(self) -> HostRows:
        """The block as numpy arrays: one ``(B, 2 d' + 2)`` (or ``(B, d' + 2)``) array crosses from the device."""
        dim = self.noisy.shape[1]
        columns = [self.noisy] + ([] if self.clean is None else [self.clean])
        flags = astype(self.finite, self.noisy.dtype)
        packed = to_host(concat([*columns, self.norms[:, None], flags[:, None]], axis=1)).astype(np.float64, copy=False)
        clean = None if self.clean is None else packed[:, dim : 2 * dim]
        return HostRows(noisy=packed[:, :dim], clean=clean, norms=packed[:, -2], finite=packed[:, -1] > 0)


def block_rows(
    u: Any, ins: RoundInstructions, client_ids: Sequence[int] | np.ndarray, *, keep_clean: bool = False
) -> BlockRows:
    """Alg. 1 / Alg. 2 lines 9-10 for a ``(B, d)`` block of clients, one noisy row per client (no sum).

    The bound and the noise of `round_block_sum()` (the same code: row ``b`` is client ``client_ids[b]``'s
    ``g + zeta``, its noise from its own stream), kept row by row for a SuperNode that replies for each of
    its virtual clients. ``keep_clean`` keeps ``g`` too (the diagnostics).
    """
    g, noisy, block = _bounded_noisy(u, ins, client_ids)
    return BlockRows(noisy=noisy, clean=g if keep_clean else None, norms=block.norms, finite=block.finite)
