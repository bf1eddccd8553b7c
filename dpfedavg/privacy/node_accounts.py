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
server chooses whom it asks), **SecAgg+ included**: even when the node checked every stage's parameters
(`dpfedavg.flower.guard`), the server decides who is "dropped". With one consistent unmask list it can declare
honest nodes dropped and read the sum of any threshold-sized subset containing this node, and the node cannot check
that every node got the same lists (Flower's SecAgg+ has no consistency round), so a smaller subset may be read
(``tests/test_secagg_stages.py``, the two-of-three test). No share of the other nodes' noise is therefore
credited; a ledger entry still records whether the round's stages were checked (``secure_aggregation``). Every
release is a Gaussian mechanism, so the account is exactly one Gaussian: ``mu^2 = sum_i m_i / z_i^2``,
composition of Gaussian mechanisms being exact (Dong, Roth and Su 2022,
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


def server_mu2(server_noise_multiplier: float, clients: int) -> float:
    """What one release adds to account (b)'s ``mu^2``: ``m / z^2`` for ``m`` updates each with the node's own
    noise multiplier ``z`` (in one SecAgg+ sum too: sensitivity ``m C``, noise ``sqrt(m) z C``).

    ``z = 0`` (no noise of the node's own): ``inf``.
    """
    if not server_noise_multiplier > 0:
        return math.inf
    return clients / server_noise_multiplier**2


@dataclass(frozen=True)
class PlanCharge:
    """What a run costs account (a) when the node first answers it: ``count`` rounds of ``event``.

    ``redo``: whether a round of the run released again (after a crash) is one more ``event`` (independent
    noise); ``False`` for banded MF, whose analysis covers no redone round (the node refuses one).
    ``participation``: banded MF's ``(scheme, b, k)``, the participation pattern its analysis covers, which the node
    checks against the rounds it answered itself (`check_participation`).
    """

    event: RoundEvent
    count: int
    redo: bool = True
    participation: tuple[str, int, int] | None = None

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
        rule = banded_rule(cfg)
        return PlanCharge(*_banded_event(cfg, z), redo=False, participation=rule)
    q = cfg.sampling_rate
    if clients == 1:
        return PlanCharge(RoundEvent(q, z), cfg.num_rounds)
    group_q = -math.expm1(clients * math.log1p(-q)) if q < 1 else 1.0  # 1 - (1 - q)^m: any of them sampled
    return PlanCharge(RoundEvent(min(1.0, group_q), z / clients), cfg.num_rounds)


def banded_rule(cfg: RunConfig) -> tuple[str, int, int]:
    """Banded MF's participation rule as ``(scheme, b, k)``."""
    from dpfedavg.privacy.params import DpParams

    rule = DpParams.from_config(cfg).mechanism_spec.rule
    return rule.scheme.value, int(rule.bands), int(rule.participations)


def check_participation(participation: tuple[str, int, int], answered: set[int], server_round: int) -> str | None:
    """Why answering ``server_round`` breaks the banded-MF participation rule the run is accounted for, given the
    rounds of the run this node ``answered`` (``None``: it does not).

    Every scheme: at most ``k`` participations, each at least ``b`` rounds after the last (the min-separation
    sensitivity covers exactly those patterns); ``cyclic-poisson``: all in one cyclic group (rounds equal mod ``b``),
    the amplified analysis's ``ceil(K / b)`` steps.
    """
    scheme, bands, most = participation
    if server_round in answered:
        return f"round {server_round} was answered already: the banded analysis covers no round released twice"
    if len(answered) + 1 > most:
        return f"this node took part in {len(answered)} rounds of the run already (max-participations = {most})"
    closest = min((abs(server_round - k) for k in answered), default=bands)
    if closest < bands:
        return f"round {server_round} is {closest} rounds from one this node answered (bands b = {bands} apart)"
    if scheme == "cyclic-poisson" and any((server_round - k) % bands for k in answered):
        return f"round {server_round} is not in the cyclic group (mod b = {bands}) of the rounds this node answered"
    return None


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
