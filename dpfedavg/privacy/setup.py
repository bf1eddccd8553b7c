"""A run's privacy set-up, resolved once: every name of the config turned into its object, ``z`` calibrated.

`PrivacySetup.resolve()` is the one function that reads the privacy keys of a `RunConfig`. Every entry point
calls it once per run (through `dpfedavg.server.run.prepare_run()`: the Python API, the CLI, a sweep's batch,
which resolves all its runs before any folder is made; the ServerApp before anything is written; the app
strategy once its population is known), and `DPServer` reads the set-up instead of the config's names:

* the sensitivity bound (``algorithm``, `dpfedavg.core.dp.get_bound`), the noise placement (``noise-placement``,
  `dpfedavg.core.mechanism.get_placement`), the noise law (``secure-aggregation``, `dpfedavg.core.noise.noise_law`)
  and the noise mechanism (``noise-mechanism``, `dpfedavg.privacy.noise_mechanisms.get_noise_mechanism`);
* the narrow parameters (`DpParams`) and the calibrated plan (`PrivacyPlan`: ``z``, the budget);
* adaptive clipping's settings (``C_0``, ``gamma``, ``eta_C``, ``sigma_b``, the range of ``C_k``) and the
  ``secagg-*`` settings;
* the federation the server samples from (`FederationSize`: ``n`` and ``r``, and with canaries
  ``n' = n + inserted`` and ``r' = q n'``).

Like jax-privacy's ``DPExecutionPlan``: one frozen value made before the first round, read by everything after.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpfedavg.core.adaptive_clip import AdaptiveClip
from dpfedavg.core.canaries import canary_federation_size, inserted_canaries
from dpfedavg.core.dp import SensitivityBound, get_bound
from dpfedavg.core.mechanism import NoisePlacement, get_placement
from dpfedavg.core.noise import NoiseLaw, noise_law
from dpfedavg.privacy.accountants import Accountant
from dpfedavg.privacy.noise_mechanisms import NoiseMechanism, get_noise_mechanism
from dpfedavg.privacy.params import DpParams
from dpfedavg.privacy.plan import PrivacyPlan, plan_privacy
from dpfedavg.privacy.secure_aggregation import SecAggSettings

if TYPE_CHECKING:
    from dpfedavg.config import RunConfig

__all__ = ["FederationSize", "PrivacySetup"]


@dataclass(frozen=True)
class FederationSize:
    """Who the server samples from: the task's ``n`` clients with the expected cohort ``r``, plus the inserted canaries.

    With ``canary-clients`` the inserted canaries follow from ``seed`` alone (`inserted_canaries()`), so a node
    computes the same ``n'`` and ``r'`` from its run config. Every client, canary or not, is sampled with
    ``q = r / n``: the server's population is ``n' = n + inserted`` and its fixed denominator (Alg. 1 line 12)
    ``r' = q n'``; the accountant's event and so ``z`` and epsilon are those of the run without canaries.
    """

    num_clients: int
    clients_per_round: float
    inserted_canaries: int = 0

    @classmethod
    def of(cls, cfg: RunConfig) -> FederationSize:
        """The federation of ``cfg`` (``n``, ``r``, and the canaries its ``seed`` inserts)."""
        inserted = int(inserted_canaries(cfg.seed, cfg.canary_clients).sum()) if cfg.canary_clients else 0
        return cls(cfg.num_clients, cfg.clients_per_round, inserted)

    @property
    def sampled(self) -> tuple[int, float]:
        """``(n', r')``: the population the server samples and its expected cohort (``(n, r)`` without canaries)."""
        return canary_federation_size(self.num_clients, self.clients_per_round, self.inserted_canaries)

    @property
    def sampled_clients(self) -> int:
        """``n'``."""
        return self.sampled[0]

    @property
    def sampled_cohort(self) -> float:
        """``r' = q n'``: the expected cohort of the sampled population, the fixed denominator."""
        return self.sampled[1]


@dataclass(frozen=True)
class PrivacySetup:
    """Everything a run's privacy reads, resolved once from its config (module docstring).

    Attributes
    ----------
    bound:
        The sensitivity bound (``algorithm``): what ``g`` is, whether the run is private, whether ``C`` adapts.
    placement:
        The noise placement (``noise-placement``): who adds how much noise, what is accounted.
    noise_law:
        What each client's ``zeta`` is and what it adds to the guarantee (``secure-aggregation``).
    noise_mechanism:
        Who takes part each round, what the server adds, the fixed denominator, the accountant
        (``noise-mechanism``).
    params:
        The narrow parameters of the sampled federation (``n'``, ``r'``; ``n``, ``r`` without canaries).
    plan:
        ``z`` (calibrated or given), the budget checked, ``sigma_b``; its ``params`` are `params`.
    adaptive:
        With ``adaptive-clip``, the rule's settings and ``C_0`` (the server keeps its own copy as ``C_k``
        moves); ``None`` for a fixed ``C``.
    secagg:
        The ``secagg-*`` settings; ``None`` without secure aggregation.
    federation:
        ``n``, ``r`` and the canaries' ``n'``, ``r'``.
    """

    bound: SensitivityBound
    placement: NoisePlacement
    noise_law: NoiseLaw
    noise_mechanism: NoiseMechanism
    params: DpParams
    plan: PrivacyPlan
    adaptive: AdaptiveClip | None
    secagg: SecAggSettings | None
    federation: FederationSize

    @classmethod
    def resolve(cls, cfg: RunConfig) -> PrivacySetup:
        """The privacy set-up of ``cfg``: the one function that resolves it (see the module docstring).

        Raises
        ------
        dpfedavg.errors.ConfigError
            A privacy plan that cannot hold (`plan_privacy()`): an unreachable target, a budget the first
            round exceeds, an adaptive count without a noise split.
        """
        bound = get_bound(cfg.algorithm)
        placement = get_placement(cfg.noise_placement)
        noise_mechanism = get_noise_mechanism(cfg.noise_mechanism)
        federation = FederationSize.of(cfg)
        params = DpParams.from_config(cfg, placement, noise_mechanism)
        plan = plan_privacy(params, bound, noise_mechanism, cfg.clip_count_stddev)
        if federation.inserted_canaries:  # the same z and q; the rounds sample from the n' clients
            n, r = federation.sampled  # canaries need the independent mechanism (config.py), whose spec reads no n
            params = dataclasses.replace(params, num_clients=n, clients_per_round=r)
            plan = dataclasses.replace(plan, params=params)
        adaptive = None
        if bound.adaptive:
            adaptive = AdaptiveClip(
                clip=cfg.clip,
                target_quantile=cfg.target_quantile,
                clip_lr=cfg.clip_lr,
                count_stddev=plan.count_stddev,  # type: ignore[arg-type]  # resolved by the plan
                noise_multiplier=plan.noise_multiplier,
                clip_floor=cfg.clip_limits[0],
                clip_ceiling=cfg.clip_limits[1],
            )
        return cls(
            bound=bound,
            placement=placement,
            noise_law=noise_law(cfg.secure_aggregation),
            noise_mechanism=noise_mechanism,
            params=params,
            plan=plan,
            adaptive=adaptive,
            secagg=SecAggSettings.from_config(cfg) if cfg.secure_aggregation else None,
            federation=federation,
        )

    def new_accountant(self) -> Accountant | None:
        """A fresh accountant of the run's noise mechanism, method and delta; ``None`` without DP."""
        return self.plan.new_accountant() if self.plan.dp else None
