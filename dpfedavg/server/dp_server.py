"""The server side of Alg. 1 / Alg. 2, independent of Flower.

`DPServer` holds the server state (``w_k``, the momentum buffer, the accountant, the random
iterate, per-round statistics) and runs one round in two halves:

* `DPServer.begin_round()`: the rules every round obeys, in one place (the stop before a round
  that would exceed ``max-epsilon``; with ``secure-noise``, the round's line of the write-ahead record
  of releases, on disk before anything of the round leaves the server, ``dpfedavg.server.releases``;
  the secure-aggregation round with fewer than three sampled clients, whose sum would show a client's
  update to the other, closed at once without contacting anyone), Poisson sampling (line 3), ``w_{k~}`` by
  reservoir sampling (line 13), and what the sampled clients must do (``RoundInstructions``);
* `DPServer.finish_round()`: sum the clients' ``g + zeta`` (in client-id order), add the server's
  share of the noise (all of it for ``server`` placement, the missing replies' share otherwise: the sum
  always carries ``N(0, (zC)^2 I)``, see `dpfedavg.core.mechanism`), divide by the fixed ``r``
  (line 12), apply momentum and ``beta_k``, and charge the accountant the round's (nominal) event.

With ``adaptive-clip`` the server also holds ``C_k`` (`AdaptiveClip`):
the clients' vectors have one more coordinate (their noised count of unclipped updates), the noise
placement sees the augmented bound ``C_aug`` instead of ``C``, and closing a round splits the count off,
releases ``b_k`` and moves to ``C_{k+1}`` (Andrew et al. 2021).

The privacy side reads narrow parameters the server builds once (`DpParams`,
`SecAggSettings`). The Flower strategy
(`DPFedAvg`) and the batched engine (`dpfedavg.engines.batched`)
both drive this class, so the two engines run the same server math.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

from dpfedavg.config import RunConfig
from dpfedavg.core import (
    SECURE_NOISE_SEED,
    SecAggGrid,
    Stream,
    fixed_denominator_mean,
    keep_random_iterate,
    local_lr_at,
    make_rng,
    momentum_step,
    round_noise_seed,
    secure_rng,
    server_lr_at,
    server_noise_std,
)
from dpfedavg.core.adaptive_clip import AdaptiveClip
from dpfedavg.core.dp import BOUNDS
from dpfedavg.core.mechanism import PLACEMENTS
from dpfedavg.core.noise import noise_law
from dpfedavg.core.types import ClientResult, RoundInstructions, Vector
from dpfedavg.io.checkpoint import ServerState
from dpfedavg.io.metrics import RoundStats
from dpfedavg.privacy.accountants import RoundEvent
from dpfedavg.privacy.guarantee import describe_adaptive_clipping, describe_privacy
from dpfedavg.privacy.noise_mechanisms import NOISE_MECHANISMS
from dpfedavg.privacy.params import DpParams
from dpfedavg.privacy.plan import PrivacyPlan, plan_privacy
from dpfedavg.privacy.secure_aggregation import (
    MIN_SECAGG_COHORT,
    SecAggRelease,
    SecAggSettings,
    check_privacy_terms,
    describe,
)
from dpfedavg.server.releases import ReleaseLog

__all__ = ["ClientResult", "DPServer", "PrivacyBudgetExhausted", "RoundInstructions", "RoundStart", "RoundStats"]

logger = logging.getLogger(__name__)


class PrivacyBudgetExhausted(Exception):
    """Raised before a round whose release would exceed ``max-epsilon``; the run stops cleanly."""

    def __init__(self, server_round: int, epsilon_now: float, epsilon_next: float, budget: float) -> None:
        super().__init__(
            f"privacy budget max-epsilon={budget:g} reached: stopping before round {server_round} "
            f"(epsilon spent {epsilon_now:.4g}; that round would bring it to {epsilon_next:.4g})"
        )
        self.server_round = server_round


class RoundStart(NamedTuple):
    """What `DPServer.begin_round()` opened: the sampled clients and their instructions.

    ``instructions`` is ``None`` when a rule closed the round at once (secure aggregation with fewer than
    two sampled clients); ``w`` is then ``w_{k+1}``, and nobody is contacted.
    """

    clients: np.ndarray
    instructions: RoundInstructions | None
    w: Vector | None = None

    @property
    def closed(self) -> bool:
        return self.instructions is None


class DPServer:
    """Server state and per-round math of DP-FedAvg / DP-NormFedAvg / FedAvg.

    Parameters
    ----------
    cfg:
        The validated run configuration.
    dim:
        Length of the flat model vector.
    plan:
        The privacy plan (calibrated ``z``, accountant, budget); computed from ``cfg`` when omitted.
    epsilon_each_round:
        Compute the epsilon spent after every round (the ``epsilon`` column; every engine does). Off, only
        the last round's is computed (and `epsilon` on demand); the composition itself is never
        skipped.

    Raises
    ------
    dpfedavg.errors.ConfigError
        From the privacy plan, or secure-aggregation settings under which the guarantee would not hold.
    """

    def __init__(
        self, cfg: RunConfig, dim: int, *, plan: PrivacyPlan | None = None, epsilon_each_round: bool = True
    ) -> None:
        self.cfg = cfg
        self.dim = dim
        #: What the accountant reads (built once).
        self.params = DpParams.from_config(cfg)
        #: The sensitivity bound (``algorithm``): what ``g`` is, and whether the run is private.
        self.bound = BOUNDS[cfg.algorithm]
        self.plan = plan if plan is not None else plan_privacy(self.params, self.bound, cfg.clip_count_stddev)
        self.accountant = self.plan.new_accountant() if self.plan.dp else None
        self.epsilon_each_round = epsilon_each_round
        #: The noise placement: what the clients and the server add, and what is accounted.
        self.placement = PLACEMENTS[cfg.noise_placement]
        #: The noise law: what each client's zeta is, and what it adds to the guarantee (`dpfedavg.core.noise`).
        self.noise_law = noise_law(cfg.secure_aggregation)
        #: ``adaptive-clip``: ``C_k`` and its update rule (Andrew et al. 2021); ``None`` for a fixed ``C``.
        self.adaptive: AdaptiveClip | None = None
        if self.bound.adaptive:
            self.adaptive = AdaptiveClip(
                clip=cfg.clip,
                target_quantile=cfg.target_quantile,
                clip_lr=cfg.clip_lr,
                count_stddev=self.plan.count_stddev,
                noise_multiplier=self.plan.noise_multiplier,
                clip_floor=cfg.clip_limits[0],
                clip_ceiling=cfg.clip_limits[1],
            )
        #: Length of what each client sends and the round releases: ``d``, or ``d + 1`` with the count.
        self.release_dim = dim + (1 if self.adaptive is not None else 0)
        #: The noise mechanism (``noise-mechanism``): who takes part each round, what the server adds to the
        #: sum, the fixed denominator (`dpfedavg.privacy.noise_mechanisms`).
        self.mechanism = NOISE_MECHANISMS[cfg.noise_mechanism]
        self.round_mechanism = self.mechanism.rounds(
            self.plan.params or self.params, self.plan.noise_multiplier, clip=cfg.clip, dim=self.release_dim
        )
        #: The ``secagg-*`` settings (``None`` without secure aggregation).
        self.secagg = SecAggSettings.from_config(cfg) if cfg.secure_aggregation else None
        if self.secagg is not None and self.plan.dp:
            check_privacy_terms(self.secagg, self.secagg_release())
        self.momentum: Vector = np.zeros(dim)
        #: ``w_{k~}`` (Alg. 1 line 13), kept by reservoir sampling, and ``k~``.
        self.random_iterate: Vector | None = None
        self.random_round: int | None = None
        self.history: dict[int, RoundStats] = {}
        #: The write-ahead record of releases (``secure-noise``: ``dpfedavg.server.releases``); the run's session
        #: sets it. ``begin_round`` writes each round's line before anything of the round leaves the server.
        self.release_log: ReleaseLog | None = None
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

    @property
    def sigma(self) -> float:
        """``sigma = z C / r``: the std of the noise in each coordinate of the next round's average ``a_k``.

        ``r`` is the mechanism's fixed denominator; with banded-MF noise this is the std of ``Z``'s rows over it
        (round 0's; ``(C^{-1} Z)_k``'s std changes with ``k``).
        """
        return server_noise_std(self.noise_multiplier, self.sensitivity, self.round_mechanism.denominator)

    def noise_stds(self, num_sampled: int) -> tuple[float, float]:
        """``(per-client std, server std on the sum)`` of a round with ``num_sampled`` clients, all included."""
        return self.noise_stds_for(num_sampled, num_sampled)

    def noise_stds_for(self, num_sampled: int, num_included: int) -> tuple[float, float]:
        """``(per-client std, server top-up std)`` when ``num_included`` of ``num_sampled`` updates entered the sum.

        The top-up fills the noise of the missing ones, so the sum always carries ``N(0, (zC)^2 I)``
        (`dpfedavg.core.mechanism`).
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

    # ---------------------------------------------------- secure aggregation
    def secagg_release(self) -> SecAggRelease:
        """What the secure-aggregation encoding's privacy terms read from this run (its first round's bound)."""
        plan = self.plan
        return SecAggRelease(
            law=self.noise_law,
            placement=self.placement,
            noise_multiplier=plan.noise_multiplier,
            bound=self.sensitivity,
            adaptive=self.adaptive is not None,
            clients_per_round=self.cfg.clients_per_round,
            num_clients=self.cfg.num_clients,
            dim=self.release_dim,  # adaptive-clip's count coordinate is encoded too
            rounds=self.cfg.num_rounds,
            epsilon=plan.target_epsilon if plan.calibrated and plan.target_epsilon else plan.nominal_epsilon,
            delta=plan.delta,
        )

    def secagg_grid(self, num_sampled: int) -> SecAggGrid | None:
        """The secure-aggregation grid of a round with ``num_sampled`` clients (``None`` when off).

        Its range covers ``C + k s`` for the round's per-client noise std ``s``
        (which depends on ``|S_k|`` with ``client-calibrated`` placement).
        """
        if self.secagg is None:
            return None
        return self.secagg.grid(self.sensitivity, self.noise_stds(num_sampled)[0])

    def describe_privacy(self) -> dict[str, Any]:
        """The privacy set-up for ``config.json`` (`dpfedavg.privacy.guarantee.describe_privacy()`)."""
        cfg, plan = self.cfg, self.plan
        adaptive = None
        if self.adaptive is not None:
            adaptive = describe_adaptive_clipping(
                plan,
                initial_clip=cfg.clip,
                target_quantile=cfg.target_quantile,
                clip_lr=cfg.clip_lr,
                count_stddev=plan.count_stddev,
            )
        record, key = self.round_mechanism.record(), self.round_mechanism.record_key
        return describe_privacy(
            plan,
            self.placement,
            noise_mechanism=self.mechanism.name,
            mechanism_record={key: record} if key and record else None,
            diagnostics=cfg.diagnostics,
            secure_noise=cfg.secure_noise,
            seed=cfg.seed,
            sigma=self.sigma,
            sensitivity=cfg.clip,
            adaptive_clipping=adaptive,
            secure_aggregation=(
                describe(self.secagg, self.secagg_release(), plan.dp) if self.secagg is not None else None
            ),
        )

    # ----------------------------------------------------------- round setup
    def sample_clients(self, server_round: int, available: Iterable[int] | None = None) -> np.ndarray:
        """Client ids taking part in ``server_round`` (1-based), by the noise mechanism; call once per round.

        ``independent``: Poisson with ``q = r/n`` (Alg. 1 line 3) over all ``n`` clients. The amplification by
        sampling holds only if nobody can predict ``S_k``: with ``secure-noise`` the draw comes from the OS
        CSPRNG; in seeded mode anyone who knows ``seed`` can replay it. ``banded-mf``: the participation rule's
        cohort among the ``available`` (connected) clients, ``None`` meaning all; nobody outside the rule.
        Not yet recorded: `begin_round()` admits the cohort once the round is sure to run.
        """
        rng = self._rng(Stream.SAMPLING, server_round - 1)
        return self.round_mechanism.select(server_round - 1, rng, available)

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
            noise_multiplier=self.noise_multiplier if self.plan.dp else 0.0,
            cohort_size=num_sampled,
        )

    def round_event(self, num_sampled: int, num_included: int) -> RoundEvent:
        """The privacy event of a round with these counts: the placement's accounted ``z_k`` (always ``z``)."""
        z_k = self.placement.accounted_noise_multiplier(
            self.noise_multiplier, self.cfg.clients_per_round, num_sampled, num_included
        )
        return RoundEvent(self.cfg.sampling_rate, z_k)

    # ------------------------------------------------------------ checkpoint
    def state(self) -> ServerState:
        """What a checkpoint needs from the server after a round (see `dpfedavg.io.checkpoint`)."""
        if self._round is not None:
            raise RuntimeError(f"cannot checkpoint in the middle of round {self._round}")
        return ServerState(
            momentum=self.momentum.copy(),
            random_iterate=None if self.random_iterate is None else self.random_iterate.copy(),
            random_round=self.random_round,
            accountant=self.accountant.state_dict() if self.accountant is not None else None,
            history={k: v.state_dict() for k, v in self.history.items()},
            adaptive_clip=self.adaptive.clip if self.adaptive is not None else None,
            mechanism=self.round_mechanism.state_dict() or None,
        )

    def restore(self, state: ServerState) -> None:
        """Load what `state()` returned; the accountant replays every round's event."""
        momentum = np.asarray(state.momentum, dtype=np.float64)
        if momentum.shape != (self.dim,):
            raise ValueError(f"momentum has shape {momentum.shape}, expected ({self.dim},)")
        self.momentum = momentum.copy()
        iterate = state.random_iterate
        self.random_iterate = None if iterate is None else np.asarray(iterate, dtype=np.float64).copy()
        self.random_round = state.random_round
        if self.accountant is not None:
            if state.accountant is None:
                raise ValueError("the checkpoint has no accountant state but this run is private")
            self.accountant.load_state_dict(state.accountant)
        elif state.accountant is not None and state.accountant.get("history"):
            raise ValueError("the checkpoint has privacy events but this run has no DP")
        self.history = {int(k): RoundStats(**v) for k, v in state.history.items()}
        if (state.adaptive_clip is None) != (self.adaptive is None):
            raise ValueError(
                f"the checkpoint's adaptive clipping state ({state.adaptive_clip!r}) does not fit "
                f"algorithm {self.cfg.algorithm!r}"
            )
        if self.adaptive is not None:
            self.adaptive.clip = float(state.adaptive_clip)  # type: ignore[arg-type]
        sizes = [self.history[k].num_sampled for k in sorted(self.history)]
        self.round_mechanism.load_state_dict(state.mechanism or {}, cohort_sizes=sizes)

    # ----------------------------------------------------------------- round
    def begin_round(self, server_round: int, w: Vector, available: Iterable[int] | None = None) -> RoundStart:
        """Open ``server_round`` at ``w_k``: every rule of a round, sampling and ``k~``.

        ``available``: the connected clients, for a mechanism whose cohort depends on them
        (``selects_from_available``); ``None`` means all.

        Raises
        ------
        PrivacyBudgetExhausted
            If the round, with every sampled client replying, would exceed ``max-epsilon``.
        """
        k = server_round - 1
        w = np.asarray(w, dtype=np.float64)
        if w.shape != (self.dim,):
            raise ValueError(f"global model has shape {w.shape}, expected ({self.dim},)")
        clients = self.sample_clients(server_round, available)
        budget = self.plan.max_epsilon
        if budget is not None and self.accountant is not None:
            projected = self.accountant.epsilon_after(self.round_event(len(clients), len(clients)))
            if projected > budget:
                raise PrivacyBudgetExhausted(server_round, self.accountant.epsilon, projected, budget)
        if self.release_log is not None:  # on disk before the round is sent: a crash cannot hide this release
            self.release_log.write(server_round)
        self.round_mechanism.admit(k, clients)  # recorded only for a round that runs
        if keep_random_iterate(k, self._rng(Stream.ITERATE, k)):
            self.random_iterate, self.random_round = w.copy(), k
        stats = RoundStats(round=server_round, num_sampled=len(clients))
        stats.eta = local_lr_at(k, self.cfg.local_lr, self.cfg.lr_decay)
        stats.beta = server_lr_at(k, self.cfg.local_lr, self.cfg.lr_decay, self.cfg.server_lr)
        self.history[server_round] = stats
        self._w, self._round = w, server_round
        if not len(clients):
            logger.warning("Round %d: %s selected no client", server_round, self.mechanism.name)
        if self.secagg is not None and len(clients) < MIN_SECAGG_COHORT:  # the nodes refuse it (guard.py)
            reason = f"secure aggregation needs at least {MIN_SECAGG_COHORT} clients, {len(clients)} sampled"
            return RoundStart(clients, None, self.skip_round(server_round, reason))
        return RoundStart(clients, self.instructions(server_round, len(clients)))

    def is_open(self, server_round: int) -> bool:
        """Whether ``server_round`` was begun and not yet finished."""
        return self._w is not None and self._round == server_round

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

    def finish_round_sum(
        self, server_round: int, total: Vector, num_received: int, *, num_failed: int = 0, num_rejected: int = 0
    ) -> Vector:
        """`finish_round()` from the *sum* of ``num_received`` replies (secure aggregation).

        The server never sees an individual ``g_i + zeta_i``, so there are no
        per-client norms (``mean_update_norm`` and ``frac_clipped`` stay NaN).
        """
        self._check_open(server_round)
        total = np.asarray(total, dtype=np.float64)
        if total.shape != (self.release_dim,):
            raise ValueError(f"the secure sum has shape {total.shape}, expected ({self.release_dim},)")
        return self._close_round(server_round, total.copy(), num_received, [], None, num_failed, num_rejected)

    def finish_round_block(
        self,
        server_round: int,
        total: Vector,
        norms: np.ndarray,
        clean_total: Vector | None = None,
        *,
        num_failed: int = 0,
    ) -> Vector:
        """`finish_round()` from the replies' sum, already formed in ascending client id.

        ``total`` is ``sum_i (g_i + zeta_i)`` over the ``len(norms)`` clients that replied (their
        ``||u_i||`` in ``norms``) and ``clean_total`` the sum of their ``g_i`` (diagnostics). The batched
        engine over a run axis (`dpfedavg.engines.batched_runs`) forms them for many runs at once.
        """
        self._check_open(server_round)
        total = np.asarray(total, dtype=np.float64)
        if total.shape != (self.release_dim,):
            raise ValueError(f"the sum has shape {total.shape}, expected ({self.release_dim},)")
        clean = None if clean_total is None or not self.cfg.diagnostics else np.array(clean_total, dtype=np.float64)
        norms = np.asarray(norms, dtype=np.float64)
        return self._close_round(server_round, total.copy(), len(norms), norms, clean, num_failed, 0)

    def skip_round(self, server_round: int, reason: str, *, num_rejected: int = 0) -> Vector:
        """Close a round in which no client's update could be summed (secure aggregation could not finish).

        Every sampled client counts as a dropout, so the round releases the server's top-up alone,
        ``N(0, (zC)^2 I)``, and is charged like every other round: whether a round is skipped depends on
        how many clients were sampled and survived, so releasing nothing (and charging nothing) would
        tell who took part. Recorded with ``skipped = 1``.
        """
        self._check_open(server_round)
        self.history[server_round].skipped = 1
        logger.warning("Round %d: no update could be summed (%s); the round releases noise only", server_round, reason)
        return self._close_round(server_round, np.zeros(self.release_dim), 0, [], None, 0, num_rejected)

    def _check_open(self, server_round: int) -> None:
        if not self.is_open(server_round):
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
        denominator = self.round_mechanism.denominator
        stats.num_received = num_received
        stats.num_failed, stats.num_rejected = num_failed, num_rejected
        stats.num_dropped = max(0, stats.num_sampled - stats.num_received - num_failed - num_rejected)
        if stats.num_dropped:
            logger.warning("Round %d: %d sampled clients did not reply (dropouts)", server_round, stats.num_dropped)
        # the server's share: all of (zC)^2 for `server` placement, the missing replies' share otherwise; with
        # banded-MF noise the round's (C^-1 Z)_k instead, every round
        server_std = self.noise_stds_for(stats.num_sampled, num_received)[1]
        rng = self._rng(Stream.SERVER_NOISE, server_round - 1)
        noise = self.round_mechanism.server_noise(server_round - 1, rng, server_std)
        if noise is not None:
            total += noise
        stats.clip = self.clip if self.bound.private else float("nan")
        if self.adaptive is not None:  # the released count T_k rides as the last coordinate (core.adaptive_clip)
            total, released_count = self.adaptive.split(total)
            if clean_total is not None:
                clean_total = clean_total[:-1]
            stats.clip, stats.frac_unclipped = self.adaptive.step(released_count, r)
        a = fixed_denominator_mean(total, denominator)
        w_new, self.momentum = momentum_step(self._w, self.momentum, a, stats.beta, self.cfg.server_momentum)
        if len(norms) and not self.cfg.secure_noise:  # un-noised statistics of client data: seeded research mode only
            norms_arr = np.asarray(norms)
            stats.mean_update_norm = float(norms_arr.mean())
            if self.adaptive is None:  # adaptive-clip releases the private b_k instead
                stats.frac_clipped = float(np.mean(norms_arr > self.cfg.clip))
        if clean_total is not None:
            clean_mean = clean_total / denominator
            noise_norm = float(np.linalg.norm(a - clean_mean))
            stats.snr = float(np.linalg.norm(clean_mean)) / noise_norm if noise_norm > 0 else float("inf")
        if self.accountant is not None:
            event = self.round_event(stats.num_sampled, stats.num_received)
            stats.noise_multiplier = event.z if event.z is not None else float("nan")
            self.accountant.step(event)
            if self.epsilon_each_round or server_round == self.cfg.num_rounds:  # the last round's, always
                stats.epsilon = self.accountant.epsilon
        else:
            stats.noise_multiplier, stats.epsilon = 0.0, float("inf")
        self._w, self._round = None, None
        return w_new
