"""Privacy accountants: one class per method behind one protocol (Opacus' ``IAccountant`` is the model).

The privacy unit is one client's whole dataset. In round ``k`` every client is sampled with
probability ``q = r/n`` and the released sum has sensitivity ``C`` (the bound of
`dpfedavg.core.dp`), so one round is ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``
(`RoundEvent`) and rounds compose. An `Accountant` composes round events
(`step()`) and reports the epsilon spent for its ``delta``; callers never branch on
the method's name: they create one with `create_accountant()` and ask it.

Two methods ship (`ACCOUNTANTS`), both over dp-accounting:

``pld``
    Privacy loss distributions (tight). Consecutive rounds with the same event are composed as
    one self-composed run, as dp-accounting's ``PLDAccountant`` does for ``SelfComposedDpEvent``;
    the discretization interval is `PLD_DISCRETIZATION` (pessimistic: a valid upper bound).
    A PLD's size grows without bound as the noise shrinks: one with a Gaussian of std below
    `PLD_MIN_SIGMA`, or whose mean privacy loss exceeds `PLD_MAX_MEAN_LOSS`, is refused
    with `AccountingRangeError` before it is built (issue 29: ``num-rounds = 10^6`` at ``q = 1``
    asked dp-accounting for 7.6 GiB).
``rdp``
    Rényi DP over dp-accounting's default orders (looser, fast).

dp-accounting is imported when an accountant is first used, not when this module is imported: the
config reads `ACCOUNTANTS`'s names, and a ClientApp never accounts.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any, ClassVar, Protocol

import numpy as np

from dpfedavg.errors import lookup

__all__ = [
    "ACCOUNTANTS",
    "PLD_DISCRETIZATION",
    "PLD_MAX_MEAN_LOSS",
    "PLD_MIN_SIGMA",
    "AccountingRangeError",
    "Accountant",
    "AccountantBase",
    "PldAccountant",
    "RdpAccountant",
    "RoundEvent",
    "check_pld_range",
    "accountant_class",
    "create_accountant",
    "rdp_epsilon",
]

#: PLD value discretization. 1e-3 gives the same epsilon as 1e-4 to 4 digits on the paper's settings at a
#: tenth of the cost (see the benchmarks page).
PLD_DISCRETIZATION = 1e-3
#: The smallest Gaussian std (in units of the sensitivity) a PLD is built for: one round at ``z``, or ``K`` rounds
#: at ``q = 1`` (exactly one Gaussian of std ``z / sqrt(K)``). dp-accounting's PLD of a Gaussian of std ``s`` has
#: ``O(s^-2) / PLD_DISCRETIZATION`` points: 0.78 million (1.4 s, 190 MB) at 0.05, 7.6 GiB at 0.001. At 0.05 one
#: round costs epsilon 280 (q = 1e-6) to 340 (q = 1) at delta = 1e-12, 225 at q = 1 and delta = 0.1 (only delta >= q
#: makes it small: then sampling alone covers delta); calibration never goes below it.
PLD_MIN_SIGMA = 0.05
#: The largest mean privacy loss (the KL divergence, bounded by the Rényi divergence at dp-accounting's smallest
#: order) of a composed run of rounds a PLD is built for: the composed PLD's support grows with it (about
#: ``mean / PLD_DISCRETIZATION`` points). A run whose rounds lose more than this on average has epsilon > 1000.
PLD_MAX_MEAN_LOSS = 1000.0


class AccountingRangeError(ValueError):
    """The accountant cannot compute this event in bounded memory (too little noise for its method)."""


class _DropUnconvergedOrders(logging.Filter):
    """dp-accounting logs a WARNING per fractional RDP order whose series does not converge
    (it then excludes that order, which only loosens the bound). Keep the log readable."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


logging.getLogger("absl").addFilter(_DropUnconvergedOrders())


@dataclass(frozen=True)
class RoundEvent:
    """One round's mechanism: Poisson sampling with ``q``, Gaussian noise with multiplier ``z``.

    ``z = None`` means the round released nothing that depends on any client (a no-op for privacy);
    ``z = 0`` means updates were released without noise: epsilon is infinite.
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

    def dp_event(self) -> Any:
        """The dp-accounting event of this round."""
        import dp_accounting

        if self.is_noop:
            return dp_accounting.NoOpDpEvent()
        gaussian = dp_accounting.GaussianDpEvent(self.z)
        return gaussian if self.q == 1.0 else dp_accounting.PoissonSampledDpEvent(self.q, gaussian)


class Accountant(Protocol):
    """Composes round events and reports epsilon for its ``delta`` (Opacus' ``IAccountant``)."""

    #: The ``accountant`` key's value.
    name: ClassVar[str]
    delta: float

    def step(self, event: RoundEvent, count: int = 1) -> None:
        """Compose ``count`` rounds of ``event`` (cheap: epsilon is computed when asked for)."""

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far (``inf`` after a round without noise, 0 before any round)."""

    def epsilon_after(self, event: RoundEvent, count: int = 1) -> float:
        """The epsilon that composing ``count`` rounds of ``event`` would give, without composing them."""

    @property
    def rounds(self) -> int:
        """Rounds composed so far (no-op rounds included)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild this accountant (JSON-serializable)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace this accountant's state with ``state`` (replays the recorded rounds)."""


def _check(count: int, delta: float) -> None:
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")


class AccountantBase:
    """What every accountant shares: the round history, the no-noise rule, the cached epsilon, the state_dict."""

    name: ClassVar[str]

    def __init__(self, delta: float) -> None:
        _check(1, delta)
        self.delta = delta
        self.history: list[RoundEvent] = []
        self._non_private = False
        self._cached: tuple[int, float] | None = None  # (rounds, epsilon)
        self._reset()

    def _reset(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _compose(self, event: RoundEvent, count: int) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _epsilon_now(self) -> float:  # pragma: no cover - overridden
        raise NotImplementedError

    def _epsilon_with(self, event: RoundEvent, count: int) -> float:  # pragma: no cover - overridden
        """Epsilon after composing ``count`` more rounds of a noisy ``event`` (the state is left unchanged)."""
        raise NotImplementedError

    def epsilon_after(self, event: RoundEvent, count: int = 1) -> float:
        """The epsilon that composing ``count`` rounds of ``event`` would give, without composing them."""
        _check(count, self.delta)
        if event.is_noop:
            return self.epsilon
        if self._non_private or event.z == 0:
            return math.inf
        return self._epsilon_with(event, count)

    @property
    def rounds(self) -> int:
        return len(self.history)

    def prefetch(self, event: RoundEvent, rounds: int) -> Any:
        """Start computing the epsilon of the next ``rounds`` rounds of ``event`` in the background, where an
        accountant can (`PldAccountant.prefetch()`); ``None`` here."""
        return None

    def step(self, event: RoundEvent, count: int = 1) -> None:
        _check(count, self.delta)
        self.history.extend([event] * count)
        if event.is_noop:
            return
        if event.z == 0:
            self._non_private = True
        else:
            self._compose(event, count)

    @property
    def epsilon(self) -> float:
        if self._cached is None or self._cached[0] != len(self.history):
            self._cached = (len(self.history), math.inf if self._non_private else self._epsilon_now())
        return self._cached[1]

    def state_dict(self) -> dict[str, Any]:
        return {"accountant": self.name, "delta": self.delta, "history": [[e.q, e.z] for e in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("accountant") != self.name:
            raise ValueError(f"a {state.get('accountant')!r} accountant's state cannot load into a {self.name!r} one")
        if state.get("delta") != self.delta:
            raise ValueError(f"the state is for delta = {state.get('delta')!r}, this accountant's is {self.delta!r}")
        self.history, self._non_private, self._cached = [], False, None
        self._reset()
        for q, z in state["history"]:
            self.step(RoundEvent(float(q), None if z is None else float(z)))


@lru_cache(maxsize=256)
def _event_rdp(q: float, z: float) -> np.ndarray:
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(RoundEvent(q, z).dp_event())
    return accountant.rdp


@cache
def _rdp_orders() -> np.ndarray:
    from dp_accounting.rdp import rdp_privacy_accountant

    return np.asarray(rdp_privacy_accountant.RdpAccountant().orders)


def rdp_epsilon(rdp: np.ndarray, delta: float) -> float:
    """Epsilon for ``delta`` from an RDP curve over dp-accounting's default orders (0 for a zero curve)."""
    from dp_accounting.rdp import rdp_privacy_accountant

    if not np.any(rdp):
        return 0.0
    eps, _ = rdp_privacy_accountant.compute_epsilon(_rdp_orders(), rdp, delta)
    return float(eps)


class RdpAccountant(AccountantBase):
    """Rényi DP: each round adds its RDP curve over dp-accounting's default orders."""

    name: ClassVar[str] = "rdp"

    def _reset(self) -> None:
        self._rdp = np.zeros_like(_rdp_orders(), dtype=np.float64)

    def _compose(self, event: RoundEvent, count: int) -> None:
        assert event.z is not None
        self._rdp = self._rdp + count * _event_rdp(event.q, event.z)

    def _epsilon_now(self) -> float:
        return rdp_epsilon(self._rdp, self.delta)

    def _epsilon_with(self, event: RoundEvent, count: int) -> float:
        assert event.z is not None
        return rdp_epsilon(self._rdp + count * _event_rdp(event.q, event.z), self.delta)


@lru_cache(maxsize=256)
def _event_pld(q: float, z: float) -> Any:
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    return pld_lib.from_gaussian_mechanism(
        standard_deviation=z, sampling_prob=q, value_discretization_interval=PLD_DISCRETIZATION
    )


def _mean_loss_bound(event: RoundEvent) -> float:
    """An upper bound on one round's mean privacy loss (KL): its Rényi divergence at the smallest finite order.

    ``D_alpha`` is non-decreasing in ``alpha`` and ``D_1`` is the KL divergence (van Erven & Harremoës 2014).
    """
    assert event.z is not None
    rdp = _event_rdp(event.q, event.z)
    finite = rdp[np.isfinite(rdp)]
    return float(finite[0]) if finite.size else math.inf


def check_pld_range(event: RoundEvent, count: int) -> None:
    """`AccountingRangeError` unless ``count`` rounds of ``event`` fit a PLD of bounded size.

    The Gaussian it is built from must have std at least `PLD_MIN_SIGMA` (``z``, or ``z / sqrt(count)`` at
    ``q = 1``), and the run's mean privacy loss must be at most `PLD_MAX_MEAN_LOSS`.
    """
    assert event.z is not None and event.z > 0
    sigma = event.z / math.sqrt(count) if event.q == 1.0 else event.z
    what = f"{count} round{'s' if count > 1 else ''} at q = {event.q:.4g}, z = {event.z:.4g}"
    if sigma < PLD_MIN_SIGMA:
        raise AccountingRangeError(
            f"{what}: the PLD accountant would build the privacy loss of a Gaussian of std {sigma:.3g} < "
            f"{PLD_MIN_SIGMA:g}, whose size grows as std^-2 (epsilon there exceeds 200); use the 'rdp' accountant "
            "or more noise"
        )
    if event.q < 1.0:
        mean = count * _mean_loss_bound(event)
        if mean > PLD_MAX_MEAN_LOSS:
            raise AccountingRangeError(
                f"{what}: the mean privacy loss is up to {mean:.3g} > {PLD_MAX_MEAN_LOSS:g}, and the PLD accountant's "
                "memory grows with it (epsilon there exceeds 1000); use the 'rdp' accountant or more noise"
            )


def _run_pld(event: RoundEvent, count: int) -> Any:
    """``count`` rounds of ``event`` as one PLD, as ``PLDAccountant`` composes ``SelfComposedDpEvent``."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    assert event.z is not None and event.z > 0
    check_pld_range(event, count)
    if event.q == 1.0:  # Gaussian composition is exact: z / sqrt(count)
        return _gaussian_pld(event.z / math.sqrt(count))
    return _event_pld(event.q, event.z).self_compose(count)


def _pld_epsilon(key: tuple) -> float:
    """epsilon at delta of ``count`` rounds of one event, ``key = (q, z, count, delta, discretization)``."""
    q, z, count, delta, _ = key
    return float(_run_pld(RoundEvent(q, z), count).get_epsilon_for_delta(delta))


def _gaussian_pld(std: float) -> Any:
    """``from_gaussian_mechanism(std)`` (sensitivity 1, ``q = 1``), its hockey-stick divergences computed as arrays.

    The library computes the inverse privacy loss ``x(eps) = -1/2 - eps std^2`` (REMOVE, no subsampling) by a
    Python call per discretisation point (about 14,000 per PLD, the grid's cold per-round epsilon); the same
    floating-point operations over an array give bit-identical PLDs (tests/test_accounting.py). Falls back to the
    library call where its internals differ.
    """
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    build = getattr(pld_lib, "_create_pld_pmf_from_monotone_privacy_loss", None)
    loss_class = _vector_gaussian_loss()
    if build is None or loss_class is None:
        return pld_lib.from_gaussian_mechanism(standard_deviation=std, value_discretization_interval=PLD_DISCRETIZATION)
    remove = pld_lib.privacy_loss_mechanism.AdjacencyType.REMOVE
    loss = loss_class(std, sensitivity=1, pessimistic_estimate=True, sampling_prob=1.0, adjacency_type=remove)
    pmf = build(loss, pessimistic_estimate=True, value_discretization_interval=PLD_DISCRETIZATION, use_connect_dots=True)
    return pld_lib.PrivacyLossDistribution(pmf)


@cache
def _vector_gaussian_loss() -> Any:
    """``GaussianPrivacyLoss`` whose ``get_delta_for_epsilon`` (q = 1, REMOVE) works on the array at once; or None."""
    from dp_accounting.pld import privacy_loss_mechanism as plm

    base = getattr(plm, "GaussianPrivacyLoss", None)
    if base is None or not hasattr(base, "_inverse_privacy_loss_without_subsampling_remove"):
        return None

    class _VectorGaussianLoss(base):  # type: ignore[misc, valid-type]
        def get_delta_for_epsilon(self, epsilon: Any) -> Any:
            if self.sampling_prob != 1.0 or self.adjacency_type != plm.AdjacencyType.REMOVE:
                return super().get_delta_for_epsilon(epsilon)
            scalar = np.ndim(epsilon) == 0
            epsilons = np.atleast_1d(np.asarray(epsilon, dtype=float))
            # the library's expression, operation for operation: -0.5 s - eps std^2 / s
            x = -0.5 * self.sensitivity - epsilons * (self._standard_deviation**2) / self.sensitivity
            deltas = np.clip(self.mu_upper_cdf(x) - np.exp(epsilons + self.mu_lower_log_cdf(x)), 0, 1)
            return float(deltas[0]) if scalar else deltas

    return _VectorGaussianLoss


def _fold(base: Any, event: RoundEvent, count: int) -> Any:
    run = _run_pld(event, count)
    return run if base is None else base.compose(run)


class PldAccountant(AccountantBase):
    """Privacy loss distributions: runs of identical rounds are composed as one self-composition."""

    name: ClassVar[str] = "pld"

    def _reset(self) -> None:
        self._base: Any = None  # every run of identical events but the last, composed
        self._last: RoundEvent | None = None  # the current run of identical events ...
        self._last_count = 0  # ... and its length

    def _compose(self, event: RoundEvent, count: int) -> None:
        if self._last == event:
            self._last_count += count
            return
        if self._last is not None:
            self._base = _fold(self._base, self._last, self._last_count)
        self._last, self._last_count = event, count

    def _epsilon_of(self, base: Any, last: RoundEvent | None, count: int) -> float:
        if last is None or count == 0:
            return 0.0 if base is None else float(base.get_epsilon_for_delta(self.delta))
        if base is None:  # one run of identical events (every round at the nominal z): cached (privacy.cache)
            from dpfedavg.privacy.cache import cached

            key = (last.q, last.z, count, self.delta, PLD_DISCRETIZATION)
            return cached("pld-epsilon", key, lambda: _pld_epsilon(key))
        return float(_fold(base, last, count).get_epsilon_for_delta(self.delta))

    def prefetch(self, event: RoundEvent, rounds: int) -> Any:
        """Compute, in a background thread, the epsilon after each of the next ``rounds`` rounds of ``event``
        (`dpfedavg.privacy.cache.prefetch()`), as long as every round so far was ``event``; ``None`` otherwise.
        The values are the ones `epsilon` computes; only when they are computed changes."""
        if self._base is not None or (self._last is not None and self._last != event) or not event.z:
            return None
        from dpfedavg.privacy.cache import prefetch

        done = self._last_count
        keys = [(event.q, event.z, done + i, self.delta, PLD_DISCRETIZATION) for i in range(1, rounds + 1)]
        return prefetch("pld-epsilon", keys, _pld_epsilon)

    def _epsilon_now(self) -> float:
        return self._epsilon_of(self._base, self._last, self._last_count)

    def _epsilon_with(self, event: RoundEvent, count: int) -> float:
        base, last_count = self._base, self._last_count
        if self._last is not None and self._last != event:
            base, last_count = _fold(base, self._last, last_count), 0
        return self._epsilon_of(base, event, last_count + count)


#: name -> accountant class (the ``accountant`` key's choices).
ACCOUNTANTS: dict[str, type[AccountantBase]] = {cls.name: cls for cls in (PldAccountant, RdpAccountant)}


def accountant_class(name: str) -> type[AccountantBase]:
    """The accountant class of method ``name``: the one lookup of `ACCOUNTANTS` (`ConfigError` naming the allowed
    ones)."""
    return lookup(ACCOUNTANTS, name, key="accountant", what="accountant")


def create_accountant(name: str, delta: float) -> Accountant:
    """A fresh accountant of method ``name`` (`ACCOUNTANTS`) for ``delta``."""
    return accountant_class(name)(delta)
