"""DP-FedAvg / DP-NormFedAvg as a Flower (Message API) strategy.

`DPFedAvg` implements Flower's public `Strategy`
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
from collections.abc import Callable, Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from dpfedavg.config import RunConfig
from dpfedavg.core.canaries import canary_results
from dpfedavg.core.types import RoundInstructions, Vector
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
from dpfedavg.flower.secure_aggregation import SecureSum, secure_sum, workflow_for
from dpfedavg.io.metrics import RoundStats
from dpfedavg.privacy.plan import PrivacyPlan
from dpfedavg.privacy.plausibility import (
    MAX_FALSE_REJECTION,
    ReplyLimits,
    false_rejection_probability,
    reply_limits,
)
from dpfedavg.server.dp_server import DPServer
from dpfedavg.server.health import ReplyHealth, TrainingStopped
from dpfedavg.server.loop import run_rounds

__all__ = ["DPFedAvg", "FlowerRunner", "log_privacy_plan"]

logger = logging.getLogger(__name__)


def log_privacy_plan(cfg: RunConfig, plan: PrivacyPlan, sigma: float) -> None:
    """The start-up lines on C, z (calibrated or given), sigma = zC/r, the placement and the budget stop."""
    how = (
        f"calibrated for (epsilon={plan.target_epsilon:g}, delta={plan.delta:g}) over K={plan.rounds}"
        if plan.calibrated
        else f"given; nominal epsilon {plan.nominal_epsilon:.4g} at delta={plan.delta:g} over K={plan.rounds}"
    )
    logger.info(
        "\t├── C=%g, z=%.5g (%s, %s accountant), sigma=zC/r=%.4g, noise placement: %s",
        cfg.clip,
        plan.noise_multiplier,
        how,
        plan.accountant,
        sigma,
        cfg.noise_placement,
    )
    if plan.max_epsilon is not None:
        logger.info("\t├── Privacy budget: stop before a round that would exceed epsilon=%g", plan.max_epsilon)


class DPFedAvg(Strategy):
    """DP-FedAvg (``algorithm='clip'``, Alg. 1), DP-NormFedAvg (``'norm'``, Alg. 2) or FedAvg (``'none'``).

    This class runs dpfedavg's own ServerApp and ClientApp (a flat model ``w``). The public
    `dpfedavg.DPFedAvg` (`app_strategy`) is this class, plus its keyword form for *your* app.

    Parameters
    ----------
    cfg:
        The validated run configuration (K, E, eta_0, gamma, beta, mu, n, r,
        C, z, seed, ...).
    dim:
        Length of the flat model vector ``w``.
    plan:
        The privacy plan; calibrated from ``cfg`` when omitted.
    server:
        The server state to drive (`dpfedavg.server.run.prepare_run()` builds it); built from ``cfg``,
        ``dim`` and ``plan`` when omitted.
    sleep:
        Injected for tests: how to wait between polls of the Grid.
    """

    #: ``canary-clients``: the inserted canaries' directions, clients ``n ..`` of the server's federation; the
    #: server computes their ``g + zeta`` (``dpfedavg.core.canaries``), no node hosts them. ``None``: no canary
    #: (always for the strategy on a user's own app, whose constructor does not take them).
    canaries: np.ndarray | None = None
    _canary_ids: np.ndarray = np.zeros(0, dtype=np.int64)  # this round's sampled canaries
    _instructions: RoundInstructions | None = None  # this round's instructions (the canaries follow them too)

    def __init__(
        self,
        cfg: RunConfig,
        dim: int | None = None,
        *,
        plan: PrivacyPlan | None = None,
        server: DPServer | None = None,
        sleep: Callable[[float], None] = time.sleep,
        canaries: np.ndarray | None = None,
    ) -> None:
        if server is None:
            if dim is None:
                raise TypeError("DPFedAvg needs dim (the model's length) or a server")
            server = DPServer(cfg, dim, plan=plan)
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
        self._sampled: dict[int, list[int]] = {}  # node id -> its sampled clients (ascending), this round
        self._closed: dict[int, Vector] = {}  # w_{k+1} of rounds a rule closed in configure_train
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
    def history(self) -> dict[int, RoundStats]:
        """Per-round statistics, by 1-based round."""
        return self.server.history

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far for ``delta`` (``inf`` without DP)."""
        return self.server.epsilon

    @property
    def random_iterate(self) -> Vector | None:
        return self.server.random_iterate

    @property
    def random_round(self) -> int | None:
        return self.server.random_round

    def noise_stds(self, num_sampled: int) -> tuple[float, float]:
        """``(per-client std, server std on the sum)`` of a round with ``num_sampled`` clients."""
        return self.server.noise_stds(num_sampled)

    def summary(self) -> None:
        """Log the DP configuration (called by ``Strategy.start``)."""
        cfg, plan = self.cfg, self.plan
        logger.info("\t├── Algorithm: %s", self.server.bound.title)
        logger.info(
            "\t├── Poisson sampling: n=%d, r=%g, q=%.4g; aggregation divides by r",
            cfg.num_clients,
            cfg.clients_per_round,
            cfg.sampling_rate,
        )
        if cfg.clients_per_node > 1:
            logger.info(
                "\t├── Virtual clients: %d per SuperNode (%d SuperNodes); one message per node, one update per client",
                cfg.clients_per_node,
                cfg.num_nodes,
            )
        if plan.dp:
            log_privacy_plan(cfg, plan, self.server.sigma)
        if cfg.secure_aggregation:
            logger.info(
                "\t├── Secure aggregation: SecAgg+ (shares %g, threshold %g), Q=2^%d levels, M=2^%d; "
                "the server sees only the sum",
                cfg.secagg_num_shares,
                cfg.secagg_reconstruction_threshold,
                cfg.secagg_quantization_bits,
                cfg.secagg_modulus_bits,
            )
            if not cfg.secure_noise:
                logger.warning(
                    "secure-aggregation with secure-noise = false: the clients' noise is seeded from the run's "
                    "seed, so whoever knows it can subtract the noise from the sum; set secure-noise = true "
                    "outside research simulations"
                )
        beta = "eta_k" if cfg.server_lr is None else f"{cfg.server_lr:g}"
        logger.info(
            "\t└── E=%d, eta_0=%g, gamma=%g, beta=%s, mu=%g",
            cfg.local_steps,
            cfg.local_lr,
            cfg.lr_decay,
            beta,
            cfg.server_momentum,
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
    def node_of_client(self) -> dict[int, int]:
        """Client id -> Flower node id; filled by `discover_clients()`."""
        return self.federation.node_of_client

    @property
    def client_of_node(self) -> dict[int, int]:
        """Flower node id -> client id, with one client per node (``clients-per-node = 1``)."""
        if self.cfg.clients_per_node != 1:
            raise AttributeError("client_of_node: nodes host several clients; use federation.partition_of_node")
        return self.federation.partition_of_node

    @property
    def discovery_seconds(self) -> float | None:
        """Wall seconds spent waiting for the SuperNodes and learning their partition ids."""
        return self.federation.discovery_seconds

    def discover_clients(self, grid: Grid, timeout: float | None = None) -> dict[int, int]:
        """Wait for all SuperNodes and learn each one's ``partition-id`` (`Federation.discover()`)."""
        return self.federation.discover(grid, timeout)

    # -------------------------------------------------------------- training
    def start(  # type: ignore[override]
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int | None = None,
        timeout: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        *,
        first_round: int = 1,
        on_round_end: Callable[[int, Vector], object] | None = None,
    ) -> Result:
        """Discover the clients, then run rounds ``first_round .. K`` through `dpfedavg.server.loop.run_rounds()`.

        The loop every engine shares (budget stop, sampling, the secure-aggregation rule for fewer than
        two clients), with `FlowerRunner` reaching the clients: configure_train's messages,
        ``grid.send_and_receive`` with the round timeout, aggregate_train; or Flower's SecAgg+ workflow
        (`secure_aggregation`), in which the server gets the sum of the sampled clients' updates,
        never one of them. No client-side evaluation. ``evaluate_fn(k, arrays)`` (Flower's server-side
        evaluation) and then ``on_round_end(k, w_k)`` (recording: metrics.csv, checkpoint) are called
        after every round (not for round 0: the caller records the initial model); ``first_round > 1``
        continues a resumed run.

        If the privacy budget (``max-epsilon``) would be exceeded by the next round, the loop stops
        before that round and the result holds the last model; `stopped_before_round` says which
        round was not run.
        """
        del evaluate_config  # no client-side evaluation (see configure_evaluate)
        if num_rounds is not None and num_rounds != self.cfg.num_rounds:
            raise ValueError(f"num_rounds={num_rounds} differs from the config's num-rounds={self.cfg.num_rounds}")
        if not 1 <= first_round <= self.cfg.num_rounds + 1:  # num-rounds + 1: a resumed run that only finishes
            raise ValueError(f"first_round={first_round} is outside 1..num-rounds + 1 = {self.cfg.num_rounds + 1}")
        if not self.federation.node_of_partition:
            self.discover_clients(grid)
        logger.info("Starting %s strategy:", type(self).__name__)
        self.summary()
        timeout = self.cfg.round_timeout if timeout is None else timeout
        runner = FlowerRunner(self, grid, ConfigRecord() if train_config is None else train_config, timeout)
        result = Result(arrays=initial_arrays)

        def record(server_round: int, w: Vector) -> None:
            arrays = result.arrays = to_array_record(w)
            result.train_metrics_clientapp[server_round] = MetricRecord(self.history[server_round].as_metrics())
            clock = time.perf_counter()
            if evaluate_fn is not None:
                metrics = evaluate_fn(server_round, arrays)
                if metrics is not None:
                    result.evaluate_metrics_serverapp[server_round] = metrics
            if on_round_end is not None:
                on_round_end(server_round, w)
            self.timings[server_round] = {
                **runner.timings.pop(server_round, dict.fromkeys(FlowerRunner.PHASES, 0.0)),
                "evaluate_and_record_s": time.perf_counter() - clock,
            }

        rounds = range(first_round, self.cfg.num_rounds + 1)
        health = ReplyHealth(max_failed_fraction=self.cfg.max_failed_fraction)
        loop = run_rounds(
            self.server,
            runner,
            from_array_record(initial_arrays),
            rounds,
            on_round_end=record,
            health=health,
            available=lambda: self.federation.connected_clients(grid),
        )
        self.failed = loop.failed
        self.stopped_before_round = loop.stopped_before_round
        return result

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Open the round (`DPServer.begin_round()`: its rules, the cohort) and build its messages.

        Flower's hook, for driving the strategy round by round (tests, a custom loop);
        `start()` runs the same opening through `dpfedavg.server.loop.run_rounds()`. A round a
        rule closed at once (secure aggregation with fewer than three clients) sends nothing, and
        `aggregate_train()` then returns its model. Secure-aggregation rounds run only in `start()`.
        """
        if self.cfg.secure_aggregation:
            raise RuntimeError("secure-aggregation rounds run through Flower's SecAgg+ workflow: use start()")
        if not self.federation.node_of_partition:
            self.discover_clients(grid)
        connected = (
            self.federation.connected_clients(grid) if self.server.round_mechanism.selects_from_available else None
        )
        start = self.server.begin_round(server_round, from_array_record(arrays), connected)
        if start.closed:
            assert start.w is not None
            self._closed[server_round] = start.w
            return []
        assert start.instructions is not None
        train_config = self._prepare_round(server_round, start.clients, start.instructions, config, grid)
        return self._train_messages(arrays, train_config)

    def _train_messages(self, arrays: ArrayRecord, train_config: ConfigRecord) -> list[Message]:
        """One TRAIN message per node with sampled, connected clients (ascending node id): ``w_k``, the train config.

        A node hosting virtual clients also gets the ids of its sampled clients (``client-ids``).
        """
        if self.cfg.clients_per_node == 1:
            record = RecordDict({ARRAYS: arrays, CONFIG: train_config})
            return [
                Message(content=record, message_type=MessageType.TRAIN, dst_node_id=node)
                for node in sorted(self._sampled)
            ]
        messages = []
        for node in sorted(self._sampled):
            config = ConfigRecord({**train_config, CLIENT_IDS: self._sampled[node]})
            record = RecordDict({ARRAYS: arrays, CONFIG: config})
            messages.append(Message(content=record, message_type=MessageType.TRAIN, dst_node_id=node))
        return messages

    def _prepare_round(
        self, server_round: int, clients: np.ndarray, instructions: RoundInstructions, config: ConfigRecord, grid: Grid
    ) -> ConfigRecord:
        """Map the round's sampled clients to connected nodes; the round's train config.

        Fills ``self._sampled`` (node id -> its sampled clients) with the sampled
        clients whose node is connected; the others are dropouts.
        """
        if self.canaries is not None:  # the canaries are computed here; the nodes host the n real clients
            n = self.cfg.num_clients
            self._canary_ids, clients = clients[clients >= n], clients[clients < n]
            self._instructions = instructions
        online = set(grid.get_node_ids())
        known = self.federation.partition_of_node
        if online - set(known):
            self.federation.learn_new_nodes(grid, sorted(online - set(known)))
        self._sampled, offline = self.federation.group_by_node(clients, online)
        if offline:
            # Sampling stays over all n clients with q = r/n (the accountant's n); a sampled client
            # that is not connected cannot take part: it is a dropout, and nothing is sent to it.
            logger.warning(
                "Round %d: %d sampled clients are not connected (dropouts): %s",
                server_round,
                len(offline),
                offline[:10],
            )
        train_config = ConfigRecord(dict(config))
        for key, value in instructions_to_config_record(instructions).items():
            train_config[key] = value
        return train_config

    # ------------------------------------------------- secure aggregation
    def _run_secure_aggregation(
        self, server_round: int, w: Vector, train_config: ConfigRecord, grid: Grid, timeout: float
    ) -> SecureSum:
        """SecAgg+ over this round's sampled, connected clients (see `secure_aggregation`)."""
        secagg_grid = self.server.secagg_grid(self.history[server_round].num_sampled)
        assert secagg_grid is not None  # secure-aggregation is on
        stage_timeout = self.cfg.secagg_timeout or timeout
        workflow = workflow_for(
            secagg_grid,
            self.cfg.secagg_num_shares,
            self.cfg.secagg_reconstruction_threshold,
            stage_timeout,
            len(self._sampled),
        )
        return secure_sum(
            grid, workflow, server_round, w, train_config, sorted(self._sampled), len(set(grid.get_node_ids()))
        )

    def _aggregate_secure(self, server_round: int, outcome: SecureSum) -> tuple[ArrayRecord, MetricRecord]:
        """Close a SecAgg+ round: aggregate its sum, or skip it if the protocol halted."""
        refused = {nid: why for nid, why in outcome.refused.items() if nid in self._sampled}
        for nid, why in sorted(refused.items()):
            logger.warning("Round %d: rejected reply from node %d: node %d refused the round: %s", server_round, nid,
                           nid, why)  # fmt: skip
        for reason in outcome.errors:
            if not any(why in reason for why in refused.values()):
                logger.warning("Round %d: secure aggregation: %s", server_round, reason[:300])
        stats = self.history[server_round]
        stats.rejected_reasons.extend(f"node {nid} refused the round: {why}" for nid, why in sorted(refused.items()))
        rejected = sum(len(self._sampled[nid]) for nid in refused)
        if outcome.total is None:
            w_new = self.server.skip_round(
                server_round, "; ".join(outcome.errors) or "SecAgg+ halted", num_rejected=rejected
            )
        else:
            unknown = [nid for nid in outcome.contributors if nid not in self._sampled]
            if unknown:
                raise RuntimeError(f"SecAgg+ summed nodes that were not sampled: {unknown[:5]}")
            # one client's masked vector can move the sum anywhere in the modular range: a sum no N honest
            # clients produce (except w.p. < p) is not used; the round releases the server's noise only
            limits = self.reply_limits(stats.num_sampled, clients=len(outcome.contributors))
            reason = limits.violation(outcome.total) if limits is not None else None
            if reason is not None:
                reason = f"the secure sum of {len(outcome.contributors)} clients is {reason}"
                stats.rejected_reasons.append(reason)
                w_new = self.server.skip_round(server_round, reason, num_rejected=rejected)
            else:
                w_new = self.server.finish_round_sum(
                    server_round, outcome.total, len(outcome.contributors), num_rejected=rejected
                )
        return to_array_record(w_new), MetricRecord(self.history[server_round].as_metrics())

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
        """Check the replies client by client (`replies.collect_replies()`), then let the server aggregate.

        The server divides by the fixed r, applies momentum and charges the accountant; every sampled
        client that is neither received, failed nor rejected is a dropout. A reply from a node that was not
        sampled (or a second one) is counted in ``num_rejected`` besides, with its reason: it hides no dropout.
        """
        if server_round in self._closed:  # closed by a rule in configure_train
            metrics = MetricRecord(self.history[server_round].as_metrics())
            return to_array_record(self._closed.pop(server_round)), metrics
        w_new = self._finish_from_replies(server_round, replies)
        return to_array_record(w_new), MetricRecord(self.history[server_round].as_metrics())

    def _finish_from_replies(self, server_round: int, replies: Iterable[Message]) -> Vector:
        """Check the round's replies client by client and close the round on the server; ``w_{k+1}``."""
        # the bound of this round's vectors (C, or C_aug with adaptive-clip's count coordinate)
        bound = self.server.sensitivity if self.server.bound.private else float("inf")
        checked = collect_replies(
            server_round,
            replies,
            self._sampled,
            dim=self.server.release_dim,
            diagnostics=self.cfg.diagnostics,
            clip=bound,
            block=self.cfg.clients_per_node > 1,
            limits=self.reply_limits(self.history[server_round].num_sampled),
        )
        results = checked.results
        if self.canaries is not None and len(self._canary_ids):
            assert self._instructions is not None
            canaries = canary_results(self.canaries, self._canary_ids, self.cfg.num_clients, self._instructions)
            results = sorted([*results, *canaries], key=lambda result: result.client_id)
        w_new = self.server.finish_round(
            server_round, results, num_failed=checked.num_failed, num_rejected=checked.num_rejected
        )
        # the server counted the dropouts among the sampled clients; the replies nobody asked for are rejected too
        self.history[server_round].num_rejected += checked.num_unexpected
        self.history[server_round].rejected_reasons.extend(checked.reasons)
        self.history[server_round].failed_reasons.extend(checked.failures)
        return w_new

    def _round_messages(self, w: Vector, train_config: ConfigRecord) -> list[Message]:
        """The round's TRAIN messages for the model ``w_k`` (see `_train_messages()`)."""
        return self._train_messages(to_array_record(w), train_config)


class FlowerRunner:
    """The Flower engine's `ClientRunner`: the round through Flower's Grid.

    Without secure aggregation: one TRAIN message per node with sampled, connected clients, ``send_and_receive``
    with the round timeout, then `DPFedAvg.aggregate_train()` (reply checks, per-client results to
    the server). With it: Flower's SecAgg+ workflow, then the server gets the sum. Records the seconds
    of each phase per round in `timings`.
    """

    PHASES = ("configure_s", "send_and_receive_s", "aggregate_s")

    def __init__(self, strategy: DPFedAvg, grid: Grid, train_config: ConfigRecord, timeout: float) -> None:
        self.strategy, self.grid, self.train_config, self.timeout = strategy, grid, train_config, timeout
        self.timings: dict[int, dict[str, float]] = {}

    def run_round(
        self, server: DPServer, server_round: int, clients: np.ndarray, w: Vector, ins: RoundInstructions
    ) -> Vector:
        strategy = self.strategy
        assert server is strategy.server
        clock = time.perf_counter()
        train_config = strategy._prepare_round(server_round, clients, ins, self.train_config, self.grid)
        if strategy.cfg.secure_aggregation:
            t_configure = time.perf_counter()
            outcome = strategy._run_secure_aggregation(server_round, w, train_config, self.grid, self.timeout)
            t_wait = time.perf_counter()
            w_new = from_array_record(strategy._aggregate_secure(server_round, outcome)[0])
        else:
            messages = strategy._round_messages(w, train_config) if strategy._sampled else []
            t_configure = time.perf_counter()
            replies = list(self.grid.send_and_receive(messages, timeout=self.timeout)) if messages else []
            t_wait = time.perf_counter()
            w_new = strategy._finish_from_replies(server_round, replies)
        self.timings[server_round] = {
            "configure_s": t_configure - clock,
            "send_and_receive_s": t_wait - t_configure,
            "aggregate_s": time.perf_counter() - t_wait,
        }
        return w_new
