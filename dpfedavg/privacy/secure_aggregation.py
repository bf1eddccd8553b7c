"""When secure aggregation keeps the reported guarantee: every check of a SecAgg+ run, in one place.

Under secure aggregation the server sees only the sum of the clients' encoded ``g + zeta``
(`dpfedavg.core.secagg`: an integer grid, discrete Gaussian noise, coordinates clipped to
``[-c, c]``). Two kinds of settings would void the guarantee, and both are refused here:

* **combinations** (`SecAggSettings.config_errors()`, checked when a
  `RunConfig` is built): the clients must add the noise (the placement's
  `adds_client_noise`), the bound must give
  ``||g|| <= C`` (the grid's range comes from it), no diagnostics (they send clean updates), one
  client per SuperNode, and ``n Q < M`` so that the integer sum cannot wrap around;
* **the encoding's privacy terms** (`check_privacy_terms()`, checked once ``z`` is calibrated and
  the model's size is known):

  - ``tau`` (Kairouz, Liu, Steinke 2021, Prop. 14 / Thm. 1): a sum of ``N`` discrete Gaussians is only
    close to a discrete Gaussian when each has a std of a few grid steps; the concentrated-DP epsilon
    grows from ``1/z`` by up to ``tau sqrt(d)``. Required: ``tau sqrt(d) z <=``
    `MAX_TAU_SLACK`, at the worst case ``|S_k| = n`` (the smallest per-client std).
  - coordinate clipping to ``[-c, c]``: the run is ``(epsilon, delta + (1 + e^epsilon) p)``-DP with
    ``p`` the union bound over ``K n d`` coordinates. Required: ``(1 + e^epsilon) p <=``
    `MAX_DELTA_SLACK` ``delta``.

No Flower import; the protocol itself is `dpfedavg.flower.secure_aggregation`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from dpfedavg.core.dp import BOUNDS, SensitivityBound
from dpfedavg.core.mechanism import PLACEMENTS, NoisePlacement
from dpfedavg.core.noise import NoiseLaw
from dpfedavg.core.secagg import SecAggGrid, SecAggPrivacyTerms, quantization_error_bound
from dpfedavg.errors import ConfigError

__all__ = [
    "MAX_DELTA_SLACK",
    "MAX_TAU_SLACK",
    "MIN_SECAGG_COHORT",
    "SecAggRelease",
    "SecAggSettings",
    "check_privacy_terms",
    "describe",
    "privacy_terms",
]

#: The encoding may loosen the reported guarantee by at most these: the DDG ``tau`` (Kairouz et al. 2021,
#: Thm. 1 adds ``tau sqrt(d)`` to the concentrated-DP epsilon ``1/z``) relative to ``1/z``, and the
#: clipping slack ``(1 + e^eps) p`` relative to delta.
MAX_TAU_SLACK = 1e-6
MAX_DELTA_SLACK = 1e-3
#: The fewest clients of a SecAgg+ round: the server skips smaller rounds, and a node refuses them (its policy's
#: ``secagg-min-cohort`` defaults to this and cannot go below it). In a cohort of 2 each client reads the other's
#: vector from the sum; a threshold above half of a client's shares (so that no server rebuilds both its mask
#: seed and its key) needs 3.
MIN_SECAGG_COHORT = 3


@dataclass(frozen=True)
class SecAggSettings:
    """The ``secagg-*`` keys: the grid, the modulus, the clipping range and the protocol's parameters."""

    quantization_bits: int
    modulus_bits: int
    clip_stds: float
    num_shares: float
    reconstruction_threshold: float
    timeout: float

    @classmethod
    def from_config(cls, cfg: Any) -> SecAggSettings:
        """The settings of a `RunConfig`: each field from its ``secagg-*`` key."""
        return cls(**{field.name: getattr(cfg, f"secagg_{field.name}") for field in fields(cls)})

    def config_errors(
        self,
        *,
        placement: NoisePlacement,
        bound: SensitivityBound,
        num_clients: int,
        clients_per_node: int,
        diagnostics: bool,
    ) -> list[str]:
        """The combinations under which secure aggregation cannot keep the guarantee (one text each)."""
        errors = []
        if clients_per_node > 1:
            errors.append(
                f"'secure-aggregation' = True with 'clients-per-node' = {clients_per_node}: SecAgg+ hides each "
                "SuperNode's input from the server, and a node hosting several clients computes each of their updates "
                "in the clear, so the guarantee would be per node, not per client; allowed: clients-per-node = 1"
            )
        if not placement.adds_client_noise:
            allowed = ", ".join(repr(name) for name, p in PLACEMENTS.items() if p.adds_client_noise)
            errors.append(
                f"'secure-aggregation' = True with 'noise-placement' = {placement.name!r}: the server only sees "
                f"the sum, so the clients must add the noise; allowed: {allowed}"
            )
        if not bound.private:
            allowed = ", ".join(repr(name) for name, b in BOUNDS.items() if b.private)
            errors.append(
                f"'secure-aggregation' = True with 'algorithm' = {bound.name!r}: the quantization range comes "
                f"from the bound ||g|| <= C; allowed: {allowed}"
            )
        if diagnostics:
            errors.append(
                "'secure-aggregation' = True with 'diagnostics' = True: diagnostics send every client's clean "
                "update to the server, which secure aggregation exists to prevent; set diagnostics=false"
            )
        bits, mbits = self.quantization_bits, self.modulus_bits
        if bits >= mbits:
            errors.append(f"'secagg-quantization-bits' = {bits} must be below 'secagg-modulus-bits' = {mbits}")
        elif num_clients * 2**bits >= 2**mbits:
            most = (2**mbits - 1) // 2**bits
            fit = max(1, mbits - math.ceil(math.log2(num_clients + 1)))
            errors.append(
                f"'secagg-quantization-bits' = {bits} with 'secagg-modulus-bits' = {mbits} lets at most {most} "
                f"clients be summed without wrapping around, but all 'num-clients' = {num_clients} may be "
                f"sampled; use secagg-quantization-bits <= {fit}"
            )
        return errors

    def grid(self, bound: float, noise_std: float) -> SecAggGrid:
        """The round's grid for the bound ``C`` (or ``C_aug``) and a client's noise std."""
        return SecAggGrid.for_round(bound, noise_std, self.clip_stds, self.quantization_bits, self.modulus_bits)


@dataclass(frozen=True)
class SecAggRelease:
    """What the encoding's privacy terms read from the run: the server builds it once.

    ``bound`` is the first round's norm bound of a client's vector (``C``, or ``C_aug`` with
    ``adaptive``, whose bound then changes every round); ``dim`` the length of that vector.
    """

    law: NoiseLaw
    placement: NoisePlacement
    noise_multiplier: float
    bound: float
    adaptive: bool
    clients_per_round: float
    num_clients: int
    dim: int
    rounds: int
    epsilon: float
    delta: float

    def std_at_n(self) -> float:
        """A client's noise std when all ``n`` clients are sampled (the smallest one)."""
        return self.placement.client_std(self.noise_multiplier, self.bound, self.clients_per_round, self.num_clients)


def privacy_terms(
    settings: SecAggSettings, release: SecAggRelease, bits: int | None = None, clip_stds: float | None = None
) -> SecAggPrivacyTerms:
    """The run's noise law's privacy terms (`dpfedavg.core.noise.NoiseLaw.privacy_terms()`), or with other
    ``bits`` / ``clip_stds``.

    With ``adaptive-clip`` the bound ``C_aug`` changes every round, and the grid step (a power of two
    ``>= 2 (C_aug + k s) / Q``) with it; the terms are taken at the worst ratio of noise std to step that
    any ``C_k`` can give (the step just past a power of two), so they hold in every round.
    """
    bits = settings.quantization_bits if bits is None else bits
    clip_stds = settings.clip_stds if clip_stds is None else clip_stds
    bound, std_n = release.bound, release.std_at_n()
    if release.adaptive and std_n > 0:
        # everything scales with C_aug except the power-of-two rounding of the step: scale to the worst case
        needed = 2.0 * (bound + clip_stds * std_n) / 2**bits
        worst = math.ldexp(1.0, math.ceil(math.log2(needed))) / needed * (1.0 + 1e-9)
        bound, std_n = bound * worst, std_n * worst
    keys = ("noise_multiplier", "num_clients", "dim", "rounds", "epsilon", "delta")
    run = {key: getattr(release, key) for key in keys}
    return release.law.privacy_terms(
        clip=bound, std_at_n=std_n, clip_stds=clip_stds, bits=bits, modulus_bits=settings.modulus_bits, **run
    )


def check_privacy_terms(settings: SecAggSettings, release: SecAggRelease) -> None:
    """Refuse settings under which the reported ``(epsilon, delta)`` would not hold (see the module docstring).

    Raises
    ------
    ConfigError
        Naming the key, the resulting tau or delta, the allowed range and the smallest value that works.
    """
    errors = []
    now = privacy_terms(settings, release)
    bits = settings.quantization_bits
    if not now.tau_slack <= MAX_TAU_SLACK:
        ok = [b for b in range(bits + 1, 31) if privacy_terms(settings, release, bits=b).tau_slack <= MAX_TAU_SLACK]
        fix = f"use secagg-quantization-bits >= {ok[0]}" if ok else "no quantization-bits <= 30 suffices"
        errors.append(
            f"'secagg-quantization-bits' = {bits}: the grid is too coarse for the clients' noise (std "
            f"{release.std_at_n():.4g} at |S_k| = n = {release.num_clients}), so the summed discrete Gaussians are "
            f"tau = {now.tau:.3g} away from a discrete Gaussian and the reported epsilon does not hold (allowed: "
            f"tau sqrt(d) z <= {MAX_TAU_SLACK:g}, here {now.tau_slack:.3g}); {fix}"
        )
    slack = MAX_DELTA_SLACK * release.delta
    if not now.delta_including_clipping - release.delta <= slack:
        k_min = next(
            k / 100
            for k in range(int(settings.clip_stds * 100), 10_000)
            if privacy_terms(settings, release, clip_stds=k / 100).delta_including_clipping - release.delta <= slack
        )
        errors.append(
            f"'secagg-clip-stds' = {settings.clip_stds:g}: coordinates of g + noise are clipped with probability "
            f"up to p = {now.clip_probability:.3g} over the run, so the guarantee is (epsilon, "
            f"delta_including_clipping = {now.delta_including_clipping:.3g}) instead of delta = {release.delta:g} "
            f"(allowed: (1 + e^epsilon) p <= {MAX_DELTA_SLACK:g} delta); use secagg-clip-stds >= {k_min:g}"
        )
    if errors:
        raise ConfigError("invalid run config: " + "; ".join(errors))


def describe(settings: SecAggSettings, release: SecAggRelease, dp: bool) -> dict[str, Any]:
    """The SecAgg+ encoding at ``|S_k| = r`` and its error and privacy terms, for ``config.json``.

    ``clip_probability_bound`` is a union bound over every coordinate of every client that could be
    sampled in every round (``K n d``, each at most ``2 exp(-k^2/2)``); the run's guarantee is then
    ``(epsilon, delta + (1 + e^epsilon) p)``. ``ddg_tau`` is the distance of the summed discrete
    Gaussians from a discrete Gaussian (at ``|S_k| = n``, the worst case). The same terms decide
    `check_privacy_terms()`.
    """
    r = max(1, round(release.clients_per_round))
    std_r = release.placement.client_std(release.noise_multiplier, release.bound, release.clients_per_round, r)
    grid = settings.grid(release.bound, std_r)
    terms = privacy_terms(settings, release)
    return {
        "protocol": "SecAgg+ (Flower SecAggPlusWorkflow / secaggplus_mod)",
        "num_shares": settings.num_shares,
        "reconstruction_threshold": settings.reconstruction_threshold,
        "grid_step_at_r": grid.step,
        "clipping_range_at_r": grid.clipping_range,
        "quantization_levels": grid.levels,
        "modulus": grid.modulus,
        "max_clients_per_round": grid.max_participants,
        "quantization_error_bound_of_sum_at_r": quantization_error_bound(grid, r, release.dim - release.adaptive),
        "clip_probability_bound": terms.clip_probability,
        "delta_including_clipping": terms.delta_including_clipping if dp else None,
        "ddg_tau": terms.tau,
    }
