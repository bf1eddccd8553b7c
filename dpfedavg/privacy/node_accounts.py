"""The two accounts of a node's privacy ledger, and what one release adds to each (issue 46, items 2 and 4).

A SuperNode's ledger (`dpfedavg.privacy.ledger`) keeps two accounts, each against one threat:

**released** (account (a)): against those who see the *released model* (the run's participants, whoever gets
the final weights): the noisy sum, at the sampling the run declares. A run is charged the first time the node
answers it as its own mechanism (`released_plan()`): ``K x PoissonSampled(q, Gaussian(z))`` for independent
noise (Alg. 1: one sampled round per ``k``), the banded-MF run's own event for ``noise-mechanism = banded-mf``
(`dpfedavg.privacy.banded_mf_accounting.run_dp_event`), and with ``m`` virtual clients of one owner the sum's
sensitivity ``m C`` (``z / m``) sampled with ``1 - (1 - q)^m``. Bounded by ``max-epsilon-released`` (default
``max-epsilon``).

**server** (account (b)): against the *server itself*, which sees what the node sends in each release: its own
update with its own noise share (``z_own = s / C``, Alg. 1 line 10), with no amplification by sampling (the
server chooses whom it asks), unless the release went through SecAgg+ whose parameters the node checked, where the
server sees only the sum of the cohort's shares (``z_own sqrt(|S_k|)``). Every release is a Gaussian mechanism,
so the account is exactly one Gaussian: ``mu^2 = sum_i m_i / z_i^2`` (``(m_i / z_i)^2`` under checked SecAgg+:
the ``m`` updates sit in one sum), composition of Gaussian mechanisms being exact (Dong, Roth and Su 2022,
Corollary 3.3), read at delta by `gaussian_epsilon()`. Bounded by ``max-epsilon`` (unless
``allow-server-noise = true``: the operator then trusts the server with the clean update).

Pure functions over `dpfedavg.config.RunConfig`; no Flower import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dpfedavg.config import RunConfig
from dpfedavg.privacy.accountants import RoundEvent

__all__ = ["RELEASED", "SERVER", "PlanCharge", "gaussian_epsilon", "released_plan", "server_mu2"]

#: Account (a): against those who see the released model.
RELEASED = "released"
#: Account (b): against the server itself.
SERVER = "server"


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Epsilon at ``delta`` of the Gaussian mechanism with sensitivity over noise std ``mu`` (``mu``-GDP), exactly.

    ``delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)`` (Balle and Wang 2018, Theorem 8; Dong, Roth
    and Su 2022, Corollary 2.13), solved for ``eps`` (the second term in log space). ``mu = inf``: ``inf``.
    """
    from scipy.optimize import brentq
    from scipy.special import log_ndtr

    if mu == 0:
        return 0.0
    if not math.isfinite(mu):
        return math.inf

    def excess(eps: float) -> float:
        return math.exp(log_ndtr(-eps / mu + mu / 2)) - math.exp(eps + log_ndtr(-eps / mu - mu / 2)) - delta

    if excess(0.0) <= 0:
        return 0.0
    high = 1.0
    while excess(high) > 0:
        high *= 2
    return float(brentq(excess, high / 2 if high > 1 else 0.0, high, xtol=1e-12, rtol=1e-12))


def server_mu2(server_noise_multiplier: float, clients: int, secure: bool) -> float:
    """What one release adds to account (b)'s ``mu^2``: ``m / z^2`` (``(m / z)^2`` in one checked SecAgg+ sum).

    ``z = 0`` (no noise of the node's own): ``inf``.
    """
    if not server_noise_multiplier > 0:
        return math.inf
    return (clients / server_noise_multiplier) ** 2 if secure else clients / server_noise_multiplier**2


@dataclass(frozen=True)
class PlanCharge:
    """What a run costs account (a) when the node first answers it: ``count`` rounds of ``event``.

    ``redo``: whether a round of the run released again (after a crash) is one more ``event`` (independent
    noise); ``False`` for banded MF, whose analysis covers no redone round (the node refuses one).
    """

    event: RoundEvent
    count: int
    redo: bool = True

    def to_json(self) -> list[Any]:
        return [self.event.q, self.event.z, self.count]


def released_plan(cfg: RunConfig, z: float, clients: int = 1) -> PlanCharge:
    """The run's own mechanism as the node charges it to account (a): see the module docstring.

    ``z`` is the round's noise multiplier (checked against the run config), ``clients`` the virtual clients of
    this node (``clients-per-node``), all one owner's: the sum's sensitivity is ``m C``.
    """
    if cfg.noise_mechanism == "banded-mf":
        if clients != 1:
            raise ValueError("banded-MF noise with virtual clients: the node cannot charge its clients' groups")
        return PlanCharge(*_banded_event(cfg, z), redo=False)
    q = cfg.sampling_rate
    if clients == 1:
        return PlanCharge(RoundEvent(q, z), cfg.num_rounds)
    group_q = -math.expm1(clients * math.log1p(-q)) if q < 1 else 1.0  # 1 - (1 - q)^m: any of them sampled
    return PlanCharge(RoundEvent(min(1.0, group_q), z / clients), cfg.num_rounds)


def _banded_event(cfg: RunConfig, z: float) -> tuple[RoundEvent, int]:
    """The banded-MF run's dp-accounting event (``run_dp_event``) as ``count`` rounds of one ``RoundEvent``."""
    import dp_accounting

    from dpfedavg.privacy.banded_mf_accounting import run_dp_event
    from dpfedavg.privacy.params import DpParams

    spec = DpParams.from_config(cfg).mechanism_spec
    event = run_dp_event(spec.params(noise_std=z, delta=cfg.delta, accountant="pld"))
    if isinstance(event, dp_accounting.NonPrivateDpEvent):
        return RoundEvent(1.0, 0.0), 1
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return RoundEvent(1.0, float(event.noise_multiplier)), 1
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        inner = event.event
        assert isinstance(inner, dp_accounting.PoissonSampledDpEvent)
        assert isinstance(inner.event, dp_accounting.GaussianDpEvent)
        return RoundEvent(float(inner.sampling_probability), float(inner.event.noise_multiplier)), int(event.count)
    raise ValueError(f"a banded-MF event the node cannot charge: {event!r}")
