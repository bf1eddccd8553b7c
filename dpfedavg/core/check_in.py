"""Random check-ins: each node decides its own participation (``sampling = "check-in"``; issue 46 item 3).

With server-side Poisson sampling (Alg. 1 line 3) the amplification by sampling assumes a sampler nobody
can predict, and a node cannot check that the server's ``S_k`` was drawn with the ``q`` it declares. With
random check-ins (Balle, Kairouz, McMahan, Thakkar and Thakurta, "Privacy amplification via random
check-ins", NeurIPS 2020) the server sends every round's instructions to *every* available node, and each
node takes part with probability ``q`` drawn from the OS CSPRNG (`checks_in()`): no server seed decides it.
A node that sits out still answers: its update is ``u = 0`` noised as usual (`sat_out_update()`, Alg. 1 line
10's ``0 + zeta``), so the sum's noise does not depend on who took part, and the reply (under SecAgg+: a
masked vector) has the same form either way. The sum then is, in distribution, Alg. 1's Poisson-sampled sum
with ``|S_k| = n`` noise shares: the fixed denominator ``r = q n`` (Alg. 1 line 12) keeps it unbiased.

The node's ``q`` (`resolve_rate()`): its own ``check-in-rate`` (``--node-config``) when it states one, else
the run config's ``q = r / n``. A node whose ``check-in-rate`` differs from the run's ``q`` refuses the run:
the run's reported epsilon, and the node ledger's plan, are Poisson-sampled at the run's ``q``; a node taking
part more often would be under-charged, and one taking part less often would bias the fixed-denominator mean.

Pure Python. The node's hook is `dpfedavg.flower.client_app`; on the server, the ``independent`` noise mechanism
asks every client (`dpfedavg.privacy.noise_mechanisms.IndependentRounds.select`).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable

import numpy as np

from dpfedavg.core.local import ClientUpdate, zero_updates
from dpfedavg.core.types import RoundInstructions
from dpfedavg.errors import ConfigError

__all__ = [
    "CHECK_IN",
    "CHECK_IN_RATE",
    "POISSON",
    "SAMPLINGS",
    "CheckInRateMismatch",
    "checks_in",
    "check_engine",
    "node_update",
    "resolve_rate",
    "sat_out_update",
]

#: ``sampling`` value: the server samples ``S_k`` (Poisson with ``q = r/n``, Alg. 1 line 3).
POISSON = "poisson"
#: ``sampling`` value: every available node is asked; each takes part with probability ``q`` (its own coin).
CHECK_IN = "check-in"
#: The ``sampling`` values of a run config.
SAMPLINGS: tuple[str, ...] = (POISSON, CHECK_IN)
#: The node-config key of the node's own check-in probability.
CHECK_IN_RATE = "check-in-rate"
#: Bits of a uniform draw (a double's mantissa): ``P(take part) = ceil(q 2^53) / 2^53``, within ``2^-53`` of ``q``.
_BITS = 53
#: Relative tolerance when the node's rate is compared with the run's ``r / n`` (written by two parties as decimals).
_RTOL = 1e-9


class CheckInRateMismatch(ValueError):
    """The node's ``check-in-rate`` is not the run's ``q``: the message names both values."""


def resolve_rate(node_rate: float | None, run_rate: float) -> float:
    """The ``q`` this node checks in with: its own ``check-in-rate`` if stated (``None``: not), else the run's.

    Raises `CheckInRateMismatch` when both are given and differ (relative tolerance ``1e-9``): the run's epsilon
    and the ledger's charge are computed at one ``q``, the run's (module docstring).
    """
    if not 0 < run_rate <= 1:
        raise ValueError(f"the run's q = r/n = {run_rate!r} is not in (0, 1]")
    if node_rate is None:
        return run_rate
    if not math.isclose(node_rate, run_rate, rel_tol=_RTOL, abs_tol=0.0):
        raise CheckInRateMismatch(
            f"this node's {CHECK_IN_RATE} = {node_rate:g} differs from the run's q = clients-per-round / num-clients "
            f"= {run_rate:.10g}: the run's epsilon and this node's ledger are accounted at the run's q, so a node "
            f"checking in at another rate is refused (allowed: {CHECK_IN_RATE} = {run_rate:.10g}, or no "
            f"{CHECK_IN_RATE})"
        )
    return node_rate


def checks_in(q: float, randbits: Callable[[int], int] = secrets.randbits) -> bool:
    """Whether this node takes part in the round: ``True`` with probability ``q``, from the OS CSPRNG.

    ``secrets.randbits`` (``os.urandom``): nothing the server sends (its seed, the round, the model) enters the
    draw, so neither the server nor anyone who knows the run's seed can predict or replay it. ``randbits`` is a
    parameter for tests only.
    """
    if not 0 <= q <= 1:
        raise ValueError(f"check-in probability q = {q!r} is not in [0, 1]")
    return randbits(_BITS) < math.ceil(q * 2**_BITS)


def sat_out_update(client_id: int, dim: int, ins: RoundInstructions, dtype: np.dtype | type) -> ClientUpdate:
    """What a node that sits out the round sends: ``0 + zeta`` (its noise share at the round's ``noise_std``,
    Alg. 1 line 10), so the sum's noise is the same whoever took part (`dpfedavg.core.local.zero_updates()`)."""
    (update,) = zero_updates([client_id], dim, ins, dtype=dtype)
    return update


def node_update(
    update: ClientUpdate, *, sampling: str, q: float, client_id: int, dim: int, ins: RoundInstructions,
    dtype: np.dtype | type,
) -> ClientUpdate:  # fmt: skip
    """What the node sends: ``update`` (trained on its data, Alg. 1 lines 4-10), or, in a ``check-in`` run whose
    coin (`checks_in()`, probability ``q``) says this node sits out, `sat_out_update()` in its place.

    The node trains either way, so the time its reply takes does not tell the server whether it took part. Which
    it did is logged nowhere (the node's log is read by its operator only, but says nothing either way).
    """
    if sampling != CHECK_IN or checks_in(q):
        return update
    return sat_out_update(client_id, dim, ins, dtype)


def check_engine(sampling: str, engine: str) -> None:
    """`ConfigError` when ``sampling`` cannot run on ``engine``: check-ins are the nodes' own draws, which an
    in-process engine, computing every client itself, does not make."""
    if sampling != CHECK_IN or engine == "flower":
        return
    raise ConfigError(
        f"invalid run config: 'sampling' = {CHECK_IN!r} on the {engine!r} engine: random check-ins are decided by "
        "each SuperNode from its own randomness, so they run through Flower only (flwr run with dpfedavg's apps); "
        f"in process, sampling = {POISSON!r} at the same q = r/n draws the same distribution"
    )
