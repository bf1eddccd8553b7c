"""The narrow, frozen parameters the privacy side reads (jax-privacy's ``DpParams`` is the model).

Accounting and calibration never see the 50-field `RunConfig`: a run's `PrivacySetup`
builds its `DpParams` once (`DpParams.from_config()`, in `dpfedavg.privacy.setup.PrivacySetup.resolve()`) and
every privacy function takes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dpfedavg.core.mechanism import Neighbouring, NoisePlacement, get_placement
from dpfedavg.privacy.noise_mechanisms import NoiseMechanism, get_noise_mechanism

__all__ = ["DpParams", "Neighbouring"]


@dataclass(frozen=True)
class DpParams:
    """What accounting a run needs: the sampling, the rounds, the target and the accountant.

    Attributes
    ----------
    num_clients, clients_per_round:
        ``n`` and the expected cohort ``r``; each client is sampled with ``q = r / n`` (Poisson).
    rounds:
        ``K``.
    delta:
        The ``delta`` of the reported ``(epsilon, delta)``.
    accountant:
        A name in `dpfedavg.privacy.accountants.ACCOUNTANTS`.
    target_epsilon:
        Calibrate ``z`` so that the run spends at most this; ``None`` with a given ``noise_multiplier``.
    noise_multiplier:
        A given ``z`` (``None``: calibrated from ``target_epsilon``).
    max_epsilon:
        A budget: stop before a round that would exceed it (``None``: none).
    neighbouring:
        The privacy unit under which the accounted event is exact (the noise placement's).
    mechanism:
        A name in `dpfedavg.privacy.noise_mechanisms.NOISE_MECHANISMS` (``noise-mechanism``).
    mechanism_spec:
        The mechanism's own narrow settings (`spec()`;
        ``banded-mf``: the participation rule and the strategy coefficients; ``independent``: ``None``).
    """

    num_clients: int
    clients_per_round: float
    rounds: int
    delta: float
    accountant: str
    target_epsilon: float | None
    noise_multiplier: float | None
    max_epsilon: float | None
    neighbouring: Neighbouring
    mechanism: str = "independent"
    mechanism_spec: Any = None

    @property
    def q(self) -> float:
        """The sampling rate ``r / n``."""
        return self.clients_per_round / self.num_clients

    @classmethod
    def from_config(
        cls, cfg: Any, placement: NoisePlacement | None = None, noise_mechanism: NoiseMechanism | None = None
    ) -> DpParams:
        """The parameters of a `RunConfig` (``0`` means "none" for the epsilons).

        ``placement`` and ``noise_mechanism``: the objects ``cfg`` names, when the caller looked them up already
        (`dpfedavg.privacy.setup.PrivacySetup.resolve()`); looked up here otherwise.
        """
        placement = placement if placement is not None else get_placement(cfg.noise_placement)
        noise_mechanism = noise_mechanism if noise_mechanism is not None else get_noise_mechanism(cfg.noise_mechanism)
        return cls(
            num_clients=cfg.num_clients,
            clients_per_round=cfg.clients_per_round,
            rounds=cfg.num_rounds,
            delta=cfg.delta,
            accountant=cfg.accountant,
            target_epsilon=cfg.epsilon if cfg.epsilon > 0 else None,
            noise_multiplier=cfg.noise_multiplier,
            max_epsilon=cfg.max_epsilon if cfg.max_epsilon > 0 else None,
            neighbouring=placement.adjacency,
            mechanism=noise_mechanism.name,
            mechanism_spec=noise_mechanism.spec(cfg),
        )
