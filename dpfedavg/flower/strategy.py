"""DP-FedAvg / DP-NormFedAvg as a Flower (Message API) strategy.

`RunStrategy` (the public `dpfedavg.DPFedAvg`) implements Flower's public `Strategy`
hooks. It differs from Flower's ``FedAvg`` where FedAvg is wrong for user-level DP:

* sampling: ``FedAvg`` draws a fixed-size ``random.sample`` of nodes; Alg. 1
  line 3 samples every client independently with ``q = r/n`` (Poisson
  sampling, which the privacy accountant's amplification assumes);
* aggregation: ``FedAvg`` averages by ``num-examples`` over the replies
  received; Alg. 1 line 12 divides the sum by the fixed expected cohort size ``r``.

The server math (sampling, aggregation, momentum, schedules, accounting, the
random iterate) lives in `DPServer`, shared
with the batched engine. Which node hosts which clients is
`federation`'s, the per-client reply checks `replies`'
(message layout: `dpfedavg.flower.protocol`); this module builds the round's
messages (one per node, naming its sampled clients when it hosts several) and
hands the checked results to the server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from dpfedavg.config import RunConfig
from dpfedavg.core.types import RoundInstructions, Vector
from dpfedavg.engines.canaries import WithCanaries
from dpfedavg.flower.federation import Federation
from dpfedavg.flower.protocol import (
    ARRAYS,
    CLIENT_IDS,
    CONFIG,
    from_array_record,
    instructions_to_config_record,
    to_array_record,
)
from dpfedavg.flower.replies import collect_replies
from dpfedavg.flower.secure_aggregation import HALTED, SecureSum, secure_sum, workflow_for
from dpfedavg.io.metrics import RoundStats
from dpfedavg.privacy.plan import PrivacyPlan
from dpfedavg.privacy.plausibility import (
    MAX_FALSE_REJECTION,
    ReplyLimits,
    false_rejection_probability,
    reply_limits,
)
from dpfedavg.privacy.setup import PrivacySetup
from dpfedavg.server.dp_server import DPServer
from dpfedavg.server.health import ReplyHealth, TrainingStopped
from dpfedavg.server.loop import ClientRunner, run_rounds
from dpfedavg.server.round import RoundRecord, RoundReplies

__all__ = ["FlatModel", "FlowerRunner", "RunStrategy", "log_summary", "privacy_plan_lines", "reply_bound"]

logger = logging.getLogger(__name__)


def privacy_plan_lines(cfg: RunConfig, plan: PrivacyPlan, sigma: float) -> list[str]:
    """The start-up lines on C, z (calibrated or given), sigma = zC/r, the placement and the budget stop."""
    how = (
        f"calibrated for (epsilon={plan.target_epsilon:g}, delta={plan.delta:g}) over K={plan.rounds}"
        if plan.calibrated
        else f"given; nominal epsilon {plan.nominal_epsilon:.4g} at delta={plan.delta:g} over K={plan.rounds}"
    )
    lines = [f"C={cfg.clip:g}, z={plan.noise_multiplier:.5g} ({how}, {plan.accountant} accountant), "
             f"sigma=zC/r={sigma:.4g}, noise placement: {cfg.noise_placement}"]  # fmt: skip
    if plan.max_epsilon is not None:
        lines.append(f"Privacy budget: stop before a round that would exceed epsilon={plan.max_epsilon:g}")
    return lines


def log_summary(lines: list[str]) -> None:
    """Log a strategy's set-up as Flower's strategies do: one tree line each."""
    for i, line in enumerate(lines):
        logger.info("\t%s── %s", "└" if i == len(lines) - 1 else "├", line)


def reply_bound(server: DPServer) -> float:
    """The norm bound of a reply's vector this round: ``C``, or ``C_aug`` with adaptive-clip's count coordinate."""
    return server.sensitivity if server.bound.private else float("inf")


class RunStrategy(Strategy):
    """DP-FedAvg (``algorithm='clip'``, Alg. 1), DP-NormFedAvg (``'norm'``, Alg. 2) or FedAvg (``'none'``).

    The Flower strategy of dpfedavg's own ServerApp and ClientApp (a flat model ``w``). The one public class,
    `dpfedavg.DPFedAvg` (`dpfedavg.flower.app_strategy.DPFedAvg`), is this strategy built from ``(cfg, dim)``,
    or from keywords for *your* app.

    Parameters
    ----------
    cfg:
        The validated run configuration (K, E, eta_0, gamma, beta, mu, n, r,
        C, z, seed, ...).
    dim:
        Length of the flat model vector ``w``.
    setup:
        The run's privacy set-up (`dpfedavg.privacy.setup.PrivacySetup`); resolved from ``cfg`` when omitted.
    server:
        The server state to drive (`dpfedavg.server.run.prepare_run()` builds it); built from ``cfg``,
        ``dim`` and ``setup`` when omitted.
    sleep:
        Injected for tests: how to wait between polls of the Grid.
    """

    #: ``canary-clients``: the inserted canaries' directions, clients ``n ..`` of the server's federation; the
    #: server computes their ``g + zeta`` (``dpfedavg.core.canaries``), no node hosts them. ``None``: no canary
    #: (always for the strategy on a user's own app, whose constructor does not take them).
    canaries: np.ndarray | None = None
    #: Who the error of a run stopped for unusable replies names (`dpfedavg.server.health.stopped()`).
    stops_as = "the run"

    def __init__(
        self,
        cfg: RunConfig,
        dim: int | None = None,
        *,
        setup: PrivacySetup | None = None,
        server: DPServer | None = None,
        sleep: Callable[[float], None] = time.sleep,
        canaries: np.ndarray | None = None,
    ) -> None:
        if server is None:
            if dim is None:
                raise TypeError("DPFedAvg needs dim (the model's length) or a server")
            server = DPServer(cfg, dim, setup=setup)
        self.cfg = cfg
        self.dim = server.dim
        #: The server state and math (shared with the batched engine).
        self.server = server
        #: Which SuperNode hosts which clients (discovery, reconnected nodes).
        self.federation = Federation(cfg, sleep)
        #: The round before which the privacy budget stopped the run, if it did.
        self.stopped_before_round: int | None = None
        #: Why the run stopped when its replies were unusable (fail fast: `dpfedavg.server.health`), or None.
        self.failed: TrainingStopped | None = None
        self.health = ReplyHealth(max_failed_fraction=cfg.max_failed_fraction)
        #: What travels in a round's messages (the flat model; a user's app passes its arrays).
        self.edge: FlatModel | Any = FlatModel(cfg, self.federation)
        self._closed: dict[int, RoundRecord] = {}  # rounds a rule closed in configure_train
        self._hook_runner: FlowerRunner | None = None  # the runner of configure_train / aggregate_train
        self.canaries = canaries
        #: Wall seconds per round spent in our code (configure, aggregate, evaluate) and waiting on
        #: Flower (``grid.send_and_receive``: delivery, the ClientApps, replies), by round.
        self.timings: dict[int, dict[str, float]] = {}

    # ------------------------------------------------------------------ info
    @property
    def plan(self) -> PrivacyPlan:
        return self.server.plan

    @property
    def false_rejection_p(self) -> float:
        """``p``, the probability that an honest reply is rejected (`dpfedavg.privacy.plausibility`)."""
        plan, cfg = self.server.plan, self.cfg
        if not plan.dp:
            return MAX_FALSE_REJECTION
        return false_rejection_probability(
            epsilon=plan.nominal_epsilon, rounds=cfg.num_rounds, num_clients=cfg.num_clients, delta=plan.delta
        )

    @property
    def history(self) -> Mapping[int, RoundStats]:
        """Per-round statistics, by 1-based round."""
        return self.server.history

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far for ``delta`` (``inf`` without DP)."""
        return self.server.epsilon

    def summary(self) -> None:
        """Log the DP configuration (called by ``Strategy.start``)."""
        cfg, plan = self.cfg, self.plan
        lines = [f"Algorithm: {self.server.bound.title}", f"Poisson sampling: n={cfg.num_clients}, "
                 f"r={cfg.clients_per_round:g}, q={cfg.sampling_rate:.4g}; aggregation divides by r"]  # fmt: skip
        if cfg.clients_per_node > 1:
            lines.append(f"Virtual clients: {cfg.clients_per_node} per SuperNode ({cfg.num_nodes} SuperNodes); one "
                         "message per node, one update per client")  # fmt: skip
        lines += privacy_plan_lines(cfg, plan, self.server.sigma) if plan.dp else []
        if cfg.secure_aggregation:
            lines.append(f"Secure aggregation: SecAgg+ (shares {cfg.secagg_num_shares:g}, threshold "
                         f"{cfg.secagg_reconstruction_threshold:g}), Q=2^{cfg.secagg_quantization_bits} levels, "
                         f"M=2^{cfg.secagg_modulus_bits}; the server sees only the sum")  # fmt: skip
        beta = "eta_k" if cfg.server_lr is None else f"{cfg.server_lr:g}"
        log_summary([*lines, f"E={cfg.local_steps}, eta_0={cfg.local_lr:g}, gamma={cfg.lr_decay:g}, beta={beta}, "
                             f"mu={cfg.server_momentum:g}"])  # fmt: skip
        if cfg.secure_aggregation and not cfg.secure_noise:
            logger.warning(
                "secure-aggregation with secure-noise = false: the clients' noise is seeded from the run's "
                "seed, so whoever knows it can subtract the noise from the sum; set secure-noise = true "
                "outside research simulations"
            )

    def reply_limits(self, num_sampled: int, clients: int = 1) -> ReplyLimits | None:
        """The plausibility bounds of ``clients`` honest clients' (summed) vectors this round; ``None`` without a bound.

        ``N C (1 + 1e-5) + sqrt(N) s (sqrt(d) + sqrt(2 ln(1/p)))`` with the round's ``C`` (``C_aug``), each client's
        noise std ``s`` at ``|S_k| = num_sampled`` and ``d`` the vector's length (`dpfedavg.privacy.plausibility`).
        """
        server = self.server
        if not server.bound.private:
            return None
        return reply_limits(
            bound=server.sensitivity,
            noise_std=server.noise_stds(num_sampled)[0],
            dim=server.release_dim,
            p=self.false_rejection_p,
            count_scale=server.adaptive.scale if server.adaptive is not None else None,
            clients=clients,
        )

    def describe_reply_checks(self) -> dict[str, object]:
        """What ``config.json`` says about the plausibility checks of this run's replies (Flower engine only)."""
        plan, p = self.server.plan, self.false_rejection_p
        slack = (
            float(
                np.exp(np.logaddexp(0.0, plan.nominal_epsilon) + np.log(self.cfg.num_rounds * self.cfg.num_clients * p))
            )
            if plan.dp
            else None
        )
        return {
            "bound": "N C (1 + 1e-5) + sqrt(N) s (sqrt(d) + sqrt(2 ln(1/p))) for a reply (N = 1) or a secure sum",
            "false_rejection_probability": p,
            "delta_added_at_most": slack,
        }

    # ------------------------------------------------------------ discovery
    @property
    def discovery_seconds(self) -> float | None:
        """Wall seconds spent waiting for the SuperNodes and learning their partition ids."""
        return self.federation.discovery_seconds

    def discover_clients(self, grid: Grid, timeout: float | None = None) -> dict[int, int]:
        """Wait for all SuperNodes and learn each one's ``partition-id`` (`Federation.discover()`)."""
        return self.federation.discover(grid, timeout)

    # -------------------------------------------------------------- training
    def before_rounds(self, grid: Grid) -> None:
        """What must hold before a round is opened: the nodes discovered (`discover_clients()`)."""
        if not self.federation.node_of_partition:
            self.discover_clients(grid)

    def available(self, grid: Grid) -> list[int] | None:
        """The connected clients, for a noise mechanism whose cohort depends on them."""
        return self.federation.connected_clients(grid)

    def run(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        *,
        timeout: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        first_round: int = 1,
        on_round_end: Callable[[RoundRecord], object] | None = None,
    ) -> Result:
        """Discover the clients, then run rounds ``first_round .. K`` through `dpfedavg.server.loop.run_rounds()`.

        dpfedavg's own ServerApp calls it (``DPFedAvg(cfg, dim).start(...)`` too). The loop every engine shares
        (budget stop, sampling, the secure-aggregation rule for fewer than two clients), with `FlowerRunner`
        reaching the clients: configure_train's messages, ``grid.send_and_receive`` with the round timeout,
        aggregate_train; or Flower's SecAgg+ workflow (`secure_aggregation`), in which the server gets the sum of
        the sampled clients' updates, never one of them. No client-side evaluation. ``on_round_end(record)`` (the
        closed `RoundRecord`; recording: metrics.csv, checkpoint) and then ``evaluate_fn(k, arrays)`` (Flower's
        server-side evaluation, also of the initial arrays as round 0 when ``first_round`` is 1) are called after
        every round; ``first_round > 1`` continues a resumed run. Replies that are unusable stop the run
        (`health`; `failed` says why).

        If the privacy budget (``max-epsilon``) would be exceeded by the next round, the loop stops
        before that round and the result holds the last model; `stopped_before_round` says which
        round was not run.
        """
        if not 1 <= first_round <= self.cfg.num_rounds + 1:  # num-rounds + 1: a resumed run that only finishes
            raise ValueError(f"first_round={first_round} is outside 1..num-rounds + 1 = {self.cfg.num_rounds + 1}")
        self.before_rounds(grid)
        logger.info("Starting DPFedAvg strategy:")
        self.summary()
        timeout = self.cfg.round_timeout if timeout is None else timeout
        runner = FlowerRunner(self, self.edge, grid, ConfigRecord() if train_config is None else train_config, timeout)
        clients: ClientRunner = runner
        if self.canaries is not None:  # the inserted canaries: the server computes them, no node hosts one
            clients = WithCanaries(runner, self.canaries, self.cfg.num_clients)
        result, edge = Result(arrays=initial_arrays), self.edge

        def evaluate(server_round: int, arrays: ArrayRecord) -> None:
            if evaluate_fn is not None:
                logger.info("Global evaluation")
                metrics = evaluate_fn(server_round, arrays)
                logger.info("\t└──> MetricRecord: %s", metrics)
                if metrics is not None:
                    result.evaluate_metrics_serverapp[server_round] = metrics

        def record(closed: RoundRecord) -> None:
            server_round = closed.round
            result.arrays = edge.arrays(closed.w)
            result.train_metrics_clientapp[server_round] = MetricRecord(edge.round_metrics(closed))
            clock = time.perf_counter()
            if on_round_end is not None:
                on_round_end(closed)
            evaluate(server_round, result.arrays)
            self.timings[server_round] = {
                **runner.timings.pop(server_round, dict.fromkeys(FlowerRunner.PHASES, 0.0)),
                "evaluate_and_record_s": time.perf_counter() - clock,
            }

        if first_round == 1:
            evaluate(0, initial_arrays)
        rounds = range(first_round, self.cfg.num_rounds + 1)
        loop = run_rounds(self.server, clients, edge.flatten(initial_arrays), rounds, on_round_end=record,
                          health=self.health, available=lambda: self.available(grid), who=self.stops_as)  # fmt: skip
        self.failed = loop.failed
        self.stopped_before_round = loop.stopped_before_round
        return result

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Open the round (`DPServer.begin_round()`: its rules, the cohort) and build its messages.

        Flower's hook, for driving the strategy round by round (tests, a custom loop);
        `run()` (which `start()` calls) runs the same opening through `dpfedavg.server.loop.run_rounds()`. A round a
        rule closed at once (secure aggregation with fewer than three clients) sends nothing, and
        `aggregate_train()` then returns its model. Secure-aggregation rounds run only in `run()`.
        """
        self.before_rounds(grid)
        if self.cfg.secure_aggregation or self.canaries is not None:
            raise RuntimeError("secure-aggregation rounds and canary audits run through the strategy's start()")
        w = self.edge.flatten(arrays)
        connected = self.available(grid) if self.server.round_mechanism.selects_from_available else None
        start = self.server.begin_round(server_round, w, connected)
        if start.closed:
            assert start.record is not None
            self._closed[server_round] = start.record
            return []
        assert start.instructions is not None
        self._hook_runner = FlowerRunner(self, self.edge, grid, config, self.cfg.round_timeout)
        return self._hook_runner.messages(server_round, start.clients, w, start.instructions)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No client-side evaluation: the model is evaluated on the server (``evaluate_fn``).

        Evaluating on clients would cost a second message round per round and,
        on private data, would need its own privacy accounting.
        """
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """No client-side evaluation (see `configure_evaluate()`)."""
        return None

    def aggregate_train(
        self,
        server_round: int,
        replies: Iterable[Message],
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check the replies client by client (`replies.collect_replies()`), then let the server close the round.

        The server divides by the fixed r, applies momentum and charges the accountant; every sampled
        client that is neither received, failed nor rejected is a dropout. A reply from a node that was not
        sampled (or a second one) is counted in ``num_rejected`` besides, with its reason: it hides no dropout.
        """
        record = self._closed.pop(server_round, None)
        if record is None:
            if self._hook_runner is None:
                raise RuntimeError(f"aggregate_train({server_round}) without configure_train({server_round})")
            record = self.server.close_round(server_round, self._hook_runner.replies(server_round, replies))
        return self.edge.arrays(record.w), MetricRecord(record.stats.as_metrics())


class FlatModel:
    """What dpfedavg's own apps put in a round's messages: the flat model ``w``, the run's nodes (`Federation`).

    The `FlowerRunner` owns the steps of a Flower round; this object (or the user's app's,
    `dpfedavg.flower.app_strategy.UserArrays`) says what travels: which connected node hosts each sampled client,
    the model's arrays, the keys each node's message adds (the ids of its sampled clients when it hosts several)
    and the SecAgg+ payload.
    """

    #: A SecAgg+ round that halted on the clients' errors counts them as failed (fail fast); dpfedavg's own
    #: clients' errors are dropouts of the protocol.
    secagg_errors_fail = False

    def __init__(self, cfg: RunConfig, federation: Federation) -> None:
        self.cfg, self.federation = cfg, federation

    def nodes(self, server_round: int, clients: np.ndarray, grid: Grid) -> dict[int, list[int]]:
        """Node id -> its sampled clients (ascending), for the sampled clients whose node is connected.

        The others are dropouts (logged): sampling stays over all n clients with q = r/n (the accountant's n).
        """
        online = set(grid.get_node_ids())
        known = self.federation.partition_of_node
        if online - set(known):
            self.federation.learn_new_nodes(grid, sorted(online - set(known)))
        sampled, offline = self.federation.group_by_node(clients, online)
        if offline:
            logger.warning(
                "Round %d: %d sampled clients are not connected (dropouts): %s",
                server_round,
                len(offline),
                offline[:10],
            )
        return sampled

    def run_keys(self) -> dict[str, object]:
        """Keys every message of the run carries besides the round's instructions (none here)."""
        return {}

    def flatten(self, arrays: ArrayRecord) -> Vector:
        return from_array_record(arrays)

    def arrays(self, w: Vector) -> ArrayRecord:
        return to_array_record(w)

    def round_metrics(self, closed: RoundRecord) -> dict[str, float]:
        """The round's ``train_metrics_clientapp``: its statistics (`RoundStats`)."""
        return closed.stats.as_metrics()

    def node_keys(self, clients: list[int]) -> dict[str, object]:
        """A node hosting virtual clients gets the ids of its sampled clients (``client-ids``)."""
        return {} if self.cfg.clients_per_node == 1 else {CLIENT_IDS: clients}

    def secagg_payload(self, w: Vector, config: ConfigRecord) -> tuple[object, ConfigRecord]:
        return w, config

    def observe(self, server_round: int, replies: list[Message], sampled: dict[int, list[int]]) -> None:
        """Nothing to keep from the replies besides what the server sums."""


class FlowerRunner:
    """The Flower engine's `ClientRunner`: the steps of a round through Flower's Grid.

    Without secure aggregation: one TRAIN message per node with sampled, connected clients (`messages()`),
    ``send_and_receive`` with the round timeout, then the replies checked client by client (`replies()`). With
    it: Flower's SecAgg+ workflow, then the sum (`secure_replies()`). What travels is the ``edge`` it is given
    (`FlatModel`, or a user's app's `dpfedavg.flower.app_strategy.UserArrays`); the ``strategy`` gives the server,
    the config, the reply checks' bounds (`RunStrategy.reply_limits()`) and the inserted canaries. Returns the
    round's `RoundReplies`; the loop closes the round. Records the seconds of each phase per round in `timings`.
    """

    PHASES = ("configure_s", "send_and_receive_s", "aggregate_s")

    def __init__(
        self, strategy: RunStrategy, edge: Any, grid: Grid, train_config: ConfigRecord, timeout: float
    ) -> None:
        self.strategy, self.edge, self.grid = strategy, edge, grid
        self.train_config, self.timeout = train_config, timeout
        self.server, self.cfg = strategy.server, strategy.cfg
        self.timings: dict[int, dict[str, float]] = {}
        #: This round's: node id -> its sampled, connected clients; the cohort's size; the train config.
        self.sampled: dict[int, list[int]] = {}
        self.num_sampled = 0
        self.config = ConfigRecord()

    def run_round(self, server_round: int, clients: np.ndarray, w: Vector, ins: RoundInstructions) -> RoundReplies:
        clock = time.perf_counter()
        messages = self.messages(server_round, clients, w, ins)
        if self.cfg.secure_aggregation:
            t_configure = time.perf_counter()
            outcome = self._secure_sum(server_round, w)
            t_wait = time.perf_counter()
            replies = self.secure_replies(server_round, outcome)
        else:
            t_configure = time.perf_counter()
            received = list(self.grid.send_and_receive(messages, timeout=self.timeout)) if messages else []
            t_wait = time.perf_counter()
            replies = self.replies(server_round, received)
        self.timings[server_round] = {
            "configure_s": t_configure - clock,
            "send_and_receive_s": t_wait - t_configure,
            "aggregate_s": time.perf_counter() - t_wait,
        }
        return replies

    def messages(self, server_round: int, clients: np.ndarray, w: Vector, ins: RoundInstructions) -> list[Message]:
        """Map the round's sampled clients to connected nodes; one TRAIN message per node (ascending node id).

        Each carries ``w_k`` (the edge's arrays) and the train config: the caller's, the round's instructions, the
        edge's run keys and node keys. ``|S_k|`` is the instructions' (with inserted canaries, `WithCanaries` gives
        this runner the real clients only).
        """
        self.num_sampled = ins.cohort_size
        self.sampled = self.edge.nodes(server_round, clients, self.grid)
        connected = sum(len(ids) for ids in self.sampled.values())
        if self.cfg.secure_aggregation and connected < self.num_sampled:  # |S_k| = the SecAgg+ cohort (guard.py)
            ins, self.num_sampled = self.server.connected_cohort(server_round, connected), connected
        config = ConfigRecord(dict(self.train_config))
        for key, value in instructions_to_config_record(ins).items():
            config[key] = value
        for key, value in self.edge.run_keys().items():
            config[key] = value
        self.config = config
        if not self.sampled or self.cfg.secure_aggregation:
            return []
        arrays = self.edge.arrays(w)
        messages = []
        for node in sorted(self.sampled):
            keys = self.edge.node_keys(self.sampled[node])
            record = RecordDict({ARRAYS: arrays, CONFIG: ConfigRecord({**config, **keys}) if keys else config})
            messages.append(Message(content=record, message_type=MessageType.TRAIN, dst_node_id=node))
        return messages

    def replies(self, server_round: int, replies: Iterable[Message]) -> RoundReplies:
        """The round's replies checked client by client (`collect_replies()`)."""
        replies = list(replies)
        self.edge.observe(server_round, replies, self.sampled)
        return collect_replies(
            server_round,
            replies,
            self.sampled,
            dim=self.server.release_dim,
            diagnostics=self.cfg.diagnostics,
            clip=reply_bound(self.server),
            block=self.cfg.clients_per_node > 1,
            limits=self.strategy.reply_limits(self.num_sampled),
        )

    # ------------------------------------------------- secure aggregation
    def _secure_sum(self, server_round: int, w: Vector) -> SecureSum:
        """SecAgg+ over this round's sampled, connected clients (see `secure_aggregation`)."""
        secagg_grid = self.server.secagg_grid(self.num_sampled)
        assert secagg_grid is not None  # secure-aggregation is on
        cfg = self.cfg
        workflow = workflow_for(
            secagg_grid,
            cfg.secagg_num_shares,
            cfg.secagg_reconstruction_threshold,
            cfg.secagg_timeout or self.timeout,
            len(self.sampled),
        )
        payload, config = self.edge.secagg_payload(w, self.config)
        online = len(set(self.grid.get_node_ids()))
        return secure_sum(self.grid, workflow, server_round, payload, config, sorted(self.sampled), online)

    def secure_replies(self, server_round: int, outcome: SecureSum) -> RoundReplies:
        """A SecAgg+ round's replies: its sum, or why it halted (the round then releases the server's noise)."""
        refused = {nid: why for nid, why in outcome.refused.items() if nid in self.sampled}
        for nid, why in sorted(refused.items()):
            logger.warning("Round %d: rejected reply from node %d: node %d refused the round: %s", server_round, nid,
                           nid, why)  # fmt: skip
        for reason in outcome.errors:
            if not any(why in reason for why in refused.values()):
                logger.warning("Round %d: secure aggregation: %s", server_round, reason[:300])
        reasons = tuple(f"node {nid} refused the round: {why}" for nid, why in sorted(refused.items()))
        rejected = sum(len(self.sampled[nid]) for nid in refused)
        if outcome.total is None:
            failed = [e for e in outcome.errors if e != HALTED] if self.edge.secagg_errors_fail else []
            return RoundReplies(
                num_failed=min(self.num_sampled, len(failed)),
                num_rejected=rejected,
                failed_reasons=tuple(failed),
                rejected_reasons=reasons,
                halted="; ".join(outcome.errors) or "SecAgg+ halted",
            )
        unknown = [nid for nid in outcome.contributors if nid not in self.sampled]
        if unknown:
            raise RuntimeError(f"SecAgg+ summed nodes that were not sampled: {unknown[:5]}")
        # one client's masked vector can move the sum anywhere in the modular range: a sum no N honest
        # clients produce (except w.p. < p) is not used; the round releases the server's noise only
        limits = self.strategy.reply_limits(self.num_sampled, clients=len(outcome.contributors))
        reason = limits.violation(outcome.total) if limits is not None else None
        if reason is not None:
            reason = f"the secure sum of {len(outcome.contributors)} clients is {reason}"
            return RoundReplies(num_rejected=rejected, rejected_reasons=(*reasons, reason), halted=reason)
        return RoundReplies(
            total=outcome.total, num_summed=len(outcome.contributors), num_rejected=rejected, rejected_reasons=reasons
        )
