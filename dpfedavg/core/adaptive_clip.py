"""Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy 2021) as one Gaussian mechanism on an augmented vector.

"Differentially private learning with adaptive clipping" (NeurIPS 2021), Algorithm 1 and Theorem 1. The
clipping threshold ``C_k`` follows the target quantile ``gamma`` of the clients' update norms by the geometric
rule

    C_{k+1} = C_k exp(-eta_C (b_k - gamma)),

where ``b_k`` is a *private* estimate of the fraction of sampled clients whose update was not clipped,
``||u_i|| <= C_k``.

**The released statistic.** Each sampled client ``i`` contributes ``b_i - 1/2`` with ``b_i = 1[||u_i|| <= C_k]``,
i.e. ``+-1/2`` (Andrew et al., proof of Theorem 1): adding or removing one client moves the sum by at most
``1/2``. (A ``{0, 1}`` indicator has sensitivity 1, and the noise split below would then under-count the
privacy loss.) The round releases

    T_k = sum_{i included} (b_i - 1/2) + N(0, sigma_b^2),      b_k = 1/2 + T_k / r,

with the fixed denominator ``r`` (the expected cohort, Alg. 1 line 12's); ``|S_k|`` itself is never used, it
is not private under add/remove. ``E[b_k]`` is the fraction of unclipped updates when ``|S_k| = r``.

**The noise split** (Theorem 1). The update sum carries ``N(0, (z_u C_k)^2 I)`` and the count ``N(0, sigma_b^2)``
with ``z_u = (z^-2 - (2 sigma_b)^-2)^(-1/2)``: whitened, one client moves the pair by
``sqrt((C / (z_u C))^2 + ((1/2) / sigma_b)^2) = 1/z``, so the round is *one* Gaussian mechanism with noise
multiplier ``z`` and the accountant (``PoissonSampled(q, Gaussian(z))``) is unchanged.

**How it is released.** The count rides as one extra coordinate of the clients' vector, scaled by
``s = z_u C / sigma_b`` so that every coordinate needs the same noise std:

    g_aug = (g, s (b_i - 1/2)),    ||g_aug|| <= C_aug = sqrt(C^2 + s^2 / 4),

and the ``d + 1``-vector goes through the unchanged machinery with ``C_aug`` in place of ``C``: the noise
placement (`dpfedavg.core.mechanism`: each client's share, the server's top-up, the central noise), the
secure-aggregation encoding (`dpfedavg.core.secagg`: conditional rounding keeps ``||g~_aug|| <= C_aug``)
and the fixed denominator. The sum then carries ``N(0, (z C_aug)^2 I_{d+1})`` and ``z C_aug = z_u C``
exactly, so the update part has std ``z_u C`` and the count, divided by ``s``, std ``sigma_b``. Without noise
(``z = 0``) the count is exact and ``s = C`` (any positive scale would do).

Pure numpy, no Flower.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from dpfedavg.core.arrays import as_array_like, astype, namespace
from dpfedavg.core.types import Vector

__all__ = [
    "DEFAULT_CLIP_LR",
    "DEFAULT_TARGET_QUANTILE",
    "COUNT_STDDEV_PER_EXPECTED_CLIENT",
    "AdaptiveClip",
    "augmented_bound",
    "count_coordinate",
    "count_scale",
    "AUTO_COUNT_NOISE_INFLATION",
    "auto_count_stddev",
    "count_stddev_for_inflation",
    "default_count_stddev",
    "min_count_stddev",
    "next_clip",
    "update_noise_multiplier",
]

logger = logging.getLogger(__name__)

#: gamma: the median of the update norms (Andrew et al. 2021, §4).
DEFAULT_TARGET_QUANTILE = 0.5
#: eta_C, the geometric step (Andrew et al. 2021 use 0.2).
DEFAULT_CLIP_LR = 0.2
#: sigma_b = r / 20, Andrew et al. 2021's recommendation (the noisy fraction has std 0.05).
COUNT_STDDEV_PER_EXPECTED_CLIENT = 1.0 / 20.0


def default_count_stddev(clients_per_round: float) -> float:
    """``sigma_b = r / 20`` (Andrew et al. 2021, §4)."""
    return COUNT_STDDEV_PER_EXPECTED_CLIENT * clients_per_round


def min_count_stddev(noise_multiplier: float) -> float:
    """What ``sigma_b`` must exceed for ``z_u`` to exist: ``z^-2 > (2 sigma_b)^-2``, i.e. ``sigma_b > z/2``."""
    return noise_multiplier / 2.0


#: ``clip-count-stddev = "auto"``: the count's noise may cost the update this factor more noise, ``z_u = 1.1 z``.
AUTO_COUNT_NOISE_INFLATION = 1.1


def auto_count_stddev(noise_multiplier: float, clients_per_round: float) -> float:
    """``clip-count-stddev = "auto"``: ``max(r/20, the sigma_b for which z_u = 1.1 z)``, valid for every ``z``.

    Andrew et al. 2021 recommend ``sigma_b = r/20``, which is only allowed when ``sigma_b > z/2``
    (``z < r/10``); at the paper's noise levels it is not. The second term always is: it is the
    ``sigma_b`` at which splitting off the count raises the update's noise multiplier by 10%
    (`count_stddev_for_inflation()`). Without noise (``z = 0``) it is ``r/20``.
    """
    sigma_b = default_count_stddev(clients_per_round)
    if noise_multiplier > 0:
        sigma_b = max(sigma_b, count_stddev_for_inflation(noise_multiplier, AUTO_COUNT_NOISE_INFLATION))
    return float(sigma_b)


def update_noise_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """``z_u = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` (Andrew et al. 2021, Theorem 1); 0 when ``z = 0``.

    Raises ``ValueError`` when it is undefined (``sigma_b <= z / 2``: the count alone would spend more than
    the round's whole budget).
    """
    z, sigma_b = noise_multiplier, count_stddev
    if z < 0 or not sigma_b > 0:
        raise ValueError(f"need z >= 0 and sigma_b > 0, got z={z!r}, sigma_b={sigma_b!r}")
    if z == 0:
        return 0.0
    rest = z**-2 - (2.0 * sigma_b) ** -2
    if not rest > 0:
        raise ValueError(f"z_u is undefined: sigma_b = {sigma_b:g} <= z/2 = {z / 2:g}")
    return rest**-0.5


def count_stddev_for_inflation(noise_multiplier: float, inflation: float) -> float:
    """The ``sigma_b`` for which ``z_u = inflation * z`` (``inflation > 1``): ``z / (2 sqrt(1 - inflation^-2))``."""
    if not inflation > 1:
        raise ValueError(f"inflation must be > 1, got {inflation!r}")
    return noise_multiplier / (2.0 * math.sqrt(1.0 - inflation**-2))


def count_scale(noise_multiplier: float, clip: float, count_stddev: float) -> float:
    """``s = z_u C / sigma_b``: the count coordinate.s scale: it needs the update's noise std (``C`` if ``z = 0``)."""
    z_u = update_noise_multiplier(noise_multiplier, count_stddev)
    return z_u * clip / count_stddev if z_u > 0 else clip


def augmented_bound(clip: float, scale: float) -> float:
    """``C_aug = sqrt(C^2 + s^2 / 4)``: the norm bound of ``(g, s (b - 1/2))`` with ``||g|| <= C``."""
    return math.hypot(clip, scale / 2.0)


def count_coordinate(update_norms: np.ndarray, clip: float, scale: float) -> np.ndarray:
    """``s (b_i - 1/2)`` per client, ``b_i = 1[||u_i|| <= C]`` (the client's side of Algorithm 1).

    ``update_norms`` are the ``||u_i||`` before clipping (a numpy array or a tensor, `dpfedavg.core.arrays`);
    each client appends its value to its clipped ``g_i``.
    """
    xp = namespace(update_norms)
    norms = update_norms if xp is not np else np.asarray(update_norms, dtype=np.float64)
    unclipped = astype(norms <= as_array_like(clip, norms), norms.dtype)
    return as_array_like(scale, norms) * (unclipped - 0.5)


def next_clip(clip: float, unclipped_fraction: float, target_quantile: float, clip_lr: float) -> float:
    """``C_{k+1} = C_k exp(-eta_C (b_k - gamma))`` (Andrew et al. 2021, Algorithm 1, geometric update)."""
    return clip * math.exp(-clip_lr * (unclipped_fraction - target_quantile))


@dataclass
class AdaptiveClip:
    """The server's adaptive-clipping state: ``C_k`` and the settings of the rule (one per run).

    Attributes
    ----------
    clip:
        ``C_k``, the threshold of the next round (``C_0`` = the ``clip`` key).
    target_quantile, clip_lr, count_stddev:
        ``gamma``, ``eta_C``, ``sigma_b``.
    noise_multiplier:
        ``z`` of the round as a whole (what the accountant charges).
    """

    clip: float
    target_quantile: float
    clip_lr: float
    count_stddev: float
    noise_multiplier: float
    #: ``C_k`` never leaves ``[clip_floor, clip_ceiling]`` (the ``clip-range-factor`` key: ``C_0 / F``, ``C_0 F``):
    #: the released count ``T_k`` carries Gaussian noise and, without secure aggregation, whatever a client sent
    #: that passed the server's plausibility checks, so the rule alone could drive ``C_k`` to 0 (then ``s = 0``
    #: and `split()` divides by it) or to infinity.
    clip_floor: float = 0.0
    clip_ceiling: float = math.inf

    @property
    def update_noise_multiplier(self) -> float:
        """``z_u`` (Theorem 1)."""
        return update_noise_multiplier(self.noise_multiplier, self.count_stddev)

    @property
    def scale(self) -> float:
        """``s`` of the current round."""
        return count_scale(self.noise_multiplier, self.clip, self.count_stddev)

    @property
    def augmented_clip(self) -> float:
        """``C_aug``: the sensitivity of the released ``d + 1``-sum, the ``C`` the noise placement sees."""
        return augmented_bound(self.clip, self.scale)

    def split(self, total: Vector) -> tuple[Vector, float]:
        """The released ``d + 1``-sum as ``(update sum, T_k)``, ``T_k = `` the last coordinate ``/ s``."""
        return total[:-1], float(total[-1]) / self.scale

    def step(self, released_count: float, clients_per_round: float) -> tuple[float, float]:
        """Close a round: ``b_k = 1/2 + T_k / r`` and ``C_{k+1}``; returns ``(C_k, b_k)`` and moves to ``C_{k+1}``."""
        b = 0.5 + released_count / clients_per_round
        used = self.clip
        try:
            rule = next_clip(used, b, self.target_quantile, self.clip_lr)
        except OverflowError:  # exp of a huge released count
            rule = math.inf
        self.clip = min(max(rule, self.clip_floor), self.clip_ceiling)
        if self.clip != rule:
            logger.warning(
                "adaptive-clip: the rule gives C = %.4g (b_k = %.4g); C stays at its %s %.4g (clip-range-factor)",
                rule,
                b,
                "floor" if self.clip > rule else "ceiling",
                self.clip,
            )
        return used, b
