"""The server side of Alg. 1 / Alg. 2, independent of Flower.

`DPServer` holds the server state (``w_k``, the momentum buffer, the accountant, the random
iterate, per-round statistics) and runs one round in two halves:

* `DPServer.begin_round()`: the rules every round obeys, in one place (the stop before a round
  that would exceed ``max-epsilon``; with ``secure-noise``, the round's line of the write-ahead record
  of releases, on disk before anything of the round leaves the server, ``dpfedavg.server.releases``;
  the secure-aggregation round with fewer than three sampled clients, whose sum would show a client's
  update to the other, closed at once without contacting anyone), Poisson sampling (line 3), ``w_{k~}`` by
  reservoir sampling (line 13), and what the sampled clients must do (``RoundInstructions``);
* `DPServer.close_round()`: from the round's `RoundReplies`, sum the clients' ``g + zeta`` (in client-id
  order; or take the sum a runner formed), add the server's share of the noise (all of it for ``server``
  placement, the missing replies' share otherwise: the sum always carries ``N(0, (zC)^2 I)``, see
  `dpfedavg.core.mechanism`), divide by the fixed ``r`` (line 12), apply momentum and ``beta_k``, charge the
  accountant the round's (nominal) event, and return one frozen `RoundRecord` (``w_{k+1}``, the round's
  statistics). It is the one way to close a round.

With ``adaptive-clip`` the server also holds ``C_k`` (`AdaptiveClip`):
the clients' vectors have one more coordinate (their noised count of unclipped updates), the noise
placement sees the augmented bound ``C_aug`` instead of ``C``, and closing a round splits the count off,
releases ``b_k`` and moves to ``C_{k+1}`` (Andrew et al. 2021).

The server reads the run's privacy set-up, resolved once per run (`PrivacySetup`: the bound, the
placement, the noise law and mechanism, `DpParams`, the plan, `SecAggSettings`, the federation sampled).
The Flower strategy (`DPFedAvg`) and the batched engine (`dpfedavg.engines.batched`)
both drive this class, so the two engines run the same server math.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from dpfedavg.config import RunConfig
from dpfedavg.core import (
    SECURE_NOISE_SEED,
    RoundStreams,
    SecAggGrid,
    Stream,
    fixed_denominator_mean,
    keep_random_iterate,
    local_lr_at,
    momentum_step,
    round_noise_seed,
    secure_rng,
    server_lr_at,
    server_noise_std,
)
from dpfedavg.core.adaptive_clip import AdaptiveClip
from dpfedavg.core.types import ClientResult, RoundInstructions, Vector
from dpfedavg.io.checkpoint import ServerState
from dpfedavg.io.metrics import RoundStats
from dpfedavg.privacy.accountants import RoundEvent
from dpfedavg.privacy.guarantee import describe_adaptive_clipping, describe_privacy
from dpfedavg.privacy.secure_aggregation import MIN_SECAGG_COHORT, SecAggRelease, check_privacy_terms, describe
from dpfedavg.privacy.setup import PrivacySetup
from dpfedavg.server.releases import ReleaseLog
from dpfedavg.server.round import RoundRecord, RoundReplies

__all__ = [
    "ClientResult",
    "DPServer",
    "PrivacyBudgetExhausted",
    "RoundInstructions",
    "RoundRecord",
    "RoundReplies",
    "RoundStart",
    "RoundStats",
]

logger = logging.getLogger(__name__)


def _norm(x: Vector) -> float:
    """``||x||`` of a vector as ``np.linalg.norm`` computes it (``sqrt(x . x)``), without its checks."""
    return math.sqrt(float(np.dot(x, x)))


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
    two sampled clients); ``record`` is then the closed round, and nobody is contacted.
    """

    clients: np.ndarray
    instructions: RoundInstructions | None
    record: RoundRecord | None = None

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
    setup:
        The run's privacy set-up (`PrivacySetup`: the bound, the placement, the noise law and mechanism, the
        calibrated plan, the federation sampled); resolved from ``cfg`` when omitted (a server built alone, in a
        test or a benchmark: a run resolves its set-up once and passes it here).
    epsilon_each_round:
        Compute the epsilon spent after every round (the ``epsilon`` column; every engine does). Off, only
        the last round's is computed (and `epsilon` on demand); the composition itself is never
        skipped.
    release_log:
        The write-ahead record of releases (``secure-noise``: `dpfedavg.server.releases`); ``begin_round``
        writes each round's line before anything of the round leaves the server. ``None``: no record.
    represent:
        The values the model can hold (a user's arrays' dtypes: `dpfedavg.flower.arrays.ArrayLayout.round_trip`);
        ``w_{k+1}`` is mapped through it. ``None``: float64, as computed.

    Raises
    ------
    dpfedavg.errors.ConfigError
        From the privacy plan, or secure-aggregation settings under which the guarantee would not hold.
    """

    def __init__(
        self,
        cfg: RunConfig,
        dim: int,
        *,
        setup: PrivacySetup | None = None,
        epsilon_each_round: bool = True,
        release_log: ReleaseLog | None = None,
        represent: Callable[[Vector], Vector] | None = None,
    ) -> None:
        self.cfg = cfg
        self.dim = dim
        #: The privacy set-up, resolved once per run (`dpfedavg.privacy.setup`); the attributes below are its parts.
        self.setup = setup = setup if setup is not None else PrivacySetup.resolve(cfg)
        #: What the accountant reads: the sampled federation's (``n'``, ``r'`` with canaries).
        self.params = setup.params
        #: The sensitivity bound (``algorithm``): what ``g`` is, and whether the run is private.
        self.bound = setup.bound
        self.plan = setup.plan
        self.accountant = setup.new_accountant()
        self.epsilon_each_round = epsilon_each_round
        #: The noise placement: what the clients and the server add, and what is accounted.
        self.placement = setup.placement
        #: The noise law: what each client's zeta is, and what it adds to the guarantee (`dpfedavg.core.noise`).
        self.noise_law = setup.noise_law
        #: ``adaptive-clip``: ``C_k`` and its update rule (Andrew et al. 2021), this server's copy of the set-up's
        #: ``C_0`` and rule; ``None`` for a fixed ``C``.
        self.adaptive: AdaptiveClip | None = dataclasses.replace(setup.adaptive) if setup.adaptive is not None else None
        #: Length of what each client sends and the round releases: ``d``, or ``d + 1`` with the count.
        self.release_dim = dim + (1 if self.adaptive is not None else 0)
        #: The noise mechanism (``noise-mechanism``): who takes part each round, what the server adds to the
        #: sum, the fixed denominator (`dpfedavg.privacy.noise_mechanisms`); its per-run state below.
        self.noise_mechanism = setup.noise_mechanism
        self.round_mechanism = self.noise_mechanism.rounds(
            self.params, self.plan.noise_multiplier, clip=cfg.clip, dim=self.release_dim
        )
        #: The ``secagg-*`` settings (``None`` without secure aggregation).
        self.secagg = setup.secagg
        if self.secagg is not None and self.plan.dp:
            check_privacy_terms(self.secagg, self.secagg_release())
        self.momentum: Vector = np.zeros(dim)
        self._streams = RoundStreams(cfg.seed)
        self._stds: dict[tuple[int, int], tuple[float, float]] = {}  # `noise_stds_for()` by counts (a fixed C)
        self._events: dict[tuple[int, int], RoundEvent] = {}  # `round_event()` by counts
        #: ``w_{k~}`` (Alg. 1 line 13), kept by reservoir sampling, and ``k~``.
        self.random_iterate: Vector | None = None
        self.random_round: int | None = None
        self._history: dict[int, RoundStats] = {}
        self.release_log = release_log
        self.represent = represent
        self._w: Vector | None = None
        self._round: int | None = None
        self._num_sampled = 0
        #: The open round's |S_k| in its instructions: the sampled clients, or the connected ones (`connected_cohort`).
        self._cohort = 0

    # ------------------------------------------------------------------ info
    @property
    def history(self) -> MappingProxyType[int, RoundStats]:
        """The closed rounds' statistics by 1-based round (read-only; each made once by `close_round()`)."""
        return MappingProxyType(self._history)

    @property
    def charges_redone_rounds(self) -> bool:
        """Whether the noise mechanism can account a round released twice (a ``secure-noise`` resume)."""
        return self.noise_mechanism.charges_redone_rounds

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
        return server_noise_std(self.plan.noise_multiplier, self.sensitivity, self.round_mechanism.denominator)

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
        stds = self._stds.get((num_sampled, num_included)) if self.adaptive is None else None
        if stds is None:
            z, c, r = self.plan.noise_multiplier, self.sensitivity, self.params.clients_per_round
            stds = (
                self.placement.client_std(z, c, r, num_sampled),
                self.placement.server_std(z, c, r, num_sampled, num_included),
            )
            if self.adaptive is None:  # a fixed C: the stds depend on the counts only (kept per run)
                self._stds[(num_sampled, num_included)] = stds
        return stds

    def _rng(self, stream: Stream, round_index: int) -> np.random.Generator:
        """The generator of ``stream`` in round ``k``: seeded, or from the OS CSPRNG with ``secure-noise``.

        Seeded, it is reused by the next call for the same stream (`RoundStreams`): callers draw from it at once.
        """
        return secure_rng() if self.cfg.secure_noise else self._streams.rng(stream, round_index)

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
            clients_per_round=self.params.clients_per_round,
            num_clients=self.params.num_clients,
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
        adaptive = None if self.adaptive is None else describe_adaptive_clipping(
            plan, initial_clip=cfg.clip, target_quantile=cfg.target_quantile, clip_lr=cfg.clip_lr,
            count_stddev=plan.count_stddev,
        )  # fmt: skip
        record, key = self.round_mechanism.record(), self.round_mechanism.record_key
        return describe_privacy(
            plan,
            self.placement,
            noise_mechanism=self.noise_mechanism.name,
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
        k, mechanism = server_round - 1, self.round_mechanism
        key = mechanism.selection_key
        if key is not None and not self.cfg.secure_noise:  # seeded: one draw for every run with this seed
            return self._streams.draw(Stream.SAMPLING, k, key, lambda rng: mechanism.select(k, rng, available))
        return mechanism.select(k, self._rng(Stream.SAMPLING, k), available)

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
            noise_multiplier=self.plan.noise_multiplier if self.plan.dp else 0.0,
            cohort_size=num_sampled,
        )

    def round_event(self, num_sampled: int, num_included: int) -> RoundEvent:
        """The privacy event of a round with these counts: the placement's accounted ``z_k`` (always ``z``)."""
        event = self._events.get((num_sampled, num_included))
        if event is None:  # the placement and the plan are the run's: the event depends on the counts only
            z_k = self.placement.accounted_noise_multiplier(
                self.plan.noise_multiplier, self.params.clients_per_round, num_sampled, num_included
            )
            event = self._events[(num_sampled, num_included)] = RoundEvent(self.params.q, z_k)
        return event

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
        self._history = {int(k): RoundStats(**v) for k, v in state.history.items()}
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
        if self._keeps_iterate(k):
            self.random_iterate, self.random_round = w.copy(), k
        self._w, self._round, self._num_sampled = w, server_round, len(clients)
        self._cohort = len(clients)
        if not len(clients):
            logger.warning("Round %d: %s selected no client", server_round, self.noise_mechanism.name)
        if self.secagg is not None and len(clients) < MIN_SECAGG_COHORT:  # the nodes refuse it (guard.py)
            reason = f"secure aggregation needs at least {MIN_SECAGG_COHORT} clients, {len(clients)} sampled"
            return RoundStart(clients, None, self.close_round(server_round, RoundReplies(halted=reason)))
        return RoundStart(clients, self.instructions(server_round, len(clients)))

    def _keeps_iterate(self, k: int) -> bool:
        """Line 13's reservoir coin in round ``k`` (`keep_random_iterate`); seeded, drawn once per seed and round."""
        if self.cfg.secure_noise:
            return keep_random_iterate(k, self._rng(Stream.ITERATE, k))
        return self._streams.draw(Stream.ITERATE, k, "keep", lambda rng: keep_random_iterate(k, rng))

    def connected_cohort(self, server_round: int, num_connected: int) -> RoundInstructions:
        """The open round's instructions for ``|S_k| = num_connected``: its sampled clients that can be reached.

        A sampled client whose node is offline cannot take part; under SecAgg+ each node checks that the
        protocol's cohort equals the instructions' ``|S_k|`` (`dpfedavg.flower.guard`), so the instructions
        name the connected count, the clients' noise shares are those of ``num_connected`` and the top-up fills
        the missing replies' share of that cohort: the sum still carries ``N(0, (zC)^2 I)``. The offline
        clients stay in the round's sampled count (dropouts).
        """
        if self._w is None or self._round != server_round or not 0 <= num_connected <= self._num_sampled:
            raise RuntimeError(f"round {server_round}: {num_connected} connected of {self._num_sampled} sampled")
        self._cohort = num_connected
        return self.instructions(server_round, num_connected)

    def close_round(self, server_round: int, replies: RoundReplies) -> RoundRecord:
        """Close the open round from its replies: ``w_{k+1}`` and the round's statistics, as one frozen record.

        ``a_k = (1/r) (sum_i (g_i + zeta_i) [+ server noise])``, ``m_{k+1} = mu m_k + a_k``,
        ``w_{k+1} = w_k - beta_k m_{k+1}``, and the accountant charged the round's (nominal) event. The sum is
        the clients' results in ascending client id, or the sum the runner formed (secure aggregation, a
        device). A round that ``halted`` (no update could be summed) counts every sampled client that did not
        fail or was not rejected as a dropout, so it releases the server's top-up alone, ``N(0, (zC)^2 I)``, and
        is charged like every other round: whether a round halts depends on who was sampled and survived, so
        releasing (and charging) nothing would tell who took part. Recorded with ``skipped = 1``.
        """
        if self._w is None or self._round != server_round:
            raise RuntimeError(f"closing round {server_round} without begin_round({server_round})")
        norms: list[float] | np.ndarray = []
        clean_total: Vector | None = None
        if replies.halted is not None:
            logger.warning(
                "Round %d: no update could be summed (%s); the round releases noise only", server_round, replies.halted
            )
            total, num_received = np.zeros(self.release_dim), 0
        elif replies.total is not None:
            total = np.array(replies.total, dtype=np.float64)
            if total.shape != (self.release_dim,):
                raise ValueError(f"the sum has shape {total.shape}, expected ({self.release_dim},)")
            norms, num_received = np.asarray(replies.norms, dtype=np.float64), replies.num_summed
            if replies.clean_total is not None and self.cfg.diagnostics:
                clean_total = np.array(replies.clean_total, dtype=np.float64)
        else:
            total = np.zeros(self.release_dim)
            clean_total = np.zeros(self.release_dim) if self.cfg.diagnostics else None
            norms, last_id = [], -1
            for result in replies.results:
                if result.client_id <= last_id:
                    raise ValueError("client results must come in ascending client id (a fixed summation order)")
                last_id = result.client_id
                total += result.noisy
                norms.append(result.update_norm)
                if clean_total is not None and result.clean is not None:
                    clean_total += result.clean
            num_received = len(norms)
        return self._close(server_round, total, num_received, norms, clean_total, replies)

    def _close(
        self, server_round: int, total: Vector, num_received: int, norms: list[float] | np.ndarray,
        clean_total: Vector | None, replies: RoundReplies,
    ) -> RoundRecord:  # fmt: skip
        k, num_sampled = server_round - 1, self._num_sampled
        r = self.params.clients_per_round
        denominator = self.round_mechanism.denominator
        num_dropped = max(0, num_sampled - num_received - replies.num_failed - replies.num_rejected)
        if num_dropped:
            logger.warning("Round %d: %d sampled clients did not reply (dropouts)", server_round, num_dropped)
        # the server's share: all of (zC)^2 for `server` placement, the missing replies' share otherwise; with
        # banded-MF noise the round's (C^-1 Z)_k instead, every round
        server_std = self.noise_stds_for(self._cohort, num_received)[1]
        noise = self.round_mechanism.server_noise(k, lambda: self._rng(Stream.SERVER_NOISE, k), server_std)
        if noise is not None:
            total += noise
        clip = self.clip if self.bound.private else float("nan")
        frac_unclipped = float("nan")
        if self.adaptive is not None:  # the released count T_k rides as the last coordinate (core.adaptive_clip)
            total, released_count = self.adaptive.split(total)
            if clean_total is not None:
                clean_total = clean_total[:-1]
            clip, frac_unclipped = self.adaptive.step(released_count, r)
        beta = server_lr_at(k, self.cfg.local_lr, self.cfg.lr_decay, self.cfg.server_lr)
        a = fixed_denominator_mean(total, denominator)
        w_new, self.momentum = momentum_step(self._w, self.momentum, a, beta, self.cfg.server_momentum)
        mean_norm = frac_clipped = snr = float("nan")
        if len(norms) and not self.cfg.secure_noise:  # un-noised statistics of client data: seeded research mode only
            norms_arr = np.asarray(norms, dtype=np.float64)
            mean_norm = float(np.add.reduce(norms_arr) / len(norms_arr))  # np.mean's sum and division
            if self.adaptive is None:  # adaptive-clip releases the private b_k instead
                frac_clipped = int(np.count_nonzero(norms_arr > self.cfg.clip)) / len(norms_arr)
        if clean_total is not None:
            clean_mean = clean_total / denominator
            noise_norm = _norm(a - clean_mean)
            snr = _norm(clean_mean) / noise_norm if noise_norm > 0 else float("inf")
        epsilon = float("nan")
        if self.accountant is not None:
            event = self.round_event(num_sampled, num_received)
            z_k = event.z if event.z is not None else float("nan")
            self.accountant.step(event)
            if self.epsilon_each_round or server_round == self.cfg.num_rounds:  # the last round's, always
                epsilon = self.accountant.epsilon
        else:
            z_k, epsilon = 0.0, float("inf")
        stats = RoundStats(
            round=server_round,
            num_sampled=num_sampled,
            num_received=num_received,
            num_failed=replies.num_failed,
            num_dropped=num_dropped,
            num_rejected=replies.num_rejected + replies.num_unexpected,
            eta=local_lr_at(k, self.cfg.local_lr, self.cfg.lr_decay),
            beta=beta,
            snr=snr,
            frac_clipped=frac_clipped,
            clip=clip,
            frac_unclipped=frac_unclipped,
            mean_update_norm=mean_norm,
            noise_multiplier=z_k,
            epsilon=epsilon,
            skipped=int(replies.halted is not None),
            rejected_reasons=replies.rejected_reasons,
            failed_reasons=replies.failed_reasons,
        )
        self._history[server_round] = stats
        self._w, self._round = None, None
        return RoundRecord(self.represent(w_new) if self.represent is not None else w_new, stats)
