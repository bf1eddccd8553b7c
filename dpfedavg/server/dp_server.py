"""The server side of Alg. 1 / Alg. 2, independent of Flower.

:class:`DPServer` holds the server state (``w_k``, the momentum buffer, the
accountant, the random iterate, per-round statistics) and runs one round in
two halves:

* :meth:`DPServer.begin_round`: Poisson-sample the clients (line 3), check the
  privacy budget, keep ``w_{k~}`` by reservoir sampling (line 13), and say what
  the sampled clients must do (:class:`RoundInstructions`);
* :meth:`DPServer.finish_round`: sum the clients' ``g + zeta`` (in client-id
  order), add the server's share of the noise (all of it for ``server``
  placement, the missing replies' share otherwise: the sum always carries
  ``N(0, (zC)^2 I)``, see :mod:`dpfedavg.core.mechanism`), divide by the fixed
  ``r`` (line 12), apply momentum and ``beta_k``, and charge the accountant the
  round's (nominal) event.

With ``adaptive-clip`` the server also holds ``C_k`` (:class:`~dpfedavg.core.adaptive_clip.AdaptiveClip`):
the clients' vectors have one more coordinate (their noised count of unclipped updates), the noise
placement sees the augmented bound ``C_aug`` instead of ``C``, and closing a round splits the count off,
releases ``b_k`` and moves to ``C_{k+1}`` (Andrew et al. 2021).

The Flower strategy (:class:`~dpfedavg.strategies.DPFedAvg`) and the batched
engine (:mod:`dpfedavg.engines.batched`) both drive this class, so the two
engines run the same server math.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from dpfedavg.config import ConfigError, RunConfig
from dpfedavg.core import (
    SECURE_NOISE_SEED,
    SecAggGrid,
    Stream,
    fixed_denominator_mean,
    gaussian_noise,
    keep_random_iterate,
    local_lr_at,
    make_rng,
    momentum_step,
    poisson_sample,
    round_noise_seed,
    secure_rng,
    server_lr_at,
)
from dpfedavg.core.adaptive_clip import AdaptiveClip
from dpfedavg.core.dp import get_bound
from dpfedavg.core.mechanism import get_placement
from dpfedavg.core.noise import noise_law
from dpfedavg.core.secagg import SecAggPrivacyTerms
from dpfedavg.core.types import ClientResult, RoundInstructions, Vector
from dpfedavg.privacy.accounting import PrivacyPlan, RoundEvent, plan_privacy, realized_noise_multiplier

__all__ = ["ClientResult", "DPServer", "PrivacyBudgetExhausted", "RoundInstructions", "RoundStats"]

logger = logging.getLogger(__name__)


#: The secure-aggregation encoding may loosen the reported guarantee by at most these (see
#: :func:`check_secure_aggregation`): the DDG ``tau`` (Kairouz et al. 2021, Thm. 1 adds ``tau sqrt(d)`` to the
#: concentrated-DP epsilon ``1/z``) relative to ``1/z``, and the clipping slack ``(1 + e^eps) p`` relative to delta.
SECAGG_MAX_TAU_SLACK = 1e-6
SECAGG_MAX_DELTA_SLACK = 1e-3


def secagg_privacy_terms(
    server: DPServer, bits: int | None = None, clip_stds: float | None = None
) -> SecAggPrivacyTerms:
    """The run's noise law's privacy terms (:meth:`dpfedavg.core.noise.NoiseLaw.privacy_terms`; for secure
    aggregation :func:`dpfedavg.core.secagg.privacy_terms`), or with other ``bits`` / ``clip_stds``.

    With ``adaptive-clip`` the bound ``C_aug`` changes every round, and the grid step (a power of two
    ``>= 2 (C_aug + k s) / Q``) with it; the terms are taken at the worst ratio of noise std to step that
    any ``C_k`` can give (the step just past a power of two), so they hold in every round.
    """
    cfg, plan = server.cfg, server.plan
    bits = cfg.secagg_quantization_bits if bits is None else bits
    clip_stds = cfg.secagg_clip_stds if clip_stds is None else clip_stds
    bound = server.sensitivity
    std_n = server.placement.client_std(plan.noise_multiplier, bound, cfg.clients_per_round, cfg.num_clients)
    if server.adaptive is not None and std_n > 0:
        # everything scales with C_aug except the power-of-two rounding of the step: scale to the worst case
        needed = 2.0 * (bound + clip_stds * std_n) / 2**bits
        worst = math.ldexp(1.0, math.ceil(math.log2(needed))) / needed * (1.0 + 1e-9)
        bound, std_n = bound * worst, std_n * worst
    return server.noise_law.privacy_terms(
        clip=bound,
        noise_multiplier=plan.noise_multiplier,
        std_at_n=std_n,
        clip_stds=clip_stds,
        bits=bits,
        modulus_bits=cfg.secagg_modulus_bits,
        num_clients=cfg.num_clients,
        dim=server.release_dim,  # adaptive-clip's count coordinate is encoded too
        rounds=cfg.num_rounds,
        epsilon=plan.target_epsilon if plan.calibrated else plan.nominal_epsilon,
        delta=plan.delta,
    )


def check_secure_aggregation(server: DPServer) -> None:
    """Reject secure-aggregation settings under which the reported (epsilon, delta) would not hold.

    Two terms of the encoding (:mod:`dpfedavg.core.secagg`) enter the guarantee:

    * ``tau`` (Kairouz, Liu, Steinke 2021, Prop. 14 / Thm. 1): the sum of ``N`` discrete Gaussians is
      only close to a discrete Gaussian when each has a std of a few grid steps; the concentrated-DP
      epsilon grows from ``1/z`` by up to ``tau sqrt(d)``. Required: ``tau sqrt(d) <= 1e-6 / z``, checked
      at the worst case ``|S_k| = n`` (the smallest per-client std).
    * coordinate clipping to ``[-c, c]``: the run is ``(epsilon, delta + (1 + e^epsilon) p)``-DP with ``p``
      the union bound over ``K n d`` coordinates. Required: ``(1 + e^epsilon) p <= 1e-3 delta``.

    Raises
    ------
    ConfigError
        Naming the key, the resulting tau or delta, and the allowed range.
    """
    cfg, plan = server.cfg, server.plan
    n, errors = cfg.num_clients, []
    std_n = server.placement.client_std(plan.noise_multiplier, server.sensitivity, cfg.clients_per_round, n)

    def terms(bits: int, clip_stds: float) -> SecAggPrivacyTerms:
        return secagg_privacy_terms(server, bits, clip_stds)

    now = terms(cfg.secagg_quantization_bits, cfg.secagg_clip_stds)
    if not now.tau_slack <= SECAGG_MAX_TAU_SLACK:
        bits = cfg.secagg_quantization_bits
        ok = [b for b in range(bits + 1, 31) if terms(b, cfg.secagg_clip_stds).tau_slack <= SECAGG_MAX_TAU_SLACK]
        fix = f"use secagg-quantization-bits >= {ok[0]}" if ok else "no quantization-bits <= 30 suffices"
        errors.append(
            f"'secagg-quantization-bits' = {bits}: the grid is too coarse for the clients' noise (std {std_n:.4g} "
            f"at |S_k| = n = {n}), so the summed discrete Gaussians are tau = {now.tau:.3g} away from a discrete "
            f"Gaussian and the reported epsilon does not hold (allowed: tau sqrt(d) z <= {SECAGG_MAX_TAU_SLACK:g}, "
            f"here {now.tau_slack:.3g}); {fix}"
        )
    if not now.delta_including_clipping - plan.delta <= SECAGG_MAX_DELTA_SLACK * plan.delta:
        k_min = next(
            k / 100
            for k in range(int(cfg.secagg_clip_stds * 100), 10_000)
            if terms(cfg.secagg_quantization_bits, k / 100).delta_including_clipping - plan.delta
            <= SECAGG_MAX_DELTA_SLACK * plan.delta
        )
        errors.append(
            f"'secagg-clip-stds' = {cfg.secagg_clip_stds:g}: coordinates of g + noise are clipped with probability "
            f"up to p = {now.clip_probability:.3g} over the run, so the guarantee is (epsilon, "
            f"delta_including_clipping = {now.delta_including_clipping:.3g}) instead of delta = {plan.delta:g} "
            f"(allowed: (1 + e^epsilon) p <= {SECAGG_MAX_DELTA_SLACK:g} delta); use secagg-clip-stds >= {k_min:g}"
        )
    if errors:
        raise ConfigError("invalid run config: " + "; ".join(errors))


class PrivacyBudgetExhausted(Exception):
    """Raised before a round whose release would exceed ``max-epsilon``; the run stops cleanly."""

    def __init__(self, server_round: int, epsilon_now: float, epsilon_next: float, budget: float) -> None:
        super().__init__(
            f"privacy budget max-epsilon={budget:g} reached: stopping before round {server_round} "
            f"(epsilon spent {epsilon_now:.4g}; that round would bring it to {epsilon_next:.4g})"
        )
        self.server_round = server_round


@dataclass
class RoundStats:
    """Per-round training statistics: the one definition of ``metrics.csv``'s training columns.

    The fields from ``num_sampled`` to ``skipped`` are the columns, in this order; the task's metrics
    are written after :data:`METRICS_AFTER` (see :meth:`columns`).
    """

    round: int
    num_sampled: int
    num_received: int = 0
    num_failed: int = 0
    num_dropped: int = 0
    num_rejected: int = 0
    eta: float = float("nan")
    beta: float = float("nan")
    snr: float = float("nan")
    frac_clipped: float = float("nan")
    #: The round's clipping threshold / scaling factor C (C_k with adaptive-clip; NaN without a bound).
    clip: float = float("nan")
    #: adaptive-clip: b_k, the released (noised) fraction of unclipped updates, 1/2 + T_k / r; it replaces
    #: ``frac_clipped``, which is not computed for adaptive-clip.
    frac_unclipped: float = float("nan")
    mean_update_norm: float = float("nan")
    noise_multiplier: float = float("nan")
    epsilon: float = float("nan")
    #: 1 if secure aggregation summed no update this round (the server's noise alone was released).
    skipped: int = 0
    rejected_reasons: list[str] = field(default_factory=list)

    #: The task's metric columns follow this one.
    METRICS_AFTER = "beta"

    @classmethod
    def columns(cls, metric_names: tuple[str, ...] = ()) -> tuple[str, ...]:
        """``metrics.csv``'s columns: ``round``, the training statistics with the task's metrics, ``elapsed_s``."""
        train = [f.name for f in fields(cls) if f.name not in ("round", "rejected_reasons")]
        cut = train.index(cls.METRICS_AFTER) + 1
        return ("round", *train[:cut], *metric_names, *train[cut:], "elapsed_s")

    def as_metrics(self) -> dict[str, float]:
        """The numeric columns for the MetricRecord / CSV."""
        return {name: getattr(self, name) for name in self.columns()[1:-1]}


class DPServer:
    """Server state and per-round math of DP-FedAvg / DP-NormFedAvg / FedAvg.

    Parameters
    ----------
    cfg:
        The validated run configuration.
    dim:
        Length of the flat model vector.
    plan:
        The privacy plan (calibrated ``z``, accountant, budget); computed from
        ``cfg`` when omitted.
    epsilon_each_round:
        Compute the epsilon spent after every round (the ``epsilon`` column).
        The batched engine turns it off for speed: then only the last round's
        is computed (and :attr:`epsilon` on demand); the composition itself is
        never skipped.
    """

    def __init__(
        self, cfg: RunConfig, dim: int, *, plan: PrivacyPlan | None = None, epsilon_each_round: bool = True
    ) -> None:
        self.cfg = cfg
        self.dim = dim
        self.plan = plan if plan is not None else plan_privacy(cfg)
        self.accountant = self.plan.new_accountant() if self.plan.dp else None
        self.epsilon_each_round = epsilon_each_round
        #: The noise placement: what the clients and the server add, and what is accounted.
        self.placement = get_placement(cfg.noise_placement)
        #: The noise law: what each client's zeta is, and what it adds to the guarantee (:mod:`dpfedavg.core.noise`).
        self.noise_law = noise_law(cfg.secure_aggregation)
        #: ``adaptive-clip``: ``C_k`` and its update rule (Andrew et al. 2021); ``None`` for a fixed ``C``.
        self.adaptive: AdaptiveClip | None = None
        if get_bound(cfg.algorithm).adaptive:
            self.adaptive = AdaptiveClip(
                clip=cfg.clip,
                target_quantile=cfg.target_quantile,
                clip_lr=cfg.clip_lr,
                count_stddev=cfg.count_stddev,
                noise_multiplier=self.plan.noise_multiplier,
            )
        #: Length of what each client sends and the round releases: ``d``, or ``d + 1`` with the count.
        self.release_dim = dim + (1 if self.adaptive is not None else 0)
        if cfg.secure_aggregation and self.plan.dp:
            check_secure_aggregation(self)
        self.momentum: Vector = np.zeros(dim)
        #: ``w_{k~}`` (Alg. 1 line 13), kept by reservoir sampling, and ``k~``.
        self.random_iterate: Vector | None = None
        self.random_round: int | None = None
        self.history: dict[int, RoundStats] = {}
        self._w: Vector | None = None
        self._round: int | None = None

    # ------------------------------------------------------------------ info
    @property
    def noise_multiplier(self) -> float:
        """``z`` of this run (0 without DP)."""
        return self.plan.noise_multiplier

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far for ``delta`` (``inf`` without DP)."""
        return self.accountant.epsilon if self.accountant is not None else float("inf")

    @property
    def clip(self) -> float:
        """The next round's ``C``: ``C_k`` with ``adaptive-clip``, the ``clip`` key otherwise."""
        return self.adaptive.clip if self.adaptive is not None else self.cfg.clip

    @property
    def sensitivity(self) -> float:
        """The norm bound of one client's vector in the next round (the ``C`` of the noise placement).

        ``C``, or ``C_aug = sqrt(C_k^2 + s^2/4)`` with ``adaptive-clip`` (the count coordinate included).
        """
        return self.adaptive.augmented_clip if self.adaptive is not None else self.cfg.clip

    def noise_stds(self, num_sampled: int) -> tuple[float, float]:
        """``(per-client std, server std on the sum)`` of a round with ``num_sampled`` clients, all included."""
        return self.noise_stds_for(num_sampled, num_sampled)

    def noise_stds_for(self, num_sampled: int, num_included: int) -> tuple[float, float]:
        """``(per-client std, server top-up std)`` when ``num_included`` of ``num_sampled`` updates entered the sum.

        The top-up fills the noise of the missing ones, so the sum always carries ``N(0, (zC)^2 I)``
        (:mod:`dpfedavg.core.mechanism`).
        """
        if not self.plan.dp:
            return 0.0, 0.0
        z, c, r = self.noise_multiplier, self.sensitivity, self.cfg.clients_per_round
        return (
            self.placement.client_std(z, c, r, num_sampled),
            self.placement.server_std(z, c, r, num_sampled, num_included),
        )

    def _rng(self, stream: Stream, round_index: int) -> np.random.Generator:
        """The generator of ``stream`` in round ``k``: seeded, or from the OS CSPRNG with ``secure-noise``."""
        return secure_rng() if self.cfg.secure_noise else make_rng(self.cfg.seed, stream, round_index)

    def secagg_grid(self, num_sampled: int) -> SecAggGrid | None:
        """The secure-aggregation grid of a round with ``num_sampled`` clients (``None`` when off).

        Its range covers ``C + k s`` for the round's per-client noise std ``s``
        (which depends on ``|S_k|`` with ``client-calibrated`` placement).
        """
        if not self.cfg.secure_aggregation:
            return None
        return SecAggGrid.for_round(
            self.sensitivity,
            self.noise_stds(num_sampled)[0],
            self.cfg.secagg_clip_stds,
            self.cfg.secagg_quantization_bits,
            self.cfg.secagg_modulus_bits,
        )

    def sample_clients(self, server_round: int) -> np.ndarray:
        """Client ids sampled in ``server_round`` (1-based): Poisson with ``q = r/n`` (Alg. 1 line 3).

        The amplification by sampling holds only if nobody can predict ``S_k``: with ``secure-noise``
        the draw comes from the OS CSPRNG; in seeded mode anyone who knows ``seed`` can replay it.
        """
        rng = self._rng(Stream.SAMPLING, server_round - 1)
        return poisson_sample(self.cfg.num_clients, self.cfg.sampling_rate, rng)

    def instructions(self, server_round: int, num_sampled: int) -> RoundInstructions:
        """The train config of ``server_round``: ``eta_k``, ``E``, ``C``, noise std and seed."""
        k = server_round - 1
        grid = self.secagg_grid(num_sampled)
        return RoundInstructions(
            server_round=server_round,
            local_lr=local_lr_at(k, self.cfg.local_lr, self.cfg.lr_decay),
            local_steps=self.cfg.local_steps,
            algorithm=self.cfg.algorithm,
            clip=self.clip,
            noise_std=self.noise_stds(num_sampled)[0],
            noise_seed=SECURE_NOISE_SEED if self.cfg.secure_noise else round_noise_seed(self.cfg.seed, k),
            diagnostics=self.cfg.diagnostics,
            secagg_step=grid.step if grid is not None else 0.0,
            secagg_range=grid.clipping_range if grid is not None else 0.0,
            count_scale=self.adaptive.scale if self.adaptive is not None else 0.0,
        )

    def round_event(self, num_sampled: int, num_included: int) -> RoundEvent:
        """The privacy event of a round with these counts (realized noise, see ``accounting``)."""
        z_k = realized_noise_multiplier(
            self.cfg.noise_placement, self.noise_multiplier, self.cfg.clients_per_round, num_sampled, num_included
        )
        return RoundEvent(self.cfg.sampling_rate, z_k)

    # ------------------------------------------------------------ checkpoint
    def state(self) -> dict[str, Any]:
        """What a checkpoint needs from the server after a round (see :mod:`dpfedavg.checkpoint`)."""
        if self._round is not None:
            raise RuntimeError(f"cannot checkpoint in the middle of round {self._round}")
        history = self.accountant.history if self.accountant is not None else []
        return {
            "momentum": self.momentum.copy(),
            "random_iterate": None if self.random_iterate is None else self.random_iterate.copy(),
            "random_round": self.random_round,
            "accountant_history": [(e.q, e.z) for e in history],
            "history": {k: asdict(v) for k, v in self.history.items()},
            "adaptive_clip": self.adaptive.clip if self.adaptive is not None else None,
        }

    def restore(
        self,
        *,
        momentum: Vector,
        random_iterate: Vector | None,
        random_round: int | None,
        accountant_history: list[tuple[float, float | None]],
        history: dict[int, dict[str, Any]],
        adaptive_clip: float | None = None,
    ) -> None:
        """Load the state :meth:`state` returned; the accountant replays every round's event.

        ``adaptive_clip`` is ``C_{k+1}`` of an ``adaptive-clip`` run (required for one, refused otherwise).
        """
        momentum = np.asarray(momentum, dtype=np.float64)
        if momentum.shape != (self.dim,):
            raise ValueError(f"momentum has shape {momentum.shape}, expected ({self.dim},)")
        self.momentum = momentum.copy()
        self.random_iterate = None if random_iterate is None else np.asarray(random_iterate, dtype=np.float64).copy()
        self.random_round = random_round
        if self.accountant is not None:
            self.accountant = self.plan.new_accountant()
            for q, z in accountant_history:
                self.accountant.add(RoundEvent(q, z))
        elif accountant_history:
            raise ValueError("the checkpoint has privacy events but this run has no DP")
        self.history = {int(k): RoundStats(**v) for k, v in history.items()}
        if (adaptive_clip is None) != (self.adaptive is None):
            raise ValueError(
                f"the checkpoint's adaptive clipping state ({adaptive_clip!r}) does not fit "
                f"algorithm {self.cfg.algorithm!r}"
            )
        if self.adaptive is not None:
            self.adaptive.clip = float(adaptive_clip)

    # ----------------------------------------------------------------- round
    def begin_round(self, server_round: int, w: Vector) -> tuple[np.ndarray, RoundInstructions]:
        """Sample the clients of ``server_round`` and open the round at ``w_k``.

        Raises
        ------
        PrivacyBudgetExhausted
            If the round, with every sampled client replying, would exceed ``max-epsilon``.
        """
        k = server_round - 1
        w = np.asarray(w, dtype=np.float64)
        if w.shape != (self.dim,):
            raise ValueError(f"global model has shape {w.shape}, expected ({self.dim},)")
        clients = self.sample_clients(server_round)
        budget = self.plan.max_epsilon
        if budget is not None and self.accountant is not None:
            projected = self.accountant.epsilon_after(self.round_event(len(clients), len(clients)))
            if projected > budget:
                raise PrivacyBudgetExhausted(server_round, self.accountant.epsilon, projected, budget)
        if keep_random_iterate(k, self._rng(Stream.ITERATE, k)):
            self.random_iterate, self.random_round = w.copy(), k
        stats = RoundStats(round=server_round, num_sampled=len(clients))
        stats.eta = local_lr_at(k, self.cfg.local_lr, self.cfg.lr_decay)
        stats.beta = server_lr_at(k, self.cfg.local_lr, self.cfg.lr_decay, self.cfg.server_lr)
        self.history[server_round] = stats
        self._w, self._round = w, server_round
        if not len(clients):
            logger.warning("Round %d: Poisson sampling selected no client", server_round)
        return clients, self.instructions(server_round, len(clients))

    def finish_round(
        self,
        server_round: int,
        results: Iterable[ClientResult],
        *,
        num_failed: int = 0,
        num_rejected: int = 0,
    ) -> Vector:
        """Aggregate the round's client results (in ascending client id) and return ``w_{k+1}``.

        ``a_k = (1/r) (sum_i (g_i + zeta_i) [+ server noise])``,
        ``m_{k+1} = mu m_k + a_k``, ``w_{k+1} = w_k - beta_k m_{k+1}``.
        Sampled clients that are not among ``results`` and not counted as failed
        or rejected are dropouts.
        """
        self._check_open(server_round)
        total = np.zeros(self.release_dim)
        clean_total = np.zeros(self.release_dim) if self.cfg.diagnostics else None
        norms: list[float] = []
        last_id = -1
        for result in results:
            if result.client_id <= last_id:
                raise ValueError("client results must come in ascending client id (a fixed summation order)")
            last_id = result.client_id
            total += result.noisy
            norms.append(result.update_norm)
            if clean_total is not None and result.clean is not None:
                clean_total += result.clean
        return self._close_round(server_round, total, len(norms), norms, clean_total, num_failed, num_rejected)

    def finish_round_sum(self, server_round: int, total: Vector, num_received: int, *, num_failed: int = 0) -> Vector:
        """:meth:`finish_round` from the *sum* of ``num_received`` replies (secure aggregation).

        The server never sees an individual ``g_i + zeta_i``, so there are no
        per-client norms (``mean_update_norm`` and ``frac_clipped`` stay NaN).
        """
        self._check_open(server_round)
        total = np.asarray(total, dtype=np.float64)
        if total.shape != (self.release_dim,):
            raise ValueError(f"the secure sum has shape {total.shape}, expected ({self.release_dim},)")
        return self._close_round(server_round, total.copy(), num_received, [], None, num_failed, 0)

    def finish_round_block(
        self,
        server_round: int,
        total: Vector,
        norms: np.ndarray,
        clean_total: Vector | None = None,
        *,
        num_failed: int = 0,
    ) -> Vector:
        """:meth:`finish_round` from the replies' sum, already formed in ascending client id.

        ``total`` is ``sum_i (g_i + zeta_i)`` over the ``len(norms)`` clients that replied (their
        ``||u_i||`` in ``norms``) and ``clean_total`` the sum of their ``g_i`` (diagnostics). The batched
        engine over a run axis (:mod:`dpfedavg.engines.batched_runs`) forms them for many runs at once.
        """
        self._check_open(server_round)
        total = np.asarray(total, dtype=np.float64)
        if total.shape != (self.release_dim,):
            raise ValueError(f"the sum has shape {total.shape}, expected ({self.release_dim},)")
        clean = None if clean_total is None or not self.cfg.diagnostics else np.array(clean_total, dtype=np.float64)
        norms = np.asarray(norms, dtype=np.float64)
        return self._close_round(server_round, total.copy(), len(norms), norms, clean, num_failed, 0)

    def skip_round(self, server_round: int, reason: str) -> Vector:
        """Close a round in which no client's update could be summed (secure aggregation could not finish).

        Every sampled client counts as a dropout, so the round releases the server's top-up alone,
        ``N(0, (zC)^2 I)``, and is charged like every other round: whether a round is skipped depends on
        how many clients were sampled and survived, so releasing nothing (and charging nothing) would
        tell who took part. Recorded with ``skipped = 1``.
        """
        self._check_open(server_round)
        self.history[server_round].skipped = 1
        logger.warning("Round %d: no update could be summed (%s); the round releases noise only", server_round, reason)
        return self._close_round(server_round, np.zeros(self.release_dim), 0, [], None, 0, 0)

    def _check_open(self, server_round: int) -> None:
        if self._w is None or self._round != server_round:
            raise RuntimeError(f"finishing round {server_round} without begin_round({server_round})")

    def _close_round(
        self,
        server_round: int,
        total: Vector,
        num_received: int,
        norms: list[float] | np.ndarray,
        clean_total: Vector | None,
        num_failed: int,
        num_rejected: int,
    ) -> Vector:
        stats = self.history[server_round]
        r = self.cfg.clients_per_round
        stats.num_received = num_received
        stats.num_failed, stats.num_rejected = num_failed, num_rejected
        stats.num_dropped = max(0, stats.num_sampled - stats.num_received - num_failed - num_rejected)
        if stats.num_dropped:
            logger.warning("Round %d: %d sampled clients did not reply (dropouts)", server_round, stats.num_dropped)
        # the server's share: all of (zC)^2 for `server` placement, the missing replies' share otherwise
        server_std = self.noise_stds_for(stats.num_sampled, num_received)[1]
        if server_std > 0:
            total += gaussian_noise(self.release_dim, server_std, self._rng(Stream.SERVER_NOISE, server_round - 1))
        stats.clip = self.clip if get_bound(self.cfg.algorithm).private else float("nan")
        if self.adaptive is not None:  # the released count T_k rides as the last coordinate (core.adaptive_clip)
            total, released_count = self.adaptive.split(total)
            if clean_total is not None:
                clean_total = clean_total[:-1]
            stats.clip, stats.frac_unclipped = self.adaptive.step(released_count, r)
        a = fixed_denominator_mean(total, r)
        w_new, self.momentum = momentum_step(self._w, self.momentum, a, stats.beta, self.cfg.server_momentum)
        if len(norms) and not self.cfg.secure_noise:  # un-noised statistics of client data: seeded research mode only
            norms_arr = np.asarray(norms)
            stats.mean_update_norm = float(norms_arr.mean())
            if self.adaptive is None:  # adaptive-clip releases the private b_k instead
                stats.frac_clipped = float(np.mean(norms_arr > self.cfg.clip))
        if clean_total is not None:
            clean_mean = clean_total / r
            noise_norm = float(np.linalg.norm(a - clean_mean))
            stats.snr = float(np.linalg.norm(clean_mean)) / noise_norm if noise_norm > 0 else float("inf")
        if self.accountant is not None:
            event = self.round_event(stats.num_sampled, stats.num_received)
            stats.noise_multiplier = event.z if event.z is not None else float("nan")
            self.accountant.add(event)
            if self.epsilon_each_round or server_round == self.cfg.num_rounds:  # the last round's, always
                stats.epsilon = self.accountant.epsilon
        else:
            stats.noise_multiplier, stats.epsilon = 0.0, float("inf")
        self._w, self._round = None, None
        return w_new
