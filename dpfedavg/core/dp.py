"""Sensitivity bounding and Gaussian noise (Alg. 1/2, lines 9-10).

No Flower import. Every engine (Flower ClientApp, batched engine,
tests) calls these functions so the math lives in exactly one place. `clip()`, `normalize()` and
`bound_sensitivity()` take numpy arrays or torch tensors (`dpfedavg.core.arrays`: numpy computes a numpy
input, torch a tensor on its own device).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dpfedavg.core.arrays import as_array_like, copy, namespace, row_norms
from dpfedavg.core.types import Vector
from dpfedavg.errors import ConfigError, lookup

__all__ = [
    "ALGORITHMS",
    "BOUNDS",
    "SensitivityBound",
    "get_bound",
    "is_private_algorithm",
    "clip",
    "clip_factor",
    "normalize",
    "normalize_factor",
    "bound_sensitivity",
    "gaussian_noise",
    "server_noise_std",
]


def _check_scale(c: float | np.ndarray) -> None:
    if not np.all(np.asarray(c) > 0):
        raise ValueError(f"the clipping threshold / scaling factor C must be > 0, got {c!r}")


def _row_norms(u: Vector) -> Vector:
    """``||u||`` of a vector, or of each row of a matrix (kept as a trailing axis of size 1)."""
    return row_norms(u, keepdims=True)


def clip_factor(norm: Vector, c: float | np.ndarray) -> Vector:
    """``min(1, C / ||u||)`` per row, from ``norm`` (``||u||`` with a trailing axis of size 1): `clip()` is ``u``
    times it. ``c`` is a scalar or one ``C`` per run (shape ``(R, 1, 1)``)."""
    _check_scale(c)
    xp, c = namespace(norm), as_array_like(c, norm)
    return xp.where(norm > c, c / xp.where(norm > c, norm, 1.0), 1.0)


def normalize_factor(norm: Vector, c: float | np.ndarray) -> Vector:
    """``C / ||u||`` per row (0 for ``u = 0``), from ``norm`` as in `clip_factor()`: `normalize()` is ``u`` times it."""
    _check_scale(c)
    xp, c = namespace(norm), as_array_like(c, norm)
    return xp.where(norm > 0, c / xp.where(norm > 0, norm, 1.0), 0.0)


def clip(u: Vector, c: float | np.ndarray, norm: Vector | None = None) -> Vector:
    """Clip ``u`` to norm at most ``c``: ``clip(u, C) = u * min(1, C / ||u||)``.

    Paper eq. (clip-def), used in Alg. 1 line 9. ``clip(0, C) = 0``. A 2-D
    ``u`` is clipped row by row (one client update per row); a ``(R, B, d)`` block
    (runs x clients) row by row too, with ``c`` a scalar or one ``C`` per run of shape ``(R, 1, 1)``.
    ``norm``: ``||u||`` per row with a trailing axis of size 1, when the caller has it (else computed here).
    """
    return u * clip_factor(_row_norms(u) if norm is None else norm, c)


def normalize(u: Vector, c: float | np.ndarray, norm: Vector | None = None) -> Vector:
    """Scale ``u`` to norm exactly ``c``: ``norm(u, C) = C * u / ||u||`` (Alg. 2 line 9).

    The paper defines ``norm`` on ``R^d \\ {0}`` only. We define
    ``normalize(0, C) = 0``: it is finite (never NaN), it keeps the sensitivity
    bound ``||g|| <= C`` that the privacy analysis needs, and it is what
    ``clip`` returns for the zero update, so both algorithms agree on a client
    whose local steps did not move (e.g. it already sits at its optimum). A
    2-D ``u`` is normalized row by row, and so is a ``(R, B, d)`` block (``c`` and ``norm`` as in `clip()`).
    """
    return u * normalize_factor(_row_norms(u) if norm is None else norm, c)


@dataclass(frozen=True)
class SensitivityBound:
    """How an algorithm bounds a client's update before noise (Alg. 1 / Alg. 2 line 9).

    Attributes
    ----------
    name:
        The ``algorithm`` key's value.
    apply:
        ``(u, C[, norm]) -> g``, row-wise for a block of clients (``norm``: ``||u||`` per row, if known).
    factor:
        ``(norm, C) -> f``: ``g = u * f`` row by row (``f`` has ``norm``'s trailing axis of size 1); for a caller
        that needs only a weighted sum of the rows (`dpfedavg.core.runs.released_sums()`).
    private:
        ``True`` when ``||g|| <= C`` for every ``u``: the sum then has sensitivity ``C`` and the run is
        differentially private with noise; ``False`` (``none``) means no DP.
    title:
        How logs name the algorithm.
    adaptive:
        ``C`` is not fixed: it follows a quantile of the update norms (``adaptive-clip``, Andrew et al. 2021;
        `dpfedavg.core.adaptive_clip`). Each client then also reports whether it was clipped, as one
        extra, noised coordinate of its vector, and the server keeps ``C_k`` as state.
    """

    name: str
    apply: Callable[..., Vector]
    factor: Callable[[Vector, float | np.ndarray], Vector]
    private: bool
    title: str
    adaptive: bool = False


def _identity(u: Vector, c: float, norm: Vector | None = None) -> Vector:
    return copy(u)


def _unit_factor(norm: Vector, c: float | np.ndarray) -> Vector:
    return namespace(norm).ones_like(norm)


#: The algorithms (``algorithm`` key): adding one is one entry here.
BOUNDS: dict[str, SensitivityBound] = {
    b.name: b
    for b in (
        SensitivityBound("clip", clip, clip_factor, True, "DP-FedAvg (clipping, Alg. 1)"),
        SensitivityBound("norm", normalize, normalize_factor, True, "DP-NormFedAvg (Alg. 2)"),
        SensitivityBound("none", _identity, _unit_factor, False, "FedAvg (no DP)"),
        SensitivityBound(
            "adaptive-clip",
            clip,
            clip_factor,
            True,
            "DP-FedAvg with adaptive clipping (Andrew et al. 2021)",
            adaptive=True,
        ),
    )
}
ALGORITHMS: tuple[str, ...] = tuple(BOUNDS)


def get_bound(algorithm: str) -> SensitivityBound:
    """The `SensitivityBound` of ``algorithm``: the one lookup of `BOUNDS` (`ConfigError` naming the allowed ones)."""
    return lookup(BOUNDS, algorithm, key="algorithm", what="algorithm")


def is_private_algorithm(algorithm: str) -> bool:
    """Whether ``algorithm`` names a private bound; ``False`` for a name that is none (a node reading a server's
    instructions treats an unknown algorithm as one that sends its update without a bound or noise)."""
    try:
        return get_bound(algorithm).private
    except ConfigError:
        return False


def bound_sensitivity(u: Vector, algorithm: str, c: float, norm: Vector | None = None) -> Vector:
    """``g`` for the algorithm (`BOUNDS`): ``clip`` / ``adaptive-clip``, ``norm`` or ``none`` (``g = u``).

    ``norm``: ``||u||`` of each row with a trailing axis of size 1, when the caller computed it already.
    """
    return get_bound(algorithm).apply(u, c, norm)


def gaussian_noise(dim: int, std: float, rng: np.random.Generator, dtype: np.dtype | type = np.float64) -> Vector:
    """Draw ``zeta ~ N(0, std^2 I_dim)`` from the explicit generator ``rng``.

    ``std = 0`` returns exact zeros without consuming randomness.
    """
    if std < 0:
        raise ValueError(f"noise std must be >= 0, got {std!r}")
    if std == 0.0:
        return np.zeros(dim, dtype=dtype)
    return (rng.standard_normal(dim) * std).astype(dtype, copy=False)


def server_noise_std(noise_multiplier: float, c: float, clients_per_round: float) -> float:
    """``sigma = z C / r``: the std of the noise in the *average* ``a_k`` (Alg. 1 line 12).

    ``z`` is the noise multiplier: std of the noise in the *sum* divided by the
    sensitivity ``C`` of the sum.
    """
    return noise_multiplier * c / clients_per_round
