"""Privacy accounting of banded matrix-factorization noise: the run as one Gaussian, or amplified by cyclic Poisson.

The server releases ``x_k + (C^{-1} Z)_k`` each round (`dpfedavg.core.banded_mf.BandedNoiseStream`),
a post-processing of ``C x + Z`` with ``Z``'s entries i.i.d. ``N(0, sigma^2)``. Two analyses:

**Without amplification** (``cyclic``, ``min-separation``; Choquette-Choo et al. 2023, "(Amplified) Banded
Matrix Factorization", §3; Denisov et al. 2022 for adaptively chosen inputs): the whole
run is *one* Gaussian mechanism with L2 sensitivity ``Delta`` =
`minsep_sensitivity()` (over every allowed participation pattern, in the sum's
units), i.e. ``GaussianDpEvent(sigma / Delta)``, which is ``mu``-GDP with ``mu = Delta / sigma`` (Dong, Roth,
Su 2022, Theorem 2.7) and so ``(epsilon, delta)``-DP exactly when
``delta = Phi(-epsilon/mu + mu/2) - e^epsilon Phi(-epsilon/mu - mu/2)`` (ibid., Corollary 2.13).

**Amplified** (``cyclic-poisson`` with ``p < 1``; Choquette-Choo et al. 2023, §5, Theorems 4 and 5): with ``b`` cyclic
groups and a b-banded ``C``, the run is no less private than DP-SGD over a client's ``ceil(K / b)`` rounds,
each a Poisson-subsampled Gaussian with rate ``p`` and noise multiplier ``sigma / (C_clip max_t ||C[:, t]||)``:
``SelfComposedDpEvent(PoissonSampledDpEvent(p, GaussianDpEvent(z)), ceil(K / b))`` (jax-privacy
``accounting.amplified_bandmf_event``).

Epsilon after the first ``k`` rounds is the same analysis of the ``k x k`` leading block of ``C`` (the first
``k`` released rows depend only on ``Z_0 .. Z_{k-1}``), so a budget stop works as with independent noise.
`banded_mf_record()` is what ``config.json`` holds under ``privacy.banded_mf``: enough to recompute epsilon
without this code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, ClassVar

from dpfedavg.core.banded_mf import check_coefficients, max_column_norm, minsep_sensitivity
from dpfedavg.core.mechanism import Neighbouring
from dpfedavg.core.participation import Participation, ParticipationRule
from dpfedavg.privacy.accountants import PLD_DISCRETIZATION, AccountantBase, RoundEvent
from dpfedavg.privacy.calibration import smallest_noise_multiplier

__all__ = [
    "ACCOUNTANT_KINDS",
    "MECHANISM",
    "BandedMFAccountant",
    "BandedMFParams",
    "banded_mf_epsilon",
    "banded_mf_record",
    "calibrate_noise_std",
    "run_dp_event",
]

#: The ``mechanism()`` name of this accountant (the ``noise-mechanism`` value it serves).
MECHANISM = "banded-mf"
#: dp-accounting back-ends: privacy loss distributions (tight) or Renyi DP.
ACCOUNTANT_KINDS = ("pld", "rdp")


@dataclass(frozen=True)
class BandedMFParams:
    """What the banded-MF accountant reads (narrow and frozen, like jax-privacy's ``DpParams``).

    Attributes
    ----------
    coefficients:
        ``c_0 .. c_{b-1}`` of the b-banded Toeplitz ``C``.
    num_rounds:
        ``K``.
    participation:
        The scheme (`Participation`).
    max_participations:
        ``k`` in force (``ParticipationRule.participations``).
    clip:
        ``C_clip``: the norm bound of one client's update in one round, in the sum's units.
    noise_std:
        ``sigma``: the std of each coordinate of ``Z``'s rows, in the sum's units.
    delta:
        The target ``delta``.
    sampling_probability:
        ``p`` (``cyclic-poisson``; 1 otherwise).
    accountant:
        ``"pld"`` or ``"rdp"``.
    adjacency:
        The neighbouring relation the guarantee is stated under (``ParticipationRule.adjacency``).
    """

    coefficients: tuple[float, ...]
    num_rounds: int
    participation: Participation
    max_participations: int
    clip: float
    noise_std: float
    delta: float
    sampling_probability: float = 1.0
    accountant: str = "pld"
    adjacency: Neighbouring = Neighbouring.ADD_REMOVE

    def __post_init__(self) -> None:
        object.__setattr__(self, "coefficients", check_coefficients(self.coefficients, self.num_rounds))
        object.__setattr__(self, "participation", Participation(self.participation))
        if self.accountant not in ACCOUNTANT_KINDS:
            raise ValueError(f"accountant = {self.accountant!r}: allowed {', '.join(map(repr, ACCOUNTANT_KINDS))}")
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta = {self.delta!r}: allowed 0 < delta < 1")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"clip = {self.clip!r}: must be finite and > 0")
        if not (math.isfinite(self.noise_std) and self.noise_std >= 0):
            raise ValueError(f"noise_std = {self.noise_std!r}: must be finite and >= 0")
        if not 0.0 < self.sampling_probability <= 1.0:
            raise ValueError(f"sampling-probability = {self.sampling_probability!r}: allowed 0 < p <= 1")

    @classmethod
    def from_rule(
        cls,
        rule: ParticipationRule,
        coefficients: Sequence[float],
        *,
        clip: float,
        noise_std: float,
        delta: float,
        accountant: str = "pld",
    ) -> BandedMFParams:
        """The parameters of a run under ``rule`` (which must have as many bands as ``coefficients``)."""
        if len(coefficients) != rule.bands:
            raise ValueError(
                f"strategy-coefficients has {len(coefficients)} entries but bands = {rule.bands}: "
                f"a b-banded strategy has exactly b coefficients"
            )
        return cls(
            coefficients=tuple(coefficients),
            num_rounds=rule.num_rounds,
            participation=rule.scheme,
            max_participations=rule.participations,
            clip=clip,
            noise_std=noise_std,
            delta=delta,
            sampling_probability=rule.sampling_probability,
            accountant=accountant,
            adjacency=rule.adjacency,
        )

    @property
    def bands(self) -> int:
        return len(self.coefficients)

    @property
    def amplified(self) -> bool:
        """``cyclic-poisson`` with ``p < 1``: the amplified analysis applies."""
        return self.participation is Participation.CYCLIC_POISSON and self.sampling_probability < 1.0

    def sensitivity(self, rounds: int | None = None) -> float:
        """``Delta`` of the first ``rounds`` rounds' release (default all ``K``), in the sum's units."""
        rounds = self.num_rounds if rounds is None else rounds
        return minsep_sensitivity(
            self.coefficients[: min(self.bands, rounds)], rounds, self.max_participations, self.clip
        )

    @property
    def max_column_norm(self) -> float:
        """``max_t ||C[:, t]|| = ||c||_2``."""
        return max_column_norm(self.coefficients, self.num_rounds)

    @property
    def amplified_noise_multiplier(self) -> float:
        """``sigma / (C_clip max_t ||C[:, t]||)``: the per-step multiplier of the amplified reduction."""
        return self.noise_std / (self.clip * self.max_column_norm)

    def steps(self, rounds: int | None = None) -> int:
        """``ceil(rounds / b)``: the rounds of group 0 among the first ``rounds`` (the amplified reduction's steps)."""
        rounds = self.num_rounds if rounds is None else rounds
        return -(-rounds // self.bands)


def run_dp_event(params: BandedMFParams, rounds: int | None = None) -> Any:
    """The dp-accounting event of the first ``rounds`` rounds (default all ``K``); see the module docstring."""
    import dp_accounting

    rounds = params.num_rounds if rounds is None else rounds
    if rounds < 0 or rounds > params.num_rounds:
        raise ValueError(f"rounds = {rounds}: allowed 0 <= rounds <= num-rounds = {params.num_rounds}")
    if rounds == 0:
        return dp_accounting.NoOpDpEvent()
    if params.noise_std == 0.0:
        return dp_accounting.NonPrivateDpEvent()
    if params.amplified:
        step = dp_accounting.PoissonSampledDpEvent(
            params.sampling_probability, dp_accounting.GaussianDpEvent(params.amplified_noise_multiplier)
        )
        return dp_accounting.SelfComposedDpEvent(step, params.steps(rounds))
    return dp_accounting.GaussianDpEvent(params.noise_std / params.sensitivity(rounds))


def _epsilon(params: BandedMFParams, rounds: int | None = None, delta: float | None = None) -> float:
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    event = run_dp_event(params, rounds)
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return 0.0
    if isinstance(event, dp_accounting.NonPrivateDpEvent):
        return math.inf
    if params.accountant == "rdp":
        accountant: Any = rdp_privacy_accountant.RdpAccountant()
    else:
        accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    accountant.compose(event)
    return float(accountant.get_epsilon(params.delta if delta is None else delta))


_cached_epsilon = lru_cache(maxsize=1024)(_epsilon)


def banded_mf_epsilon(params: BandedMFParams, rounds: int | None = None, delta: float | None = None) -> float:
    """Epsilon once the first ``rounds`` rounds (default all ``K``) are released, at ``delta`` (default the params').

    Cached by ``(params, rounds, delta)``: calibration and the per-round report ask for the same values often.
    """
    return _cached_epsilon(params, rounds, delta)


def calibrate_noise_std(
    epsilon: float,
    rule: ParticipationRule,
    coefficients: Sequence[float],
    *,
    clip: float,
    delta: float,
    accountant: str = "pld",
    rel_tol: float = 1e-3,
) -> float:
    """The smallest ``sigma`` (to ``rel_tol`` relative) whose whole run spends at most ``epsilon``.

    Bisection (`dpfedavg.privacy.calibration.smallest_noise_multiplier()`) on the per-round noise multiplier
    ``z = sigma / (C_clip ||c||_2)``, the variable today's calibration bisects when ``b = 1`` and ``c_0 = 1``
    (then ``z = sigma / C_clip``, and the same bisection path gives the same ``sigma`` as
    `dpfedavg.privacy.calibration.calibrate_noise_multiplier()` times ``C_clip``). The returned ``sigma``
    always meets the target.
    """
    base = BandedMFParams.from_rule(rule, coefficients, clip=clip, noise_std=1.0, delta=delta, accountant=accountant)
    scale = clip * base.max_column_norm

    def epsilon_of(z: float) -> float:
        return _cached_epsilon(replace(base, noise_std=z * scale))

    z = smallest_noise_multiplier(epsilon_of, epsilon, rel_tol, f" (banded-mf, delta={delta})")
    return z * scale


class BandedMFAccountant(AccountantBase):
    """The accountant of a banded-MF run, behind the `Accountant` protocol.

    Its epsilon after ``k`` rounds is that of the first ``k`` rows of the release (the module docstring), so
    the server composes, peeks (``epsilon_after``, the budget stop) and checkpoints it as any other accountant;
    the round events it is given only count rounds (their ``q`` and ``z`` belong to Poisson sampling with
    independent noise). Its ``state_dict`` adds the parameters, checked on load: a resume with another strategy,
    noise or participation rule is refused.
    """

    name: ClassVar[str] = MECHANISM

    def __init__(self, params: BandedMFParams) -> None:
        self.params = params
        super().__init__(params.delta)

    def _reset(self) -> None:
        self._released = 0

    def _compose(self, event: RoundEvent, count: int) -> None:
        if self._released + count > self.params.num_rounds:
            raise ValueError(
                f"{count} more round(s) after {self._released}: a banded-MF run has num-rounds = "
                f"{self.params.num_rounds}"
            )
        self._released += count

    def _epsilon_now(self) -> float:
        return _cached_epsilon(self.params, self._released)

    def _epsilon_with(self, event: RoundEvent, count: int) -> float:
        rounds = self._released + count
        if rounds > self.params.num_rounds:
            raise ValueError(
                f"epsilon after {rounds} rounds: a banded-MF run has num-rounds = {self.params.num_rounds}"
            )
        return _cached_epsilon(self.params, rounds)

    def state_dict(self) -> dict[str, Any]:
        """The protocol's state plus the parameters (JSON), which `load_state_dict()` checks."""
        return {**super().state_dict(), "params": banded_mf_record(self.params, epsilon=False)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; refuse one recorded for other parameters (a different strategy or noise)."""
        mine, saved = banded_mf_record(self.params, epsilon=False), state.get("params")
        if saved != json.loads(json.dumps(mine)):
            changed = sorted(key for key in mine if not isinstance(saved, dict) or saved.get(key) != mine[key])
            raise ValueError(
                f"the checkpoint's banded-MF parameters differ in {changed}: resume with the same settings"
            )
        super().load_state_dict(state)


def banded_mf_record(params: BandedMFParams, epsilon: bool = True) -> dict[str, Any]:
    """``config.json``'s ``privacy.banded_mf``: the numbers that determine the guarantee, and how to use them.

    Without amplification, ``mu = sensitivity / noise_std`` and epsilon solves
    ``delta = Phi(-epsilon/mu + mu/2) - e^epsilon Phi(-epsilon/mu - mu/2)``. With ``cyclic-poisson``, compose
    ``steps_per_client`` Poisson-subsampled Gaussians with rate ``sampling_probability`` and multiplier
    ``noise_std / (clip * max_column_norm)``. ``max_column_norm`` is ``||strategy_coefficients||_2``; the
    sensitivity is ``clip * sqrt(sum_{i < k} ||C[:, i b]||^2)``, ``||C[:, t]||^2`` the sum of the first
    ``min(b, K - t)`` squared coefficients.
    """
    record: dict[str, Any] = {
        "mechanism": MECHANISM,
        "bands": params.bands,
        "strategy_coefficients": list(params.coefficients),
        "participation": params.participation.value,
        "max_participations": params.max_participations,
        "num_rounds": params.num_rounds,
        "clip": params.clip,
        "sensitivity": params.sensitivity(),
        "noise_std": params.noise_std,
        "max_column_norm": params.max_column_norm,
        "sampling_probability": params.sampling_probability,
        "amplified": params.amplified,
        "delta": params.delta,
        "accountant": params.accountant,
        "adjacency": params.adjacency.value,
    }
    if params.amplified:
        record["steps_per_client"] = params.steps()
        record["amplified_noise_multiplier"] = params.amplified_noise_multiplier
        record["analysis"] = (
            "Choquette-Choo et al. 2023, Thms 4-5: SelfComposed(PoissonSampled(sampling_probability, "
            "Gaussian(noise_std / (clip * max_column_norm))), steps_per_client)"
        )
    else:
        record["analysis"] = (
            "one Gaussian mechanism: mu = sensitivity / noise_std; delta(eps) = Phi(-eps/mu + mu/2) "
            "- exp(eps) Phi(-eps/mu - mu/2)"
        )
    if epsilon:
        record["epsilon"] = _cached_epsilon(params)
    return record
