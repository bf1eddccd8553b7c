"""What an honest client's reply can look like: the server's plausibility bounds (issue 29).

Without secure aggregation the server sees each sampled client's ``y = g + zeta`` with ``||g|| <= C`` (``C_aug``
with adaptive clipping) and ``zeta`` of per-coordinate std ``s`` (the client's share, `dpfedavg.core.mechanism`).
A reply no honest client sends except with probability below ``p`` is rejected, and the server's top-up
replaces its noise share, so the released sum still carries ``N(0, (zC)^2 I)`` and the accounted epsilon is
unchanged. The bound (`norm_bound()`), for ``N`` clients' sum (``N = 1`` for one reply):

    ||y|| <= N C (1 + 1e-5) + sqrt(N) s (sqrt(d) + sqrt(2 ln(1/p)))

Proof: ``||y|| <= ||sum g|| + ||sum zeta|| <= N C + ||sum zeta||``; ``sum zeta`` is ``sqrt(N) s``-sub-Gaussian (a
Gaussian, or the discrete Gaussians of secure aggregation, Canonne, Kamath, Steinke 2020, Prop. 25), and for a
``sigma``-sub-Gaussian vector ``P(||X||^2 > sigma^2 (d + 2 sqrt(d t) + 2 t)) <= e^-t`` (Hsu, Kakade, Zhang 2012,
Thm. 1), with ``d + 2 sqrt(d t) + 2 t <= (sqrt(d) + sqrt(2 t))^2``; ``t = ln(1/p)``. The ``1e-5`` absorbs the
rounding of a float32 clip (`FLOAT_SLACK`). ``tests/test_hostile_replies.py`` checks it against scipy's chi
distribution. Adaptive clipping's count coordinate ``s_b (b - 1/2) + N(0, s^2)`` gets its own two-sided bound
(`count_bound()`): ``|y_last| <= N s_b / 2 + sqrt(N) s sqrt(2 ln(2/p))``.

**What the bound costs the guarantee.** A rejected honest reply changes what is released; that happens with
probability at most ``K n p`` over a run (``K`` rounds, at most ``n`` replies each), so the run is
``(epsilon, delta + (1 + e^epsilon) K n p)``-DP. `false_rejection_probability()` picks
``p = min(1e-9, 1e-3 delta / ((1 + e^epsilon) K n))``: the added delta is at most a thousandth of delta (the same
slack as secure aggregation's clipping, `dpfedavg.privacy.secure_aggregation.MAX_DELTA_SLACK`).

**What one client can still do.** Without secure aggregation: send any vector inside the bound, moving the
sum by at most ``C + s (sqrt(d) + sqrt(2 ln(1/p)))`` instead of ``C`` (its noise share is its own to misreport).
Under secure aggregation the server sees only the sum, and one client's masked vector may hold any value
mod ``M``, which can move each coordinate of the decoded sum anywhere in the protocol's range (``M`` grid steps);
a sum outside the bound for its ``N`` contributors is therefore skipped as a whole (the round releases the
server's noise only, with the reason in the log), so one client moves an accepted sum by at most about
``2 N C + 2 sqrt(N) s (sqrt(d) + sqrt(2 ln(1/p)))``, and nobody can tell which client it was. The honest
clients' privacy never depends on any of this (their noise is in the sum); the model's quality does.

Pure Python; no Flower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DELTA_SLACK",
    "FLOAT_SLACK",
    "MAX_FALSE_REJECTION",
    "ReplyLimits",
    "count_bound",
    "false_rejection_probability",
    "norm_bound",
    "reply_limits",
]

#: The largest probability that an honest reply is rejected (issue 29's 1e-9).
MAX_FALSE_REJECTION = 1e-9
#: The run's delta grows by at most this fraction of delta through false rejections.
DELTA_SLACK = 1e-3
#: Relative slack on the bound ``C`` for floating-point rounding (a float32 clip, a norm summed in float32).
FLOAT_SLACK = 1e-5


def false_rejection_probability(
    *, epsilon: float, rounds: int, num_clients: int, delta: float, slack: float = DELTA_SLACK
) -> float:
    """``p = min(1e-9, slack delta / ((1 + e^epsilon) K n))`` (computed in logs: any epsilon works)."""
    log_p = math.log(slack * delta) - np.logaddexp(0.0, epsilon) - math.log(rounds * num_clients)
    return float(min(MAX_FALSE_REJECTION, math.exp(log_p)))


def _tail(p: float) -> float:
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p!r}")
    return math.sqrt(2.0 * math.log(1.0 / p))


def norm_bound(bound: float, noise_std: float, dim: int, p: float, clients: int = 1) -> float:
    """``N C (1 + 1e-5) + sqrt(N) s (sqrt(d) + sqrt(2 ln(1/p)))``: ``N`` honest clients' sum exceeds it w.p. ``< p``."""
    return clients * bound * (1 + FLOAT_SLACK) + math.sqrt(clients) * noise_std * (math.sqrt(dim) + _tail(p))


def count_bound(scale: float, noise_std: float, p: float, clients: int = 1) -> float:
    """``N s_b / 2 (1 + 1e-5) + sqrt(N) s sqrt(2 ln(2/p))``: bounds ``|count coordinate|`` except w.p. ``< p``."""
    return clients * scale / 2 * (1 + FLOAT_SLACK) + math.sqrt(clients) * noise_std * _tail(p / 2)


@dataclass(frozen=True)
class ReplyLimits:
    """The bounds one round's vectors (a reply, or the secure sum of ``N``) must satisfy."""

    norm: float
    count: float | None = None

    def violation(self, vector: np.ndarray) -> str | None:
        """Why ``vector`` is implausible, or ``None``."""
        norm = float(np.linalg.norm(vector))
        if not norm <= self.norm:
            return f"implausible: norm {norm:.6g} exceeds {self.norm:.6g} (an honest reply does w.p. < p)"
        count = float(vector[-1])
        if self.count is not None and not abs(count) <= self.count:
            return f"implausible: adaptive clipping's count coordinate {count:.6g} is outside +-{self.count:.6g}"
        return None


def reply_limits(
    *, bound: float, noise_std: float, dim: int, p: float, count_scale: float | None = None, clients: int = 1
) -> ReplyLimits:
    """The `ReplyLimits` of ``clients`` honest replies' sum (``dim`` includes adaptive clipping's count)."""
    count = count_bound(count_scale, noise_std, p, clients) if count_scale is not None else None
    return ReplyLimits(norm_bound(bound, noise_std, dim, p, clients), count)
