"""The banded-MF noise mechanism of a run: its settings, the config's rules for them, and the server's gate and stream.

Three pieces, built in this order before any client is contacted:

* `BandedMFSpec` (narrow and frozen, what the accounting reads): the participation rule
  (`ParticipationRule`), the strategy coefficients ``c_0 .. c_{b-1}`` and the
  fixed denominator of the average. `BandedMFSpec.from_config()` builds it from a run config;
  `config_errors()` lists, in the config's words, every setting it cannot honour.
* the plan calibrates ``z = sigma / C`` for the target with
  `calibrate_noise_std()` (in units of the clip, so ``z`` does not
  depend on ``C``), and the server's accountant is a
  `BandedMFAccountant`;
* `BandedMFMechanism` (the server's state, one per run): ``select`` is round ``k``'s cohort by the rule
  (`ParticipationTracker`: nobody outside it is ever returned), and
  ``server_noise`` is the correlated noise ``(C^{-1} Z)_k`` the server adds to the round's sum
  (`BandedNoiseStream`), once every round, an empty or skipped round included.
  ``state_dict`` / ``load_state_dict`` carry both into the checkpoint; ``record`` is ``config.json``'s
  ``privacy.banded_mf``.

**The fixed denominator.** The released sum is divided by a constant fixed before the run (never by the
number of replies, which one client's presence would change): the expected cohort of the participation scheme.
``cyclic``: the mean group size ``n / b`` (the cohort is the whole group, ``floor(n/b)`` or ``ceil(n/b)``
clients, so ``a_k`` averages the group's updates; ``r`` would over-weight every round by ``(n / b) / r`` when
``r`` does not divide ``n``, or when ``bands`` is set below ``n / r``); ``cyclic-poisson``: ``p n / b``, which is
``r`` with the default ``p = r b / n``; ``min-separation``: ``r``, the operator's expectation (who is connected
decides the cohort). With ``r = n`` and ``b = 1`` every choice is ``r``, today's. The constant uses the configured
``n`` and ``r`` only, so it is the same in neighbouring federations and the division is post-processing.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpfedavg.core.banded_mf import BandedNoiseStream, check_coefficients, default_bands, sqrt_prefix_coefficients
from dpfedavg.core.banded_mf_optimized import JAX_PRIVACY_VERSION, optimized_coefficients
from dpfedavg.core.participation import Participation, ParticipationRule, ParticipationTracker
from dpfedavg.core.types import Vector
from dpfedavg.privacy.banded_mf_accounting import MECHANISM, BandedMFParams, banded_mf_record

__all__ = [
    "COEFFICIENT_STRATEGIES",
    "BandedMFMechanism",
    "BandedMFSpec",
    "config_errors",
    "parse_coefficients",
]

logger = logging.getLogger(__name__)

#: ``strategy-coefficients`` by name: the banded square root of the prefix-sum matrix (no dependency) or
#: jax-privacy's optimized banded Toeplitz (the prefix-mean workload; an optional install).
COEFFICIENT_STRATEGIES = ("sqrt-prefix", "optimized")
#: What ``strategy-coefficients`` accepts, for error messages.
COEFFICIENTS_ALLOWED = (
    "'sqrt-prefix', 'optimized' (needs jax-privacy) or b comma-separated numbers c_0, ..., c_{b-1} with c_0 != 0"
)


def parse_coefficients(value: str) -> str | tuple[float, ...]:
    """A strategy's name, or explicit coefficients from ``"c_0, c_1, ..."``; ``ValueError`` otherwise."""
    text = value.strip()
    if text in COEFFICIENT_STRATEGIES:
        return text
    try:
        coefs = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"'strategy-coefficients' = {value!r}: expected {COEFFICIENTS_ALLOWED}") from None
    try:
        return check_coefficients(coefs)
    except ValueError as err:
        why = str(err).split(": ", 1)[-1]  # check_coefficients names the coefficients itself
        raise ValueError(f"'strategy-coefficients' = {value!r}: {why}") from None


@dataclass(frozen=True)
class BandedMFSpec:
    """What the banded mechanism is, before any noise: the rule, the strategy and the denominator.

    Attributes
    ----------
    rule:
        The participation rule (``n``, ``b``, ``K``, ``k``, ``p``, the scheme).
    coefficients:
        ``c_0 .. c_{b-1}`` of the b-banded Toeplitz ``C``.
    clients_per_round:
        ``r`` (``min-separation``'s denominator; the default ``b`` and ``p`` come from it).
    strategy:
        Where the coefficients came from: ``sqrt-prefix``, ``optimized`` or ``explicit``.
    """

    rule: ParticipationRule
    coefficients: tuple[float, ...]
    clients_per_round: float
    strategy: str = "sqrt-prefix"

    @property
    def bands(self) -> int:
        return len(self.coefficients)

    @property
    def denominator(self) -> float:
        """The fixed denominator of the round's average (the module docstring)."""
        if self.rule.scheme is Participation.MIN_SEPARATION:
            return self.clients_per_round
        return self.rule.sampling_probability * self.rule.num_clients / self.rule.bands

    def params(self, *, noise_std: float, delta: float, accountant: str, clip: float = 1.0) -> BandedMFParams:
        """The accounting parameters with ``sigma = noise_std`` and ``C_clip = clip`` (epsilon reads their ratio)."""
        return BandedMFParams.from_rule(
            self.rule, self.coefficients, clip=clip, noise_std=noise_std, delta=delta, accountant=accountant
        )

    @classmethod
    def build(
        cls,
        *,
        num_clients: int,
        clients_per_round: float,
        num_rounds: int,
        bands: int | None = None,
        participation: str = Participation.CYCLIC.value,
        max_participations: int | None = None,
        coefficients: str | tuple[float, ...] = "sqrt-prefix",
        min_group_size: int = 1,
    ) -> BandedMFSpec:
        """The spec of a run; ``ValueError`` naming the setting that cannot hold.

        ``bands = None``: ``floor(n / r)`` in ``[1, K]`` (`default_bands()`), or the
        number of explicit coefficients. ``cyclic-poisson`` samples each client of the group with ``p = r b / n``.
        """
        parsed = parse_coefficients(coefficients) if isinstance(coefficients, str) else tuple(coefficients)
        if bands is None:
            auto = default_bands(num_clients, clients_per_round, num_rounds)
            bands = len(parsed) if isinstance(parsed, tuple) else auto
        if bands > num_rounds:
            raise ValueError(
                f"'bands' = {bands} exceeds 'num-rounds' = {num_rounds}: allowed 1 <= bands <= num-rounds "
                "(a b-banded K x K strategy has at most K bands)"
            )
        if isinstance(parsed, tuple):
            if len(parsed) != bands:
                raise ValueError(
                    f"'strategy-coefficients' has {len(parsed)} number(s) but 'bands' = {bands}: a b-banded strategy "
                    "has exactly b coefficients (or leave bands = 'auto')"
                )
            coefs, strategy = check_coefficients(parsed, num_rounds), "explicit"
        elif parsed == "optimized":
            coefs, strategy = optimized_coefficients(num_rounds, bands), parsed
        else:
            coefs, strategy = sqrt_prefix_coefficients(bands), parsed
        p = 1.0
        if participation == Participation.CYCLIC_POISSON.value:
            p = min(1.0, clients_per_round * bands / num_clients)
        rule = ParticipationRule(
            participation, num_clients, bands, num_rounds, max_participations, p, min_group_size, None
        )
        rule.check_cohort_size(clients_per_round)
        return cls(rule, coefs, clients_per_round, strategy)

    @classmethod
    def from_config(cls, cfg: Any) -> BandedMFSpec:
        """The spec of a `RunConfig` (validated there: see `config_errors()`)."""
        keys = ("num_clients", "clients_per_round", "num_rounds", "bands", "participation", "max_participations")
        return cls.build(**{key: getattr(cfg, key) for key in keys}, coefficients=cfg.strategy_coefficients)


def config_errors(cfg: Any) -> list[str]:
    """Why ``noise-mechanism = 'banded-mf'`` cannot run with ``cfg`` (one text per problem; none: it can).

    Checked when the config is built, before any client is contacted: the placement (the server generates the
    correlated noise), adaptive clipping, secure aggregation, the bands, the coefficients and the participation
    rule for ``n``, ``r`` and ``K``. jax-privacy's optimized coefficients are computed later (when the plan is
    made); here only whether jax-privacy is installed is checked.
    """
    errors = []
    if cfg.noise_placement != "server":
        errors.append(
            f"'noise-placement' = {cfg.noise_placement!r} with 'noise-mechanism' = {MECHANISM!r}: the server "
            "generates the correlated noise C^-1 Z (its rows are tied across rounds, so it cannot be split over "
            "cohorts that change from round to round); allowed: noise-placement = 'server'"
        )
    if cfg.algorithm == "adaptive-clip":
        errors.append(
            f"'algorithm' = 'adaptive-clip' with 'noise-mechanism' = {MECHANISM!r}: the banded analysis needs one "
            "clip for every round (C_k rescales the rows of x from a private count, and the release is then no "
            "longer C x + Z with one sensitivity); allowed: a fixed-clip algorithm, 'clip' or 'norm'"
        )
    if cfg.secure_aggregation:
        errors.append(
            f"'secure-aggregation' = True with 'noise-mechanism' = {MECHANISM!r}: the correlated noise is added by "
            "the server to the sum, so the server would still learn every round's exact sum, and the secure "
            "encoding's privacy terms (rounding, coordinate clipping) are derived here for noise the clients add; "
            "allowed: secure-aggregation = false (central DP: the server is trusted with the updates)"
        )
    try:
        parsed = parse_coefficients(cfg.strategy_coefficients)
    except ValueError as err:
        return [*errors, str(err)]
    if parsed == "optimized" and importlib.util.find_spec("jax_privacy") is None:
        errors.append(
            "'strategy-coefficients' = 'optimized' needs jax-privacy, which is not installed "
            f"(pip install jax-privacy=={JAX_PRIVACY_VERSION}); allowed without it: 'sqrt-prefix' or explicit numbers"
        )
        parsed = "sqrt-prefix"  # check the rest as if
    try:
        spec_settings = {
            "num_clients": cfg.num_clients,
            "clients_per_round": cfg.clients_per_round,
            "num_rounds": cfg.num_rounds,
            "bands": cfg.bands,
            "participation": cfg.participation,
            "max_participations": cfg.max_participations,
        }
        if parsed == "optimized":  # the optimizer's coefficients are valid whenever b is: check with the default
            parsed = "sqrt-prefix"
        BandedMFSpec.build(**spec_settings, coefficients=parsed)
    except ValueError as err:
        errors.append(_config_words(str(err)))
    return errors


def _config_words(message: str) -> str:
    """A participation rule's message in the config's words (``bands = 5`` -> ``'bands' = 5``)."""
    for key in ("bands", "num-clients", "num-rounds", "max-participations", "clients-per-round"):
        if message.startswith(f"{key} = "):
            return f"'{key}'" + message[len(key) :]
    return message


class BandedMFMechanism:
    """The server's participation gate and correlated noise stream of one banded-MF run (module docstring).

    Parameters
    ----------
    spec:
        The rule, the coefficients and the denominator.
    noise_std:
        ``sigma``: the std of each coordinate of ``Z``'s rows, in the sum's units (``z C``).
    dim:
        The length of the released sum.
    clip:
        ``C``, for `record()` (the sensitivity in the sum's units).
    delta, accountant:
        For `record()`'s epsilon.
    """

    #: ``config.json``'s ``privacy`` key of `record()`.
    record_key = "banded_mf"
    #: The cohort depends on who is connected (``min-separation`` asks the eligible, connected clients).
    selects_from_available = True
    selection_key = None  # the cohort depends on the participation history

    def __init__(
        self, spec: BandedMFSpec, noise_std: float, dim: int, *, clip: float, delta: float, accountant: str
    ) -> None:
        self.spec = spec
        self.params = spec.params(noise_std=noise_std, delta=delta, accountant=accountant, clip=clip)
        self.stream = BandedNoiseStream(spec.coefficients, dim, noise_std)
        self.tracker = ParticipationTracker(spec.rule)
        logger.info(
            "banded-MF noise: b = %d (%s), %s participation (k = %d), sigma = %.6g, sensitivity = %.6g, "
            "denominator %.6g",
            spec.bands,
            spec.strategy,
            spec.rule.scheme.value,
            spec.rule.participations,
            noise_std,
            self.params.sensitivity(),
            spec.denominator,
        )

    @property
    def denominator(self) -> float:
        return self.spec.denominator

    @property
    def noise_std(self) -> float:
        return self.params.noise_std

    # ------------------------------------------------------------------------------------------- per round
    def select(self, round_index: int, rng: np.random.Generator | None = None, available: Any = None) -> np.ndarray:
        """Round ``k``'s cohort (0-based ``k``) by the gate's rule (`ParticipationTracker.choose()`)."""
        return self.tracker.choose(round_index, rng, available)

    def admit(self, round_index: int, cohort: np.ndarray) -> None:
        """Record round ``k``'s cohort in the participation history (`ParticipationTracker.admit()`)."""
        self.tracker.admit(round_index, cohort)

    def server_noise(self, round_index: int, rng: Callable[[], np.random.Generator], top_up_std: float = 0.0) -> Vector:
        """``(C^{-1} Z)_k`` for the server to add to round ``k``'s sum (every round, also an empty or skipped one).

        ``top_up_std`` is the independent mechanism's; the server placement's is ``sigma`` itself, so the
        correlated noise replaces it.
        """
        del top_up_std
        return self.stream.next(round_index, rng())

    # --------------------------------------------------------------------------------------- records, state
    def record(self) -> dict[str, Any]:
        """``config.json``'s ``privacy.banded_mf`` (`banded_mf_record()`)."""
        return {
            **banded_mf_record(self.params),
            "strategy": self.spec.strategy,
            "denominator": self.spec.denominator,
            "released": "per round k: x_k + (C^-1 Z)_k, x_k the sum of the round's bounded updates; the average "
            "divides it by denominator",
        }

    def state_dict(self) -> dict[str, Any]:
        """Flat ``{"stream/...", "tracker/..."}`` of arrays, numbers and strings (``np.savez``-able).

        The stream's buffer holds the last ``b - 1`` correlated noise vectors: with the released models they give
        the un-noised sums of those rounds, so a checkpoint is as secret as the server's raw sums (with
        ``secure-noise`` too: nobody can regenerate the noise, but the checkpoint holds it).
        """
        parts = {"stream": self.stream, "tracker": self.tracker}
        return {f"{name}/{key}": value for name, part in parts.items() for key, value in part.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any], cohort_sizes: Sequence[int] | None = None) -> None:
        """Continue from `state_dict()`'s output (each part refuses a checkpoint of other settings).

        The participation history is the recorded cohorts, replayed through the rule; ``cohort_sizes`` (each
        completed round's number of clients asked) must be their sizes (``ParticipationTracker.load_state_dict``).
        The noise buffer must look like draws of its law (``BandedNoiseStream.load_state_dict``).
        """

        def part_of(name: str) -> dict[str, Any]:
            return {k[len(name) + 1 :]: v for k, v in state.items() if k.startswith(f"{name}/")}

        self.stream.load_state_dict(part_of("stream"))
        self.tracker.load_state_dict(part_of("tracker"), cohort_sizes)
        if self.stream.position != self.tracker.position:
            raise ValueError(
                f"inconsistent banded-MF checkpoint: noise at round {self.stream.position}, participation at "
                f"{self.tracker.position}"
            )
