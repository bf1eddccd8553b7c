"""A deliberately mis-accounted noise placement, for the auditor's tests only (no production registry has it).

Each sampled client adds ``N(0, (zC)^2 / r)`` (Alg. 1 line 10 literally), the server adds no top-up, and the
round is charged ``z sqrt(m / r)`` for ``m`` included replies under add/remove: the variance of the sum then
reveals whether a client took part, which that accounting ignores. The tests show that the auditor and the
exact privacy loss catch it.
"""

from __future__ import annotations

import math

from dpfedavg.core.mechanism import Neighbouring, NoisePlacement


class _UnderAccountedClient(NoisePlacement):
    def server_std(
        self, noise_multiplier: float, clip: float, clients_per_round: float, num_sampled: int, num_included: int
    ) -> float:
        return 0.0  # no top-up

    def accounted_noise_multiplier(
        self, noise_multiplier: float, clients_per_round: float, num_sampled: int, num_included: int
    ) -> float | None:
        if num_included == 0:
            return None
        return noise_multiplier * math.sqrt(num_included / clients_per_round)


LEGACY_CLIENT = _UnderAccountedClient(
    "legacy-client",
    Neighbouring.ADD_REMOVE,
    "expected",
    full_participation_only=True,
    description="MIS-ACCOUNTED: per-client N(0, (zC)^2/r) under add/remove, no top-up (test support only)",
)


class StdForVariance:
    """A deliberately broken noise placement: each client adds std ``zC / |S_k|`` (a std where the variance was
    meant), the server, believing every share present, adds nothing; the accountant still charges ``z`` every
    round. A correct audit flags it (``tests/test_canary.py``, ``benchmarks/bench_canary_audit.py``, which
    imports it from here). Wraps a placement of ``dpfedavg.core.mechanism.PLACEMENTS``."""

    def __init__(self, base: NoisePlacement) -> None:
        self._base = base

    def __getattr__(self, name: str):
        return getattr(self._base, name)

    def client_std(self, noise_multiplier: float, clip: float, clients_per_round: float, num_sampled: int) -> float:
        return noise_multiplier * clip / num_sampled if num_sampled else 0.0

    def server_std(
        self, noise_multiplier: float, clip: float, clients_per_round: float, num_sampled: int, num_included: int
    ) -> float:
        return 0.0
