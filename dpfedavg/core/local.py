"""Client-side local training and the private client update (Alg. 1/2, lines 4-10)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dpfedavg.core.adaptive_clip import augmented_bound, count_coordinate
from dpfedavg.core.arrays import astype, namespace, row_norms
from dpfedavg.core.dp import bound_sensitivity, get_bound
from dpfedavg.core.noise import NoiseLaw, noise_law, round_noise_law
from dpfedavg.core.seeding import noise_rng
from dpfedavg.core.types import GradFn, RoundInstructions, Vector

__all__ = [
    "LocalTrainingDiverged",
    "local_steps",
    "client_update",
    "BoundedBlock",
    "ClientUpdate",
    "bound_block",
    "private_client_update",
    "private_block_update",
    "round_block_update",
    "client_round_update",
    "zero_updates",
]

logger = logging.getLogger(__name__)


class LocalTrainingDiverged(FloatingPointError):
    """Local training produced NaN or Inf: the client reports a failure instead of sending it."""


def local_steps(w: Vector, grad_fn: GradFn, lr: float, num_steps: int) -> Vector:
    """Run ``E = num_steps`` full-batch gradient steps from ``w`` (Alg. 1 lines 5-7).

    ``w_{k,tau+1} = w_{k,tau} - eta_k * grad f_i(w_{k,tau})``; returns ``w_{k,E}``.
    The input ``w`` is not modified.
    """
    if num_steps < 1:
        raise ValueError(f"local-steps E must be >= 1, got {num_steps!r}")
    if not lr > 0:
        raise ValueError(f"local learning rate eta_k must be > 0, got {lr!r}")
    w_local = np.array(w, copy=True)
    for _ in range(num_steps):
        w_local -= lr * grad_fn(w_local)
    return w_local


def client_update(w: Vector, grad_fn: GradFn, lr: float, num_steps: int) -> Vector:
    """Client update ``u = (w_k - w_{k,E}) / eta_k`` (Alg. 1 line 9)."""
    return (w - local_steps(w, grad_fn, lr, num_steps)) / lr


@dataclass(frozen=True)
class ClientUpdate:
    """What one sampled client produces in one round.

    Attributes
    ----------
    noisy:
        ``g + zeta``: the only thing a client sends in normal operation (line 10). With
        ``adaptive-clip`` ``g`` has one more coordinate, ``s (1[||u|| <= C] - 1/2)``
        (`dpfedavg.core.adaptive_clip`).
    clean:
        ``g`` (clipped / normalized update, no noise). Research diagnostics only.
    update_norm:
        ``||u||`` before clipping / normalization.
    """

    noisy: Vector
    clean: Vector
    update_norm: float


def private_client_update(
    w: Vector,
    grad_fn: GradFn,
    *,
    lr: float,
    num_steps: int,
    algorithm: str,
    clip: float,
    noise_std: float,
    rng: np.random.Generator,
    law: NoiseLaw | None = None,
    count_scale: float = 0.0,
) -> ClientUpdate:
    """Alg. 1 / Alg. 2 lines 4-10 for one client.

    ``u`` from ``E`` local steps, ``g = clip(u, C)`` (``clip``), ``g = C u/||u||``
    (``norm``) or ``g = u`` (``none``), then ``g + zeta`` with ``zeta`` of std
    ``noise_std`` drawn from ``rng`` by the noise ``law`` (`dpfedavg.core.noise`;
    Gaussian by default, the discrete Gaussian on the round's grid under secure aggregation).
    """
    u = client_update(w, grad_fn, lr, num_steps)
    (update,) = private_block_update(
        u[None, :],
        algorithm=algorithm,
        clip=clip,
        noise_std=noise_std,
        rngs=[rng],
        law=law,
        count_scale=count_scale,
    )
    if update is None:
        raise LocalTrainingDiverged(
            f"local training diverged: the update has NaN/Inf after {num_steps} steps at eta_k={lr:g} "
            "(a smaller local-lr usually fixes it); nothing is sent"
        )
    return update


@dataclass(frozen=True)
class BoundedBlock:
    """A block of client updates after Alg. 1 / Alg. 2 line 9 (`bound_block()`).

    Attributes
    ----------
    g:
        The bounded updates, shape ``(..., B, d)`` like ``u`` (``None`` when `bound_block()` was asked for
        ``factor`` alone).
    factor:
        ``g = u * factor`` row by row, shape ``(..., B, 1)`` (`SensitivityBound.factor`); set with ``rows=False``.
    count:
        ``adaptive-clip``: each client's extra coordinate ``s (1[||u|| <= C] - 1/2)``, shape ``(..., B)``;
        ``None`` for the other algorithms.
    norms, finite:
        ``||u||`` before bounding and whether the row has no NaN/Inf, shape ``(..., B)``.
    """

    g: np.ndarray | None
    count: np.ndarray | None
    norms: np.ndarray
    finite: np.ndarray
    factor: np.ndarray | None = None


def bound_block(
    u: np.ndarray,
    *,
    algorithm: str,
    clip: float | np.ndarray,
    count_scale: float | np.ndarray = 0.0,
    rows: bool = True,
) -> BoundedBlock:
    """Alg. 1 / Alg. 2 line 9 for a block of clients: ``g`` row by row, and adaptive clipping's count.

    ``u`` holds one client update per row of its last two axes: ``(B, d)``, or ``(R, B, d)`` for ``R``
    runs at once (the leading run axis of `dpfedavg.core.runs`). ``clip`` and ``count_scale`` are
    scalars or one value per run (shape ``u.shape[:-2]``). Every engine bounds through this function:
    `private_block_update()` (the ClientApp, the batched engine), `dpfedavg.core.runs.released_sums()` and
    `dpfedavg.core.pipeline.round_block_sum()`. ``u`` may be a torch tensor: the block is then bounded on its
    device and every field of the result is a tensor there (`dpfedavg.core.arrays`). ``rows=False``: the
    bound's per-row ``factor`` instead of ``g = u * factor`` (a caller that needs only sums of ``g``).
    """
    xp = namespace(u)
    u = np.asarray(u) if xp is np else u
    adaptive = get_bound(algorithm).adaptive
    scale = np.asarray(count_scale, dtype=np.float64)
    if adaptive != bool(np.all(scale > 0)):
        raise ValueError(f"algorithm {algorithm!r} with count_scale = {count_scale!r}: adaptive-clip needs s > 0")
    c = np.asarray(clip, dtype=np.float64)
    if c.ndim and c.shape != tuple(u.shape[:-2]):
        raise ValueError(f"one C per run: u has shape {u.shape}, C has shape {c.shape} (expected {u.shape[:-2]})")
    norms = row_norms(u)
    if xp is np:  # a row is finite exactly when its norm is, unless its sum of squares overflowed: then look
        finite = np.isfinite(norms)
        if not finite.all():
            finite = np.all(np.isfinite(u), axis=-1)
    else:  # on a device, without a sync to the host
        finite = xp.all(xp.isfinite(u), axis=-1)
    row_clip = c[..., None, None] if c.ndim else clip
    if rows:
        g, factor = bound_sensitivity(u, algorithm, row_clip, norms[..., None]), None
    else:
        g, factor = None, get_bound(algorithm).factor(norms[..., None], row_clip)
    count = None
    if adaptive:
        rows_scale = scale[..., None] if scale.ndim else float(scale)
        count = astype(count_coordinate(norms, c[..., None] if c.ndim else clip, rows_scale), u.dtype)
    return BoundedBlock(g=g, count=count, norms=norms, finite=finite, factor=factor)


def private_block_update(
    u: np.ndarray,
    *,
    algorithm: str,
    clip: float,
    noise_std: float,
    rngs: Sequence[np.random.Generator],
    law: NoiseLaw | None = None,
    count_scale: float = 0.0,
) -> list[ClientUpdate | None]:
    """Alg. 1 / Alg. 2 lines 9-10 for a block of clients: the one client pipeline of every engine.

    ``u`` holds one client update per row (``(B, dim)``); row ``b`` is bounded to ``g``
    (`bound_block()`, row-wise) and noised from ``rngs[b]``
    by the noise ``law`` (`NoiseLaw`; ``None`` = Gaussian). A row with
    NaN/Inf (local training diverged) gives ``None``: that client sends nothing. The ClientApp calls it
    with a block of one (`private_client_update()`), the batched engine with a block of sampled clients.

    With ``adaptive-clip`` (``count_scale = s > 0``) each row of ``g`` gets the extra coordinate
    ``s (1[||u|| <= C] - 1/2)`` before the noise, and the whole ``d + 1``-vector is bounded by
    ``C_aug = sqrt(C^2 + s^2/4)`` (`dpfedavg.core.adaptive_clip`, Andrew et al. 2021, Algorithm 1).
    """
    u = np.atleast_2d(u)
    if len(rngs) != u.shape[0]:
        raise ValueError(f"one generator per client: {u.shape[0]} rows, {len(rngs)} generators")
    block = bound_block(u, algorithm=algorithm, clip=clip, count_scale=count_scale)
    g, count, norms, finite = block.g, block.count, block.norms, block.finite
    # each row becomes (g_i, s (b_i - 1/2)), one row at a time (no (B, d + 1) copy of the block)
    bound = augmented_bound(clip, count_scale) if count is not None else clip
    law = law if law is not None else noise_law(secure_aggregation=False)
    out: list[ClientUpdate | None] = []
    for row, rng in enumerate(rngs):
        if not finite[row]:
            out.append(None)
            continue
        g_row = g[row] if count is None else np.concatenate([g[row], count[row : row + 1]])
        noisy = law.add(g_row, bound, noise_std, rng)
        out.append(ClientUpdate(noisy=noisy, clean=g_row, update_norm=float(norms[row])))
    return out


def client_round_update(w: Vector, grad_fn: GradFn, ins: RoundInstructions, client_id: int) -> ClientUpdate:
    """`private_client_update()` with the round's instructions, noise from client ``client_id``'s stream."""
    return private_client_update(
        w,
        grad_fn,
        lr=ins.local_lr,
        num_steps=ins.local_steps,
        algorithm=ins.algorithm,
        clip=ins.clip,
        noise_std=ins.noise_std,
        rng=noise_rng(ins.noise_seed, client_id),
        law=round_noise_law(ins),
        count_scale=ins.count_scale,
    )


def round_block_update(u: np.ndarray, ins: RoundInstructions, client_ids: Sequence[int]) -> list[ClientUpdate | None]:
    """`private_block_update()` of a block of clients as the round's instructions say (Alg. 1 / 2 lines 9-10).

    The bound, noise std, noise law and count scale come from ``ins``; client ``i``'s noise from its own stream
    ``noise_rng(ins.noise_seed, i)``. Every engine and both ClientApps call this one.
    """
    return private_block_update(
        u,
        algorithm=ins.algorithm,
        clip=ins.clip,
        noise_std=ins.noise_std,
        rngs=[noise_rng(ins.noise_seed, int(cid)) for cid in client_ids],
        law=round_noise_law(ins),
        count_scale=ins.count_scale,
    )


def zero_updates(
    client_ids: Sequence[int], dim: int, ins: RoundInstructions, dtype: np.dtype | type = np.float64
) -> list[ClientUpdate]:
    """``0 + zeta`` for each of ``client_ids``, whose local training diverged: what a node under a policy sends.

    Whether local training diverges at the model and ``eta_k`` the server chose is a function of the node's data
    (gradient descent on a curvature ``L`` diverges for ``eta > 2 / L``): reported as an error it would leave the
    node without noise, one bit per round. Under a policy the update is ``u = 0`` instead (a bounded update like any
    other), noised as usual (`round_block_update()`, each client's noise its own), so the reply has the same form
    whatever the data. The one place a diverged update becomes the zero update (the ClientApp, its virtual clients
    and ``dp_mod`` call it).
    """
    updates = round_block_update(np.zeros((len(client_ids), dim), dtype=dtype), ins, client_ids)
    return [update for update in updates if update is not None]
