"""Privacy accounting with dp-accounting: per-round Poisson-subsampled Gaussian events.

The privacy unit is one client's whole dataset (add/remove one client, as in
the paper). In round ``k`` every client is sampled with probability ``q = r/n``
and the released sum ``sum_{i in S_k} g_i + noise`` has sensitivity ``C``
(for ``clip`` and for ``norm``: ``||g_i|| <= C``), so one round is the
mechanism ``PoissonSampledDpEvent(q, GaussianDpEvent(z_k))`` with ``z_k`` the
std of the noise in the released sum divided by ``C``. Rounds compose.

``z_k`` is the noise multiplier the released sum carried (see
:func:`realized_noise_multiplier`): the server tops up the noise of sampled
clients whose update did not enter the sum, so it is the nominal ``z`` in
every round of every placement, and the epsilon after ``k`` rounds is known
before the run starts. Both dp-accounting accountants are supported:

* ``pld``: privacy loss distributions (tight). Consecutive rounds with the same
  event are composed as one self-composed run, exactly as dp-accounting's
  ``PLDAccountant`` does for ``SelfComposedDpEvent``; the discretization
  interval is :data:`PLD_DISCRETIZATION` (pessimistic, so a valid upper bound).
* ``rdp``: Rényi DP over dp-accounting's default orders (looser, fast).

The noise multiplier for a target ``(epsilon, delta)`` is found by bisection
with this same accountant, so a run whose rounds all carry the nominal noise
ends exactly at or below the target.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

import dp_accounting
import numpy as np
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant

from dpfedavg.config import ACCOUNTANTS, NOISE_PLACEMENTS, ConfigError, RunConfig
from dpfedavg.core.adaptive_clip import min_count_stddev
from dpfedavg.core.dp import get_bound
from dpfedavg.core.mechanism import get_placement
from dpfedavg.privacy.cache import cached

__all__ = [
    "ACCOUNTANTS",
    "NOISE_PLACEMENTS",
    "PLD_DISCRETIZATION",
    "RoundEvent",
    "RoundAccountant",
    "calibrate_noise_multiplier",
    "smallest_noise_multiplier",
    "epsilon_for",
    "realized_noise_multiplier",
    "paper_sigma",
    "PrivacyPlan",
    "plan_privacy",
]


#: PLD value discretization. 1e-3 gives the same epsilon as 1e-4 to 4 digits on
#: the paper's settings at a tenth of the cost (measured, see BENCHMARKS.md).
PLD_DISCRETIZATION = 1e-3


class _DropUnconvergedOrders(logging.Filter):
    """dp-accounting logs a WARNING per fractional RDP order whose series does not converge
    (it then excludes that order, which only loosens the bound). Keep the log readable."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


logging.getLogger("absl").addFilter(_DropUnconvergedOrders())


@dataclass(frozen=True)
class RoundEvent:
    """One round's mechanism: Poisson sampling with ``q``, Gaussian noise with multiplier ``z``.

    ``z = None`` means the round released nothing that depends on any client
    (no client's update entered the output), a no-op for privacy. ``z = 0``
    means updates were released without noise: epsilon is infinite.
    """

    q: float
    z: float | None

    def __post_init__(self) -> None:
        if not 0.0 <= self.q <= 1.0:
            raise ValueError(f"sampling probability q must be in [0, 1], got {self.q!r}")
        if self.z is not None and not self.z >= 0:
            raise ValueError(f"noise multiplier must be >= 0, got {self.z!r}")

    @property
    def is_noop(self) -> bool:
        return self.z is None or self.q == 0.0

    def dp_event(self) -> dp_accounting.DpEvent:
        """The dp-accounting event of this round."""
        if self.is_noop:
            return dp_accounting.NoOpDpEvent()
        gaussian = dp_accounting.GaussianDpEvent(self.z)
        return gaussian if self.q == 1.0 else dp_accounting.PoissonSampledDpEvent(self.q, gaussian)


def realized_noise_multiplier(
    placement: str,
    noise_multiplier: float,
    clients_per_round: float,
    num_sampled: int,
    num_included: int,
) -> float | None:
    """The noise multiplier a round's released sum carried: the placement's accounted ``z_k``.

    Every placement a config can select tops up the noise of the sampled
    clients whose update did not enter the sum (see
    :mod:`dpfedavg.core.mechanism`), so this is always the nominal ``z``: the
    noise never depends on who took part, and every round is charged the same
    event. (``legacy-client``, the old mis-accounted ``client`` placement kept for
    the privacy auditor's tests, returns ``z sqrt(m / r)`` and ``None`` for an
    empty sum.)
    """
    return get_placement(placement).accounted_noise_multiplier(
        noise_multiplier, clients_per_round, num_sampled, num_included
    )


@lru_cache(maxsize=256)
def _event_rdp(q: float, z: float) -> np.ndarray:
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(RoundEvent(q, z).dp_event())
    return accountant.rdp


_RDP_ORDERS = rdp_privacy_accountant.RdpAccountant().orders


@lru_cache(maxsize=256)
def _event_pld(q: float, z: float) -> pld_lib.PrivacyLossDistribution:
    return pld_lib.from_gaussian_mechanism(
        standard_deviation=z,
        sampling_prob=q,
        value_discretization_interval=PLD_DISCRETIZATION,
    )


def _run_pld(event: RoundEvent, count: int) -> pld_lib.PrivacyLossDistribution:
    """``count`` rounds of ``event`` as one PLD, as ``PLDAccountant`` composes ``SelfComposedDpEvent``."""
    assert event.z is not None and event.z > 0
    if event.q == 1.0:  # Gaussian composition is exact: z / sqrt(count)
        return pld_lib.from_gaussian_mechanism(
            standard_deviation=event.z / math.sqrt(count),
            value_discretization_interval=PLD_DISCRETIZATION,
        )
    return _event_pld(event.q, event.z).self_compose(count)


@dataclass
class RoundAccountant:
    """Composes one :class:`RoundEvent` per round and reports epsilon for ``delta``.

    Composing is cheap; epsilon is computed when asked for (and cached until
    the next round), so a caller that needs it only at the end pays once.

    Attributes
    ----------
    history:
        Every composed round, in order (enough to rebuild the accountant).
    """

    kind: str
    delta: float
    history: list[RoundEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in ACCOUNTANTS:
            raise ValueError(f"unknown accountant {self.kind!r}; allowed: {', '.join(ACCOUNTANTS)}")
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta must be in (0, 1), got {self.delta!r}")
        events, self.history = list(self.history), []
        self._non_private = False
        self._rdp = np.zeros_like(_RDP_ORDERS, dtype=np.float64)
        self._pld_base: pld_lib.PrivacyLossDistribution | None = None  # all runs but the last
        self._last: RoundEvent | None = None  # the current run of identical events ...
        self._last_count = 0  # ... and its length
        self._cached: tuple[int, float] | None = None  # (rounds, epsilon)
        for event in events:
            self.add(event)

    # ----------------------------------------------------------------- state
    @property
    def epsilon(self) -> float:
        """Epsilon spent so far (``inf`` after a round without noise, 0 before any round)."""
        if self._cached is None or self._cached[0] != len(self.history):
            self._cached = (len(self.history), self._epsilon_of(self._pld_base, self._last, self._last_count))
        return self._cached[1]

    @property
    def rounds(self) -> int:
        return len(self.history)

    def compose(self, event: RoundEvent, count: int = 1) -> float:
        """Add ``count`` rounds of ``event``; return the epsilon spent after them."""
        self.add(event, count)
        return self.epsilon

    def epsilon_after(self, event: RoundEvent, count: int = 1) -> float:
        """The epsilon that composing ``event`` would give, without composing it."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if event.is_noop:
            return self.epsilon
        if self._non_private or event.z == 0:
            return math.inf
        if self.kind == "rdp":
            return self._rdp_epsilon(self._rdp + count * _event_rdp(event.q, event.z))
        base, last, last_count = self._pld_base, self._last, self._last_count
        if last is not None and last != event:
            base, last_count = self._fold(base, last, last_count), 0
        return self._epsilon_of(base, event, last_count + count)

    # -------------------------------------------------------------- internals
    def add(self, event: RoundEvent, count: int = 1) -> None:
        """Add ``count`` rounds of ``event`` without computing epsilon (cheap)."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self.history.extend([event] * count)
        if event.is_noop:
            return
        if event.z == 0:
            self._non_private = True
        elif self.kind == "rdp":
            self._rdp = self._rdp + count * _event_rdp(event.q, event.z)
        elif self._last == event:
            self._last_count += count
        else:
            if self._last is not None:
                self._pld_base = self._fold(self._pld_base, self._last, self._last_count)
            self._last, self._last_count = event, count

    @staticmethod
    def _fold(base, event: RoundEvent, count: int):
        run = _run_pld(event, count)
        return run if base is None else base.compose(run)

    def _rdp_epsilon(self, rdp: np.ndarray) -> float:
        if not np.any(rdp):
            return 0.0
        eps, _ = rdp_privacy_accountant.compute_epsilon(_RDP_ORDERS, rdp, self.delta)
        return float(eps)

    def _epsilon_of(self, base, last: RoundEvent | None, count: int) -> float:
        if self._non_private:
            return math.inf
        if self.kind == "rdp":
            return self._rdp_epsilon(self._rdp)
        if last is None or count == 0:
            return 0.0 if base is None else float(base.get_epsilon_for_delta(self.delta))
        if base is None:  # one run of identical events (every round at the nominal z): cached (privacy.cache)
            return cached(
                "pld-epsilon",
                (last.q, last.z, count, self.delta, PLD_DISCRETIZATION),
                lambda: float(_run_pld(last, count).get_epsilon_for_delta(self.delta)),
            )
        total = self._fold(base, last, count)
        return float(total.get_epsilon_for_delta(self.delta))


def epsilon_for(noise_multiplier: float, q: float, rounds: int, delta: float, kind: str) -> float:
    """Epsilon after ``rounds`` rounds that all carry the nominal noise ``z``."""
    if rounds == 0:
        return 0.0
    return RoundAccountant(kind, delta).compose(RoundEvent(q, noise_multiplier), rounds)


def smallest_noise_multiplier(
    epsilon_of: Callable[[float], float], epsilon: float, rel_tol: float = 1e-3, what: str = ""
) -> float:
    """The smallest ``z`` (to ``rel_tol`` relative) with ``epsilon_of(z) <= epsilon``; ``epsilon_of`` decreasing.

    Bisection on ``z``: the returned ``z`` always satisfies the target, and ``z * (1 - rel_tol)`` may
    not. Raises ``ValueError`` (naming ``what``) when ``epsilon <= 0`` or no ``z`` below 1e6 reaches it.
    """
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon!r}")
    lo, hi = 0.0, 1.0
    while epsilon_of(hi) > epsilon:
        lo, hi = hi, 2.0 * hi
        if hi > 1e6:
            raise ValueError(f"no noise multiplier below 1e6 reaches epsilon={epsilon}{what}")
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        if epsilon_of(mid) > epsilon:
            lo = mid
        else:
            hi = mid
    return hi


@lru_cache(maxsize=64)
def calibrate_noise_multiplier(
    epsilon: float, delta: float, q: float, rounds: int, kind: str, rel_tol: float = 1e-3
) -> float:
    """The smallest ``z`` (to ``rel_tol`` relative) with ``epsilon_for(z) <= epsilon``.

    Bisection on ``z`` with :func:`epsilon_for` (:func:`smallest_noise_multiplier`): the returned
    ``z`` always satisfies the target, and ``z * (1 - rel_tol)`` may not. Computed once per
    ``(epsilon, delta, q, K, accountant)`` and dp-accounting version, across processes and invocations
    (:mod:`dpfedavg.privacy.cache`).
    """
    return cached(
        "noise-multiplier",
        (epsilon, delta, q, rounds, kind, rel_tol, PLD_DISCRETIZATION),
        lambda: smallest_noise_multiplier(
            lambda z: epsilon_for(z, q, rounds, delta, kind), epsilon, rel_tol, f" (delta={delta})"
        ),
    )


def paper_sigma(
    epsilon: float, delta: float, num_clients: int, rounds: int, clip: float, constant: float = 1.0
) -> float:
    """The paper's Theorem 1 (Abadi et al.) noise level ``sigma^2 = q K C^2 log(1/delta) / (n^2 eps^2)``.

    ``constant`` is the paper's unspecified absolute constant ``q``; with 1 it
    gives the shape of the formula, to compare with an accountant's sigma.
    """
    return math.sqrt(constant * rounds * clip**2 * math.log(1.0 / delta) / (num_clients**2 * epsilon**2))


@dataclass(frozen=True)
class PrivacyPlan:
    """The privacy set-up of a run, derived from its config before it starts.

    Attributes
    ----------
    noise_multiplier:
        ``z`` used by the run (calibrated from ``target_epsilon`` or given).
    nominal_epsilon:
        Epsilon after all rounds if every round carries the nominal noise
        (``inf`` without DP).
    """

    dp: bool
    noise_multiplier: float
    calibrated: bool
    target_epsilon: float | None
    delta: float
    q: float
    rounds: int
    accountant: str
    placement: str
    max_epsilon: float | None
    nominal_epsilon: float

    def new_accountant(self) -> RoundAccountant:
        return RoundAccountant(self.accountant, self.delta)


def _reject_count_stddev(cfg: RunConfig, z: float, calibrated: bool) -> None:
    """``adaptive-clip`` with ``sigma_b <= z/2``: Andrew et al.'s noise split (Theorem 1) has no ``z_u``."""
    given = "auto = r/20 = " if cfg.clip_count_stddev is None else ""
    how = f"calibrated for epsilon = {cfg.epsilon:g}" if calibrated else "the noise-multiplier"
    raise ConfigError(
        f"invalid run config: 'clip-count-stddev' = {given}{cfg.count_stddev:g} with 'algorithm' = "
        f"'adaptive-clip' and z = {z:.5g} ({how}): the count of unclipped updates alone would spend the round's "
        f"whole budget (z_u = (z^-2 - (2 sigma_b)^-2)^(-1/2) needs sigma_b > z/2); allowed: clip-count-stddev > "
        f"{min_count_stddev(z):.5g} (the update's noise multiplier z_u grows as sigma_b approaches it)"
    )


def plan_privacy(cfg: RunConfig) -> PrivacyPlan:
    """Calibrate or take ``z`` and check the budget, before anything starts.

    Raises
    ------
    dpfedavg.config.ConfigError
        A budget ``max-epsilon`` that the first round already exceeds, or that
        cannot hold because the run has no noise; ``adaptive-clip`` with
        ``clip-count-stddev <= z/2`` (checked after ``z`` is calibrated).
    """
    q = cfg.sampling_rate
    max_eps = cfg.max_epsilon if cfg.max_epsilon > 0 else None
    if not get_bound(cfg.algorithm).private:
        z, calibrated = 0.0, False
    elif cfg.epsilon > 0:
        z, calibrated = calibrate_noise_multiplier(cfg.epsilon, cfg.delta, q, cfg.num_rounds, cfg.accountant), True
    else:
        z, calibrated = (cfg.noise_multiplier or 0.0), False
    dp = z > 0
    if dp and get_bound(cfg.algorithm).adaptive and not cfg.count_stddev > min_count_stddev(z):
        _reject_count_stddev(cfg, z, calibrated)
    nominal = epsilon_for(z, q, cfg.num_rounds, cfg.delta, cfg.accountant) if dp else math.inf
    if max_eps is not None:
        if not dp:
            raise ConfigError(
                f"invalid run config: 'max-epsilon' = {max_eps:g} but the run adds no noise "
                f"(algorithm={cfg.algorithm!r}, noise multiplier 0): its epsilon is infinite"
            )
        first = epsilon_for(z, q, 1, cfg.delta, cfg.accountant)
        if first > max_eps:
            raise ConfigError(
                f"invalid run config: 'max-epsilon' = {max_eps:g} is exceeded by the first round already "
                f"(epsilon = {first:.4g} at z = {z:.4g}, q = {q:.4g}, delta = {cfg.delta:g})"
            )
    return PrivacyPlan(
        dp=dp,
        noise_multiplier=z,
        calibrated=calibrated,
        target_epsilon=cfg.epsilon if cfg.epsilon > 0 else None,
        delta=cfg.delta,
        q=q,
        rounds=cfg.num_rounds,
        accountant=cfg.accountant,
        placement=cfg.noise_placement,
        max_epsilon=max_eps,
        nominal_epsilon=nominal,
    )
