"""Noise mechanisms as registry objects: who takes part each round, what noise the release carries, how it is accounted.

A run's ``noise-mechanism`` names one entry of `NOISE_MECHANISMS`; nothing else branches on the name.
Each entry says, for a run config,

* what it refuses (`NoiseMechanism.config_errors()`, collected when the config is built);
* its narrow settings (`NoiseMechanism.spec()`, carried by `DpParams`);
* the noise multiplier for a target and the epsilon after ``k`` rounds (`NoiseMechanism.calibrate()`,
  `NoiseMechanism.epsilon()`), and the run's accountant (`NoiseMechanism.new_accountant()`), behind the
  `Accountant` protocol;
* the server's per-run state (`NoiseMechanism.rounds()`): ``select`` (round ``k``'s cohort),
  ``server_noise`` (what the server adds to the sum), ``denominator`` (the fixed divisor of the average),
  ``state_dict`` for the checkpoint and ``record`` for ``config.json``.

Two ship:

``independent``
    Today's: Poisson sampling with ``q = r / n`` (Alg. 1 line 3) and independent Gaussian noise every round,
    split between the clients and the server by the noise placement; each round is
    ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``, composed by the ``accountant`` key's method.
``banded-mf``
    Banded matrix-factorization (DP-FTRL) noise without sampling: a participation rule the server enforces
    (``cyclic``, ``min-separation``, ``cyclic-poisson``) and the correlated noise ``(C^{-1} Z)_k`` added by the
    server (Choquette-Choo et al. 2023; `dpfedavg.privacy.banded_mf_mechanism`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import numpy as np

from dpfedavg.core.check_in import CHECK_IN
from dpfedavg.core.dp import gaussian_noise
from dpfedavg.core.server import poisson_sample
from dpfedavg.core.types import Vector
from dpfedavg.errors import lookup
from dpfedavg.privacy.accountants import Accountant, RoundEvent, create_accountant
from dpfedavg.privacy.banded_mf_accounting import MECHANISM, BandedMFAccountant, calibrate_noise_std
from dpfedavg.privacy.banded_mf_mechanism import BandedMFMechanism, BandedMFSpec, config_errors
from dpfedavg.privacy.calibration import calibrate_noise_multiplier, epsilon_for

__all__ = [
    "NOISE_MECHANISMS",
    "BandedMF", "Independent", "IndependentRounds", "NoiseMechanism",
    "RoundMechanism",
    "get_noise_mechanism",
]


class RoundMechanism(Protocol):
    """The server's per-run state of a noise mechanism (what `DPServer` asks)."""

    #: ``config.json``'s ``privacy`` key of `record()` (``None``: nothing to record).
    record_key: str | None
    #: Whether `select()` reads who is connected (the engines then pass it).
    selects_from_available: bool
    #: What determines `select()`'s cohort besides the generator (the runs of a batch with one seed then share
    #: one draw, `dpfedavg.core.seeding.RoundStreams.draw`); ``None``: it also depends on the mechanism's state.
    selection_key: Hashable | None

    @property
    def denominator(self) -> float:
        """The fixed divisor of the round's sum (Alg. 1 line 12's ``r``)."""

    def select(self, round_index: int, rng: np.random.Generator | None, available: Any = None) -> np.ndarray:
        """Round ``k``'s cohort (0-based ``k``, sorted client ids), not yet recorded."""

    def admit(self, round_index: int, cohort: np.ndarray) -> None:
        """Record round ``k``'s cohort, once the round is sure to run (after the budget check)."""

    def server_noise(
        self, round_index: int, rng: Callable[[], np.random.Generator], top_up_std: float = 0.0
    ) -> Vector | None:
        """What the server adds to round ``k``'s sum (``top_up_std``: the placement's share for the server);
        ``rng()`` gives the round's generator, made only when something is drawn."""

    def record(self) -> dict[str, Any] | None:
        """The mechanism's numbers for ``config.json``."""

    def state_dict(self) -> dict[str, Any]:
        """The state the next round depends on (flat: arrays, numbers, strings)."""

    def load_state_dict(self, state: dict[str, Any], cohort_sizes: Sequence[int] | None = None) -> None:
        """Continue from `state_dict()`'s output; ``cohort_sizes``: each completed round's clients asked."""


class NoiseMechanism(Protocol):
    """One ``noise-mechanism`` value (see the module docstring)."""

    name: str
    description: str
    #: Whether a round released twice (redone after a crash with secure noise: fresh cohort and noise) is
    #: accounted by charging the round's event once more (``dpfedavg.server.releases``).
    charges_redone_rounds: bool

    def config_errors(self, cfg: Any) -> list[str]: ...

    def spec(self, cfg: Any) -> Any: ...

    def calibrate(self, params: Any) -> float: ...

    def epsilon(self, params: Any, noise_multiplier: float, rounds: int) -> float: ...

    def new_accountant(self, params: Any, noise_multiplier: float) -> Accountant: ...

    def rounds(self, params: Any, noise_multiplier: float, *, clip: float, dim: int) -> RoundMechanism: ...


class IndependentRounds:
    """Poisson sampling and the placement's server share, drawn fresh every round (no state)."""

    record_key = None
    selects_from_available = False  # a sampled client that is not connected is a dropout

    def __init__(self, num_clients: int, clients_per_round: float, dim: int, check_in: bool = False) -> None:
        self.num_clients, self.clients_per_round, self.dim = num_clients, clients_per_round, dim
        #: ``sampling = "check-in"``: every client is asked; each node takes part by its own coin
        #: (`dpfedavg.core.check_in`), so the release is this mechanism's Poisson-sampled one all the same.
        self.check_in = check_in
        self.selection_key = ("poisson", num_clients, clients_per_round, check_in)

    @property
    def denominator(self) -> float:
        return self.clients_per_round

    def select(self, round_index: int, rng: np.random.Generator | None, available: Any = None) -> np.ndarray:
        """Poisson sampling over all ``n`` clients with ``q = r / n`` (Alg. 1 line 3), or all ``n`` with random
        check-ins (each node draws its own participation); ``available`` is not read."""
        if self.check_in:
            return np.arange(self.num_clients)
        assert rng is not None
        return poisson_sample(self.num_clients, self.clients_per_round / self.num_clients, rng)

    def admit(self, round_index: int, cohort: np.ndarray) -> None:
        """Nothing to record: every round's Poisson draw is independent of the earlier ones."""

    def server_noise(
        self, round_index: int, rng: Callable[[], np.random.Generator], top_up_std: float = 0.0
    ) -> Vector | None:
        """``N(0, top_up_std^2 I)``: the server's share (all of ``(zC)^2`` for ``server`` placement)."""
        return gaussian_noise(self.dim, top_up_std, rng()) if top_up_std > 0 else None

    def record(self) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any], cohort_sizes: Sequence[int] | None = None) -> None:
        del cohort_sizes  # Poisson sampling has no history to check
        if state:
            raise ValueError(f"the checkpoint holds a noise mechanism's state ({sorted(state)[:3]}) but this run's "
                             "noise-mechanism is 'independent'")  # fmt: skip


class Independent:
    """``independent``: today's mechanism (module docstring)."""

    name = "independent"
    description = "Poisson sampling with q = r/n and independent Gaussian noise every round (Alg. 1 / Alg. 2)"
    #: a redone round is one more Poisson-sampled Gaussian release, independent of the others: one more event
    charges_redone_rounds = True

    def config_errors(self, cfg: Any) -> list[str]:
        """The banded-MF keys keep their defaults (they would change nothing here)."""
        changed = [
            f"'{key}' = {value!r}"
            for key, value, default in (
                ("bands", cfg.bands, None),
                ("participation", cfg.participation, "cyclic"),
                ("max-participations", cfg.max_participations, None),
                ("strategy-coefficients", cfg.strategy_coefficients, "sqrt-prefix"),
            )
            if value != default
        ]
        if not changed:
            return []
        return [
            f"{', '.join(changed)} with 'noise-mechanism' = 'independent': these keys set banded-MF noise and would "
            "change nothing here; allowed: noise-mechanism = 'banded-mf', or their defaults"
        ]

    def spec(self, cfg: Any) -> str:
        """The run's ``sampling``: ``"poisson"`` (the server draws ``S_k``) or ``"check-in"`` (each node does)."""
        return str(cfg.sampling)

    def calibrate(self, params: Any) -> float:
        p = params
        return calibrate_noise_multiplier(p.target_epsilon, p.delta, p.q, p.rounds, p.accountant)

    def epsilon(self, params: Any, noise_multiplier: float, rounds: int) -> float:
        return epsilon_for(noise_multiplier, params.q, rounds, params.delta, params.accountant)

    def new_accountant(self, params: Any, noise_multiplier: float) -> Accountant:
        return create_accountant(params.accountant, params.delta)

    def rounds(self, params: Any, noise_multiplier: float, *, clip: float, dim: int) -> IndependentRounds:
        return IndependentRounds(params.num_clients, params.clients_per_round, dim, params.mechanism_spec == CHECK_IN)


class BandedMF:
    """``banded-mf``: banded matrix-factorization noise (module docstring). ``z = sigma / C`` (the std of ``Z``'s
    rows over the clip; with ``b = 1`` and full participation, today's ``z``)."""

    name = MECHANISM
    description = (
        "banded matrix factorization (DP-FTRL): a participation rule the server enforces, x_k + (C^-1 Z)_k added "
        "by the server (Choquette-Choo et al. 2023)"
    )
    #: a redone round releases row k of C x + Z twice with two draws of Z_k, and its first cohort is not in the
    #: participation history: the banded analysis covers neither, so a resume that would redo rounds is refused
    charges_redone_rounds = False

    def config_errors(self, cfg: Any) -> list[str]:
        return config_errors(cfg)

    def spec(self, cfg: Any) -> BandedMFSpec:
        return BandedMFSpec.from_config(cfg)

    def calibrate(self, params: Any) -> float:
        spec: BandedMFSpec = params.mechanism_spec
        return calibrate_noise_std(
            params.target_epsilon, spec.rule, spec.coefficients, clip=1.0, delta=params.delta,
            accountant=params.accountant,
        )  # fmt: skip

    def epsilon(self, params: Any, noise_multiplier: float, rounds: int) -> float:
        accountant = self.new_accountant(params, noise_multiplier)
        return accountant.epsilon_after(_COUNT, rounds) if rounds > 0 else 0.0

    def new_accountant(self, params: Any, noise_multiplier: float) -> BandedMFAccountant:
        spec: BandedMFSpec = params.mechanism_spec
        return BandedMFAccountant(
            spec.params(noise_std=noise_multiplier, delta=params.delta, accountant=params.accountant)
        )

    def rounds(self, params: Any, noise_multiplier: float, *, clip: float, dim: int) -> BandedMFMechanism:
        return BandedMFMechanism(
            params.mechanism_spec, noise_multiplier * clip, dim, clip=clip, delta=params.delta,
            accountant=params.accountant,
        )  # fmt: skip


#: The event a banded-MF accountant counts rounds with (its q and z are not read).
_COUNT = RoundEvent(1.0, 1.0)

#: name -> mechanism (the ``noise-mechanism`` key's choices; ``independent`` first, the default).
NOISE_MECHANISMS: dict[str, NoiseMechanism] = {m.name: m for m in (Independent(), BandedMF())}


def get_noise_mechanism(name: str) -> NoiseMechanism:
    """The noise mechanism called ``name``: the one lookup of `NOISE_MECHANISMS` (`ConfigError` naming the allowed
    ones)."""
    return lookup(NOISE_MECHANISMS, name, key="noise-mechanism", what="noise mechanism")
