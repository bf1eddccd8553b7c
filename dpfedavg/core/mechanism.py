"""Noise placements as objects: each one owns what is added *and* what is accounted.

A round releases ``sum_{i in S_k, included} g_i + noise`` (Alg. 1/2 lines 10-12, before the
division by ``r``). A `NoisePlacement` says how that noise is split between the sampled
clients (Alg. 1 line 10) and the server, under which neighbouring relation (`Neighbouring`,
the privacy unit) the round is the Poisson-subsampled Gaussian mechanism
``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` the accountant composes, and which participation
that needs (`NoisePlacement.participation_error()`).

The invariant every placement keeps: **the released sum carries exactly ``N(0, (zC)^2 I)``, whoever
took part.** Clients that were sampled but whose update did not enter the sum (dropouts, failures,
rejected replies, a secure-aggregation round that could not finish) leave a gap in the noise, which
the server fills (`NoisePlacement.server_std()`: the *top-up*). The noise a third party sees
therefore never depends on how many clients were in the round, and every round is charged the
nominal ``z`` (`NoisePlacement.accounted_noise_multiplier()`): calibration, the budget and the
reported epsilon agree exactly. (Without the top-up the variance of the released noise would grow
with the number of included clients, and whether a client took part would show in the variance as
well as in the mean; the auditor's tests keep such a mis-accounted placement to show that they
catch it.)

Like pfl-research's ``pfl/privacy`` mechanisms, a placement is small and stateless; `PLACEMENTS`
is the registry the config's ``noise-placement`` choices come from.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np

from dpfedavg.core.dp import gaussian_noise
from dpfedavg.core.noise import GaussianLaw
from dpfedavg.core.types import Vector
from dpfedavg.errors import lookup

__all__ = ["Neighbouring", "NoisePlacement", "PLACEMENTS", "get_placement", "released_sum"]


class Neighbouring(enum.Enum):
    """The neighbouring relation (the privacy unit) under which a placement's accounted event is exact."""

    #: Neighbouring federations differ by one client's presence (the paper's unit).
    ADD_REMOVE = "add/remove one client"
    #: Neighbouring federations differ in one client's data: the client is present in both, and in one of them
    #: it sends g = 0 (but still its noise). Weaker than add/remove: the number of clients is public.
    ZERO_OUT = "zero-out one client (present in both federations; in one it sends g = 0, with its noise)"


@dataclass(frozen=True)
class NoisePlacement:
    """Where a round's Gaussian noise is added, and what the round releases (see the module docstring).

    Attributes
    ----------
    name:
        The ``noise-placement`` key's value.
    adjacency:
        The neighbouring relation under which the accounted event is exact.
    per_client:
        ``"expected"``: each sampled client adds ``(zC)^2 / r`` (Alg. 1 line 10 literally);
        ``"cohort"``: each adds ``(zC)^2 / |S_k|`` (the server sends ``|S_k|``); ``"none"``: clients add nothing.
    full_participation_only:
        The accounting holds only with ``q = 1`` (`participation_error()`).
    description:
        One line for ``config.json``.
    """

    name: str
    adjacency: Neighbouring
    per_client: str
    full_participation_only: bool = False
    description: str = ""

    @property
    def adds_client_noise(self) -> bool:
        """Whether the sampled clients add (a share of) the noise: what secure aggregation needs."""
        return self.per_client != "none"

    @property
    def clients_learn_cohort_size(self) -> bool:
        """Whether each sampled client is told ``|S_k|`` (to scale its share)."""
        return self.per_client == "cohort"

    def participation_error(self, num_clients: int, clients_per_round: float) -> str | None:
        """Why this placement's accounting does not hold at ``q = r / n``, or ``None`` when it does."""
        if not self.full_participation_only or clients_per_round == num_clients:
            return None
        q = clients_per_round / num_clients
        ok = ", ".join(repr(p.name) for p in PLACEMENTS.values() if not p.full_participation_only)
        return (
            f"with 'clients-per-round' = {clients_per_round:g} < 'num-clients' = {num_clients} (q = {q:.4g}): each "
            "client adds (zC)^2/r, so the noise in the sum grows with the number of clients sampled and whether a "
            "client took part shows in its variance; no accounting here covers that. Allowed: "
            f"{self.name!r} only with clients-per-round = num-clients (q = 1, {self.adjacency.value}), or {ok} "
            "for any q"
        )

    # ------------------------------------------------------------ what is added
    def client_std(self, noise_multiplier: float, clip: float, clients_per_round: float, num_sampled: int) -> float:
        """The std of the Gaussian each sampled client adds to its ``g`` (Alg. 1 line 10)."""
        zc = noise_multiplier * clip
        if self.per_client == "expected":
            return zc / math.sqrt(clients_per_round)
        if self.per_client == "cohort":
            return zc / math.sqrt(num_sampled) if num_sampled > 0 else 0.0
        return 0.0

    def server_std(
        self, noise_multiplier: float, clip: float, clients_per_round: float, num_sampled: int, num_included: int
    ) -> float:
        """The std of the Gaussian the server adds to the sum so that it carries ``N(0, (zC)^2 I)``.

        ``num_included`` clients' noisy updates entered the sum, each with `client_std()`; the server
        adds the rest of ``(zC)^2``. Zero when ``z = 0``.
        """
        zc = noise_multiplier * clip
        if zc == 0.0:
            return 0.0
        if not 0 <= num_included <= num_sampled:
            raise ValueError(f"need 0 <= num_included <= num_sampled, got {num_included} and {num_sampled}")
        carried = num_included * self.client_std(noise_multiplier, clip, clients_per_round, num_sampled) ** 2
        missing = zc**2 - carried
        if missing < -1e-9 * zc**2:
            raise ValueError(
                f"{self.name}: {num_included} clients carry more noise ({carried:.6g}) than the sum should "
                f"({zc**2:.6g}); this placement needs q = 1"
            )
        # every share present (up to rounding in zc^2 - m (zc/sqrt(m))^2): nothing to add
        return math.sqrt(missing) if missing > 1e-9 * zc**2 else 0.0

    # --------------------------------------------------------- what is accounted
    def accounted_noise_multiplier(
        self, noise_multiplier: float, clients_per_round: float, num_sampled: int, num_included: int
    ) -> float | None:
        """``z_k``: the std of the released sum's noise over ``C``: ``z``, because the server tops up.

        ``None`` would mean a round that released nothing about anyone; no placement here returns it.
        """
        return noise_multiplier


#: Every sampled client adds ``(zC)^2 / |S_k|``; the sum of all of them carries ``(zC)^2`` (default).
CLIENT_CALIBRATED = NoisePlacement(
    "client-calibrated",
    Neighbouring.ADD_REMOVE,
    "cohort",
    description="each sampled client adds N(0, (zC)^2/|S_k|); the server tops up what dropouts left out",
)
#: The trusted server adds ``(zC)^2`` once (central DP).
SERVER = NoisePlacement(
    "server", Neighbouring.ADD_REMOVE, "none", description="the server adds N(0, (zC)^2) to the sum"
)
#: Alg. 1 line 10 literally: every client adds ``(zC)^2 / r``. Exact only under zero-out adjacency and q = 1.
CLIENT = NoisePlacement(
    "client",
    Neighbouring.ZERO_OUT,
    "expected",
    full_participation_only=True,
    description="each client adds N(0, (zC)^2/r) (Alg. 1 line 10); needs q = 1; zero-out adjacency",
)

#: The placements a run config may name (``noise-placement``).
PLACEMENTS: dict[str, NoisePlacement] = {p.name: p for p in (CLIENT_CALIBRATED, CLIENT, SERVER)}


def get_placement(name: str) -> NoisePlacement:
    """The placement called ``name``: the one lookup of `PLACEMENTS` (`ConfigError` naming the allowed ones)."""
    return lookup(PLACEMENTS, name, key="noise-placement", what="noise placement")


def released_sum(
    g: np.ndarray,
    placement: NoisePlacement,
    *,
    noise_multiplier: float,
    clip: float,
    clients_per_round: float,
    num_sampled: int,
    client_rngs: list[np.random.Generator],
    server_rng: np.random.Generator,
) -> Vector:
    """One round's released sum ``sum_i (g_i + zeta_i) + top-up`` for the included clients' rows ``g``.

    The same two steps the engines run (each client's Gaussian law, `GaussianLaw`,
    with `NoisePlacement.client_std()`, then the server's `NoisePlacement.server_std()`), without
    local training: ``g`` (``(m, d)``, ``m <= num_sampled``) are the bounded updates of the clients whose
    replies entered the sum. Used by the privacy auditor and the tests.
    """
    law = GaussianLaw()
    g = np.atleast_2d(np.asarray(g, dtype=np.float64))
    m, dim = g.shape
    if len(client_rngs) != m:
        raise ValueError(f"need one generator per included client: {m} rows, {len(client_rngs)} generators")
    std = placement.client_std(noise_multiplier, clip, clients_per_round, num_sampled)
    total = np.zeros(dim)
    for row, rng in zip(g, client_rngs, strict=True):
        total += law.add(row, clip, std, rng)
    top = placement.server_std(noise_multiplier, clip, clients_per_round, num_sampled, m)
    if top > 0:
        total += gaussian_noise(dim, top, server_rng)
    return total
