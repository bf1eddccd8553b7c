"""Noise laws: what a client adds to its bounded update ``g`` (Alg. 1 line 10) and what the law adds to the guarantee.

A noise law is the third kind of privacy-mechanism object, beside the sensitivity bounds
(`dpfedavg.core.dp.BOUNDS`: what ``g`` is) and the noise placements
(`dpfedavg.core.mechanism.PLACEMENTS`: who adds how much). Each law owns, in one place,

* `NoiseLaw.add()`: ``g -> g + zeta`` with ``zeta`` of the per-client std the placement chose (the Gaussian
  law through `add_gaussian()`, the one place every engine adds Gaussian noise), and
* `NoiseLaw.privacy_terms()`: how far the released sum is from the Gaussian mechanism
  ``N(0, (zC)^2 I)`` the accountant charges (``tau``, the clipping probability, the resulting delta).

Two laws ship (`NOISE_LAWS`):

``gaussian``
    ``zeta ~ N(0, s^2 I)``; the released sum *is* the accountant's Gaussian mechanism, so the terms are zero.
``discrete-gaussian``
    Secure aggregation (`dpfedavg.core.secagg`): ``g`` rounded to the round's integer grid, discrete Gaussian
    noise on it, coordinates clipped to ``[-c, c]``; its terms come from
    `dpfedavg.core.secagg.privacy_terms()` (Kairouz, Liu, Steinke 2021).

A run uses the law `noise_law()` names for its config; a client builds the round's law from its
instructions (`round_noise_law()`), so every engine adds noise through the same object.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from dpfedavg.core.arrays import on_device_of
from dpfedavg.core.secagg import SecAggGrid, SecAggPrivacyTerms, encode, privacy_terms
from dpfedavg.core.types import RoundInstructions, Vector

__all__ = [
    "NOISE_LAWS",
    "DiscreteGaussianLaw",
    "GaussianLaw",
    "NoiseLaw",
    "add_gaussian",
    "noise_law",
    "round_noise_law",
]

logger = logging.getLogger(__name__)


class NoiseLaw(Protocol):
    """What a client adds to ``g`` and what that adds to the run's ``(epsilon, delta)``."""

    name: ClassVar[str]

    def add(self, g: Vector, clip: float, noise_std: float, rng: np.random.Generator) -> Vector:
        """``g + zeta`` (Alg. 1 line 10) with ``zeta`` of per-coordinate std ``noise_std`` drawn from ``rng``."""

    def privacy_terms(self, *, delta: float, **terms: Any) -> SecAggPrivacyTerms:
        """How the released sum departs from the Gaussian mechanism the accountant charges (zero for ``gaussian``).

        The keywords are `dpfedavg.core.secagg.privacy_terms()`'s (the run's ``C``, ``z``, the grid's settings,
        ``n``, ``d``, ``K``, ``(epsilon, delta)``).
        """


def add_gaussian(
    g: Any,
    std: float | np.ndarray,
    normals: np.ndarray | np.floating | None = None,
    *,
    rng: np.random.Generator | None = None,
    scale_in_place: bool = False,
) -> Any:
    """``g + zeta`` with ``zeta = z * std`` (Alg. 1 / Alg. 2 line 10): the one place Gaussian noise is added.

    ``g`` is an array of any array-API library (a numpy vector or block on the host, a torch block on its
    device; ``(..., d)``). ``z`` are standard normals on the host, in float64: ``normals`` drawn beforehand
    (a block's rows, one client's row, or the sum of the rows a sweep's runs share: `dpfedavg.core.runs`), or
    ``rng.standard_normal(d)`` from ``rng``. ``std`` is a float or host array broadcasting against ``z`` (one
    std per run of a sweep).
    ``zeta`` is formed on the host in float64, cast once to ``g``'s dtype and device, and added: every path
    adds, element for element, the same numbers from the same draws (the run axis adds ``s`` times their sum to
    the sum of the ``g``: the same sum, rounded differently).

    With ``rng``, ``std = 0`` draws nothing and adds zeros (`dpfedavg.core.dp.gaussian_noise()`); without
    ``rng`` and ``normals`` (a round without client noise) ``g`` is returned as it is. ``scale_in_place``
    lets ``normals`` (the caller's fresh draws) be overwritten by ``zeta``: no second block in memory.
    """
    if rng is not None:
        if np.any(np.asarray(std) < 0):
            raise ValueError(f"noise std must be >= 0, got {std!r}")
        normals = rng.standard_normal(g.shape[-1]) if np.any(np.asarray(std) != 0) else np.zeros(g.shape[-1])
    if normals is None:
        return g
    zeta = np.multiply(normals, std, out=normals if scale_in_place else None)
    if isinstance(g, np.ndarray) and zeta is not normals and zeta.shape == g.shape and zeta.dtype == g.dtype:
        return np.add(g, zeta, out=zeta)  # the same sums, into zeta's fresh block (no second block of d values)
    return g + on_device_of(zeta, g)


@dataclass(frozen=True)
class GaussianLaw:
    """``zeta ~ N(0, s^2 I)``: the released sum carries exactly the accountant's ``N(0, (zC)^2 I)``."""

    name: ClassVar[str] = "gaussian"

    def add(self, g: Vector, clip: float, noise_std: float, rng: np.random.Generator) -> Vector:
        return add_gaussian(g, noise_std, rng=rng)

    def privacy_terms(self, *, delta: float, **terms: Any) -> SecAggPrivacyTerms:
        return SecAggPrivacyTerms(tau=0.0, tau_slack=0.0, clip_probability=0.0, delta_including_clipping=delta)


@dataclass(frozen=True)
class DiscreteGaussianLaw:
    """Secure aggregation's law: ``g`` on the round's integer ``grid`` plus discrete Gaussian noise on it.

    ``grid`` is the round's grid (a client gets step and range in its instructions); the server-side
    `privacy_terms()` needs none (it derives the worst-case grid at ``|S_k| = n`` itself).
    """

    grid: SecAggGrid | None = None
    name: ClassVar[str] = "discrete-gaussian"

    def add(self, g: Vector, clip: float, noise_std: float, rng: np.random.Generator) -> Vector:
        if self.grid is None:
            raise ValueError("the discrete Gaussian law adds noise on a round's grid; build it with the round's grid")
        noisy, clipped = encode(g, self.grid, clip, noise_std, rng)
        if clipped:
            logger.warning("%d coordinates of g + zeta fell outside the secure-aggregation range: clipped", clipped)
        return noisy

    def privacy_terms(self, *, delta: float, **terms: Any) -> SecAggPrivacyTerms:
        return privacy_terms(delta=delta, **terms)


#: name -> the law (a run's law is chosen by `noise_law()`).
NOISE_LAWS: dict[str, NoiseLaw] = {GaussianLaw.name: GaussianLaw(), DiscreteGaussianLaw.name: DiscreteGaussianLaw()}


def noise_law(secure_aggregation: bool) -> NoiseLaw:
    """The run's law: ``discrete-gaussian`` under secure aggregation, ``gaussian`` otherwise.

    The one lookup of `NOISE_LAWS` (a run names its law through ``secure-aggregation``, not by name).
    """
    return NOISE_LAWS[DiscreteGaussianLaw.name if secure_aggregation else GaussianLaw.name]


def round_noise_law(ins: RoundInstructions) -> NoiseLaw:
    """The law a client applies in the round its instructions describe.

    With secure aggregation the instructions carry the round's grid step and range; a client only
    needs those to encode (the modulus is the protocol's, set by the server in the SecAgg+ setup stage,
    so it is 0 here).
    """
    if ins.secagg_step <= 0:
        return noise_law(secure_aggregation=False)
    levels = round(2 * ins.secagg_range / ins.secagg_step)
    grid = SecAggGrid(step=ins.secagg_step, clipping_range=ins.secagg_range, levels=levels, modulus=0)
    return DiscreteGaussianLaw(grid)
