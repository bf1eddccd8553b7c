"""DPFedAvg in *your* Flower app: your ServerApp, your model's arrays, your ClientApp's train wrapped in ``dp_mod``.

`DPFedAvg` is built from keywords, ``DPFedAvg(algorithm="norm", clip=1.0, epsilon=5.0, clients_per_round=10, ...)``,
or by ``DPFedAvg.from_run_config(context.run_config)``. It takes the place of Flower's
``FedAvg`` in a ServerApp that calls ``strategy.start(grid=..., initial_arrays=ArrayRecord(model.state_dict()),
num_rounds=..., evaluate_fn=...)``:

* **your arrays**: any ``ArrayRecord`` travels to the clients as it is; the server works on the flat vector
  of its floating arrays (`ArrayLayout`), and ``Result.arrays`` has the
  same keys, shapes and dtypes, so ``model.load_state_dict(result.arrays.to_torch_state_dict())`` works.
  Integer arrays (e.g. ``num_batches_tracked``) keep their initial values;
* **rounds from start()**: ``z`` is calibrated for ``(epsilon, delta)`` over ``num_rounds`` there, because
  the number of rounds is known only then (a ``num_rounds`` given to the constructor too must agree);
* **one client per SuperNode**: Poisson sampling (Alg. 1 line 3, ``q = r/n``) over the sorted node ids
  connected at the start (or ``num_clients`` of them, waited for), no partition query;
* **the server math is dpfedavg's**: `DPServer` through the one round loop
  `run_rounds()` (budget stop, sampling, top-up of missing noise, ``a_k = sum/r``,
  the accountant), with the clients' pseudo-gradients ``u = w_k - w_new`` (`dpfedavg.flower.mod.dp_mod()`)
  and a server step ``beta = 1`` by default, so that without noise a round with every client is FedAvg's;
* **Flower-style logs** per round (sampled, received, rejected, clipped fraction, epsilon spent) and a loud
  warning when the noise is seeded;
* **fail fast** (`ReplyHealth`): a round whose every sampled reply is unusable
  (for instance a ClientApp without ``dp_mod``) stops the run with one ERROR naming the commonest reason,
  its fix and the epsilon the rounds that ran spent (`TrainingStopped`).

Configuration coexists with the app's own keys: ``from_run_config`` reads only the keys of the
``[tool.flwr.app.config.dpfedavg]`` table (Flower flattens it to ``dpfedavg.<key>``); a misspelled key
there is an error naming the closest valid key, the app's other keys are left alone.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from dpfedavg.app_config import AppSettings
from dpfedavg.config import RunConfig
from dpfedavg.core.types import Vector
from dpfedavg.errors import ConfigError
from dpfedavg.flower.arrays import ArrayLayout
from dpfedavg.core.client_metrics import average_client_metrics
from dpfedavg.flower.federation import FederationError
from dpfedavg.flower.mod import ARRAY_KEYS, CLIENT_ID, public_parameters
from dpfedavg.flower.protocol import (
    METRICS,
    NUM_EXAMPLES,
    PARTITION_ID,
    UPDATE_NORM,
    instructions_to_config_record,
    parse_train_reply,
)
from dpfedavg.flower.runtime import route_logs_through_flower
from dpfedavg.flower.strategy import RunStrategy, log_summary, privacy_plan_lines, reply_bound
from dpfedavg.io.metrics import RoundStats
from dpfedavg.privacy.setup import PrivacySetup
from dpfedavg.server.dp_server import DPServer
from dpfedavg.server.health import ReplyHealth
from dpfedavg.server.round import RoundRecord

__all__ = ["DPFedAvg", "UserArrays"]

logger = logging.getLogger(__name__)

class DPFedAvg(RunStrategy):
    """DP-FedAvg (``algorithm="clip"``, Alg. 1) or DP-NormFedAvg (``"norm"``, Alg. 2) as a Flower strategy.

    One class, two ways to build it:

    * in **your** ServerApp, keywords only: ``DPFedAvg(algorithm="norm", clip=1.0, epsilon=5.0, delta=1e-5,
      clients_per_round=10, ...)`` or ``DPFedAvg.from_run_config(context.run_config)``: the strategy works on
      your model's ``ArrayRecord`` with your ClientApp's train wrapped in `dpfedavg.dp_mod()` (see the module
      docstring; what travels is `UserArrays`);
    * for dpfedavg's own apps: ``DPFedAvg(cfg, dim)`` (or ``server=``), `RunStrategy` on the flat model ``w``.

    Parameters
    ----------
    cfg, dim, setup, server, canaries:
        dpfedavg's own apps: see `RunStrategy`.
    **settings:
        Your app: dpfedavg's keys in snake_case (``algorithm``, ``clip``, ``epsilon``, ``delta``,
        ``clients_per_round`` or ``fraction_train``, ``num_clients``, ``noise_multiplier``, ``accountant``,
        ``max_epsilon``, ``noise_placement``, ``seed``, ``secure_noise``, ``server_lr``, ``server_momentum``,
        ``secure_aggregation``, ...: `dpfedavg.app_config.APP_KEYS`) and ``max_failed_fraction``. ``clip`` and the sampling
        rate are required; ``server_lr`` defaults to 1.
    """

    #: Without ``num_clients``: seconds the number of connected SuperNodes must stay the same before round 1.
    settle_seconds: float = 1.0
    #: Your app's settings; ``None`` for dpfedavg's own apps (built from ``cfg``).
    settings: AppSettings | None = None

    def __init__(
        self,
        cfg: RunConfig | None = None,
        dim: int | None = None,
        *,
        setup: PrivacySetup | None = None,
        server: DPServer | None = None,
        sleep: Callable[[float], None] = time.sleep,
        canaries: np.ndarray | None = None,
        app_settings: AppSettings | None = None,
        **settings: Any,
    ) -> None:
        if cfg is not None or server is not None:
            if settings or app_settings is not None:
                raise TypeError(
                    f"DPFedAvg(cfg, ...) is dpfedavg's own apps' strategy: the settings {sorted(settings)} are for "
                    "your app's DPFedAvg(**settings), which takes no cfg"
                )
            own = {"setup": setup, "server": server, "sleep": sleep, "canaries": canaries}
            super().__init__(cfg, dim, **own)  # type: ignore[arg-type]
            return
        if dim is not None or setup is not None or canaries is not None:
            raise TypeError("DPFedAvg(**settings) for your app takes keywords only (dim, setup and canaries need cfg)")
        if app_settings is None:
            options = {k.replace("_", "-"): v for k, v in settings.items()}
            app_settings = AppSettings(options, lambda key: key.replace("-", "_"))
        elif settings:
            raise TypeError("DPFedAvg(app_settings=...) takes no other settings")
        self._configure(app_settings, sleep)

    def _configure(self, settings: AppSettings, sleep: Callable[[float], None]) -> None:
        self.settings = settings
        self.health = ReplyHealth(max_failed_fraction=self.settings.max_failed_fraction)
        self.stops_as = "DPFedAvg"
        self.failed = None
        self._sleep = sleep
        # filled by start(): the run's config, server and model layout
        self.cfg = None  # type: ignore[assignment]
        self.server = None  # type: ignore[assignment]
        self.dim = 0
        self.layout: ArrayLayout | None = None
        #: Sorted node ids of the population: client id i is SuperNode ``population[i]``.
        self.population: list[int] = []
        self.stopped_before_round: int | None = None
        self.timings: dict[int, dict[str, float]] = {}
        self._closed: dict[int, RoundRecord] = {}
        self._hook_runner = None
        #: What travels in a round's messages: the user's arrays and one client id per node (set by start()).
        self.edge: UserArrays | None = None  # type: ignore[assignment]
        #: Round -> why clients' own metrics were left out of its average (``dpfedavg.core.client_metrics``).
        self.client_metrics_rejected: dict[int, list[str]] = {}
        self._num_rounds = 0

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any], prefix: str = "dpfedavg", **overrides: Any) -> DPFedAvg:
        """The strategy from the ``<prefix>.<key>`` entries of ``context.run_config`` (and keyword ``overrides``).

        In ``pyproject.toml`` these are the keys of the ``[tool.flwr.app.config.dpfedavg]`` table, beside the
        app's own keys in ``[tool.flwr.app.config]``; ``flwr run --run-config "dpfedavg.epsilon=3.0"`` overrides
        one. Only keys under the prefix are read: the app's own keys are left alone. A key under the prefix
        that is not dpfedavg's, or a table whose name is a near miss of the prefix, is an error naming the
        closest valid key; a top-level key named like one of dpfedavg's is logged (it is not read).
        """
        return cls(app_settings=AppSettings.from_run_config(run_config, prefix, overrides))

    # ------------------------------------------------------------------ set-up
    def _wait_for_population(self, grid: Grid, cfg_timeout: float) -> list[int]:
        """The sorted node ids sampling runs over: ``num_clients`` of them (waited for), or those connected now.

        Without ``num_clients`` the count must be stable for `settle_seconds` (Flower's simulation registers
        its nodes, all at once, just after the ServerApp starts); in a deployment, give ``num_clients``.
        """
        wanted = self.settings.num_clients
        deadline = time.monotonic() + cfg_timeout
        last, stable_since, last_log = -1, time.monotonic(), 0.0
        while True:
            nodes = sorted(int(n) for n in grid.get_node_ids())
            now = time.monotonic()
            if wanted is not None and len(nodes) > wanted:
                raise FederationError(
                    f"{len(nodes)} SuperNodes are connected but num_clients = {wanted}: each SuperNode is one "
                    "client, so num_clients must be the number of SuperNodes (or leave it out)"
                )
            if wanted is not None and len(nodes) == wanted:
                return nodes
            if len(nodes) != last:
                last, stable_since = len(nodes), now
            if wanted is None and nodes and now - stable_since >= self.settle_seconds:
                return nodes
            if now > deadline:
                raise FederationError(
                    f"only {len(nodes)} of {wanted if wanted is not None else 'at least 1'} SuperNodes connected "
                    f"within node-wait-timeout = {cfg_timeout:g} s"
                )
            if now - last_log > 5.0:
                logger.info("Waiting for SuperNodes: %d connected%s", len(nodes), f" of {wanted}" if wanted else "")
                last_log = now
            self._sleep(0.2)

    def _setup(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int | None) -> None:
        """Fix the population and the rounds, calibrate ``z`` (the privacy plan) and build the server."""
        rounds = self.settings.rounds(num_rounds)
        try:
            self.layout = ArrayLayout.of(initial_arrays)
        except ValueError as err:
            raise ConfigError(f"invalid initial_arrays: {err}") from None
        probe = self.settings.config(self.settings.num_clients or self.settings.placeholder_clients(), rounds)
        self.population = self._wait_for_population(grid, probe.node_wait_timeout)
        cfg = self.settings.config(len(self.population), rounds)
        self.cfg, self._num_rounds = cfg, rounds
        setup = PrivacySetup.resolve(cfg)
        self.server = DPServer(cfg, self.layout.dim, setup=setup, represent=self.layout.round_trip)
        self.dim = self.layout.dim
        self.edge = UserArrays(
            self.server, cfg, self.layout, initial_arrays, self.population, rounds, self.client_metrics_rejected
        )

    # ------------------------------------------------------------------ info
    def summary(self) -> None:
        """Log the set-up as Flower's strategies do (called by `start()`)."""
        if self.settings is None:  # dpfedavg's own apps
            return super().summary()
        cfg, plan, layout = self.cfg, self.plan, self.layout
        assert cfg is not None and layout is not None
        lines = [f"Number of rounds: {self._num_rounds}", f"ArrayRecord: {layout.describe()}",
                 f"Algorithm: {self.server.bound.title}",
                 f"Poisson sampling over n={cfg.num_clients} SuperNodes (one client each): q={cfg.sampling_rate:.4g}, "
                 f"expected cohort r={cfg.clients_per_round:g}; aggregation divides by r",
                 f"Update: u = w_k - w_new in the weights' units (dp_mod); server step beta={cfg.server_lr:g}, "
                 f"momentum mu={cfg.server_momentum:g}"]  # fmt: skip
        lines += privacy_plan_lines(cfg, plan, self.server.sigma) if plan.dp else []
        if cfg.secure_aggregation:
            lines.append("Secure aggregation: SecAgg+ (ClientApp mods=[checked_secaggplus_mod, dp_mod]); the server "
                         "sees the sum")  # fmt: skip
        log_summary([*lines, "Fail fast: a round whose every sampled reply is unusable, or more than "
                     f"{self.health.max_failed_fraction:g} of them over 5 rounds",
                     "Clients' own metrics pass through: the DP guarantee covers the model, not them"])  # fmt: skip
        if not plan.dp:
            logger.warning("algorithm 'none': FedAvg without DP (no clipping, no noise, no epsilon)")
        if plan.dp and not cfg.secure_noise:
            logger.warning(
                "!!! SEEDED NOISE (seed=%d): the clients' noise and the sampling are reproducible from the seed, so "
                "whoever knows it can subtract the noise: this run is NOT private against them. Research and "
                "tests only; pass secure_noise=True (or dpfedavg.secure-noise = true) for real privacy. !!!",
                cfg.seed,
            )

    # ------------------------------------------------------------------ the run
    def start(  # type: ignore[override]
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int | None = None,
        timeout: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        **resume: Any,
    ) -> Result:
        """Run ``num_rounds`` rounds of DP-FedAvg / DP-NormFedAvg on ``initial_arrays``; Flower's ``Result``.

        Calibrates ``z`` for the run's ``(epsilon, delta)`` over ``num_rounds`` (Flower's default 3 when neither
        start nor the constructor gives it), then runs `dpfedavg.server.loop.run_rounds()`.
        ``evaluate_fn(server_round, arrays)`` is called on the user's arrays before round 1 (round 0) and after
        every round. ``train_config`` travels to the clients with the round's instructions. There is no
        client-side evaluation (``evaluate_config`` is not used): per-client evaluation metrics are not private.

        Raises
        ------
        dpfedavg.errors.ConfigError
            Settings that do not hold for this ``n`` and ``K`` (for instance an epsilon too small to calibrate),
            initial arrays without a floating array, a ``train_config`` key that is one of the round's.
        dpfedavg.flower.federation.FederationError
            Not the ``num_clients`` SuperNodes within ``node-wait-timeout``.
        dpfedavg.server.health.TrainingStopped
            The clients' replies were unusable (see `ReplyHealth`); its ``result``
            holds what the run had, its message the reason, the fix and the epsilon spent.
        """
        if self.settings is None:  # dpfedavg's own apps (first_round, on_round_end: `RunStrategy.run()`)
            if num_rounds is not None and num_rounds != self.cfg.num_rounds:
                raise ValueError(f"num_rounds={num_rounds} differs from the config's num-rounds={self.cfg.num_rounds}")
            return self.run(grid, initial_arrays, timeout=timeout, train_config=train_config, evaluate_fn=evaluate_fn,
                            **resume)  # fmt: skip
        if resume:
            raise TypeError(f"start() got {sorted(resume)}: those are for DPFedAvg(cfg, ...) of dpfedavg's own apps")
        route_logs_through_flower()
        clock = time.perf_counter()
        train_config = ConfigRecord() if train_config is None else train_config
        self._setup(grid, initial_arrays, num_rounds)
        round_keys = {
            *instructions_to_config_record(self.server.instructions(1, 1)),
            *public_parameters(self.cfg),
            CLIENT_ID,
        }
        round_keys -= {"server-round"}
        reserved = sorted(set(train_config) & round_keys)  # "server-round" means the same as Flower's FedAvg's
        if reserved:
            raise ConfigError(f"train_config keys {reserved} are set by DPFedAvg for each round; rename them")
        if evaluate_config:
            logger.warning("evaluate_config is not used: DPFedAvg evaluates on the server only (evaluate_fn)")
        result = self.run(grid, initial_arrays, timeout=timeout, train_config=train_config, evaluate_fn=evaluate_fn,
                          on_round_end=lambda closed: self._log_round(closed.stats))  # fmt: skip
        if self.failed is not None:
            logger.error("%s", self.failed)
            self.failed.result = result
            raise self.failed
        logger.info("")
        logger.info("Strategy execution finished in %.2fs", time.perf_counter() - clock)
        logger.info("%s", self.privacy_statement())
        return result

    def privacy_statement(self) -> str:
        """One line: the guarantee of the rounds that ran (user-level ``(epsilon, delta)``), or that there is none."""
        rounds = len(self.history)
        if not self.plan.dp:
            return f"No differential privacy: {rounds} rounds of FedAvg without noise"
        return (
            f"{self.server.bound.title}: ({self.epsilon:.4g}, {self.plan.delta:g})-DP for each client's whole data "
            f"(user level) after {rounds} rounds; z={self.plan.noise_multiplier:.5g}, q={self.cfg.sampling_rate:.4g}, "
            f"{self.plan.accountant} accountant"
        )

    def _log_round(self, stats: RoundStats) -> None:
        if self.server.adaptive is not None:
            clipped = f"C_k={stats.clip:.4g}, released unclipped fraction b_k={stats.frac_unclipped:.3g}"
        elif not self.server.bound.private:
            clipped = "no bound"
        elif math.isnan(stats.frac_clipped):
            clipped = "clipped: unknown (the clients send no norms)"
        else:
            clipped = f"updates with norm above C: {stats.frac_clipped:.0%}"
        epsilon = f"epsilon spent: {stats.epsilon:.4g} (delta={self.plan.delta:g})" if self.plan.dp else "no DP"
        logger.info(
            "aggregate_train: received %d of %d sampled (%d rejected, %d failed, %d dropped); %s; %s",
            stats.num_received,
            stats.num_sampled,
            stats.num_rejected,
            stats.num_failed,
            stats.num_dropped,
            clipped,
            epsilon,
        )

    # ------------------------------------------------------------------ Flower's hooks, round by round
    def before_rounds(self, grid: Grid) -> None:
        """Your app: rounds run after `start()` set the run up (`start()` runs every round; the hooks work after it
        too). dpfedavg's own apps: the nodes discovered."""
        if self.settings is None:
            return super().before_rounds(grid)
        self._require_setup()

    def available(self, grid: Grid) -> list[int] | None:
        """Your app: every SuperNode of the population is a candidate (its mechanisms do not select among them)."""
        return super().available(grid) if self.settings is None else None

    def _require_setup(self) -> None:
        if self.server is None:
            raise RuntimeError(
                "DPFedAvg runs its rounds in start(grid, initial_arrays, num_rounds=...), which calibrates the noise "
                "for num_rounds first"
            )


class UserArrays:
    """What a user's app puts in a round's messages (`FlowerRunner`'s edge; dpfedavg's own apps: `FlatModel`).

    The user's ``ArrayRecord`` (`ArrayLayout`: its floating arrays are ``w``), one client per SuperNode (client id
    ``i`` is ``population[i]``, named by ``client-id`` in its message), the run's public parameters (``dp_mod``
    computes its own noise std from them), SecAgg+ over every array, and the clients' own metrics kept per round
    (`client_metrics`; averaged by ``num-examples`` as FedAvg does).
    """

    #: A SecAgg+ round that halted on the clients' errors counts them as failed, so that fail fast sees them.
    secagg_errors_fail = True

    def __init__(
        self,
        server: DPServer,
        cfg: RunConfig,
        layout: ArrayLayout,
        initial: ArrayRecord,
        population: list[int],
        num_rounds: int,
        rejected_metrics: dict[int, list[str]],
    ) -> None:
        self.server, self.cfg, self.layout, self.initial = server, cfg, layout, initial
        self.population, self.num_rounds = population, num_rounds
        self.newcomers: set[int] = set()
        #: Round -> the clients' own metrics, averaged (taken by the strategy's round record).
        self.client_metrics: dict[int, dict[str, float]] = {}
        self.rejected_metrics = rejected_metrics

    def nodes(self, server_round: int, clients: np.ndarray, grid: Grid) -> dict[int, list[int]]:
        """Map the sampled client ids to their SuperNodes (connected ones; the others are dropouts)."""
        logger.info("")
        logger.info("[ROUND %d/%d]", server_round, self.num_rounds)
        online = set(int(n) for n in grid.get_node_ids())
        sampled, offline = {}, []
        for client in sorted(int(c) for c in clients):
            node = self.population[client]
            if node in online:
                sampled[node] = [client]
            else:
                offline.append(client)
        newcomers = online - set(self.population) - self.newcomers
        if newcomers:
            self.newcomers |= newcomers
            logger.warning(
                "%d SuperNodes connected after the start (%s): they are not part of the sampled population "
                "(n=%d), so they are never sampled",
                len(newcomers),
                sorted(newcomers)[:5],
                len(self.population),
            )
        logger.info(
            "configure_train: Sampled %d of %d clients (Poisson, q=%.4g)",
            len(clients),
            len(self.population),
            self.cfg.sampling_rate,
        )
        if offline:
            logger.warning("Round %d: %d sampled clients are not connected (dropouts)", server_round, len(offline))
        return sampled

    def run_keys(self) -> dict[str, object]:
        """The run's public parameters: dp_mod computes its own noise std from these."""
        return dict(public_parameters(self.cfg))

    def flatten(self, arrays: ArrayRecord) -> Vector:
        return self.layout.flatten(arrays)

    def arrays(self, w: Vector) -> ArrayRecord:
        return self.layout.unflatten(w, self.initial)

    def round_metrics(self, closed: RoundRecord) -> dict[str, float]:
        """The round's ``train_metrics_clientapp``: the clients' own metrics and the round's statistics (but
        ``eta``: dpfedavg's clients' step size, not your app's)."""
        stats = {k: v for k, v in closed.stats.as_metrics().items() if k != "eta"}
        return {**self.client_metrics.pop(closed.round, {}), **stats}

    def node_keys(self, clients: list[int]) -> dict[str, object]:
        return {CLIENT_ID: clients[0]}

    def secagg_payload(self, w: Vector, config: ConfigRecord) -> tuple[object, ConfigRecord]:
        """SecAgg+ with the user's arrays (all of them, in the layout's order, keys in the config) as ``FitIns``."""
        arrays = self.arrays(w)
        config = ConfigRecord({**config, ARRAY_KEYS: json.dumps(list(self.layout.keys))})
        return [arrays[key].numpy() for key in self.layout.keys], config

    def observe(self, server_round: int, replies: list[Message], sampled: dict[int, list[int]]) -> None:
        """The clients' own metrics of the usable replies, averaged weighted by ``num-examples`` (as FedAvg does).

        A client whose ``num-examples`` or a metric is not plausible is left out, with the reason logged and kept in
        ``rejected_metrics`` (the rules: ``dpfedavg.core.client_metrics``).
        """
        clients: list[tuple[str, dict[str, Any]]] = []
        for msg in replies:
            src = msg.metadata.src_node_id
            if msg.has_error() or src not in sampled or not self._usable(msg):
                continue
            clients.append((f"node {src} (client {sampled[src][0]})", dict(msg.content[METRICS])))
        out, rejected = average_client_metrics(clients, NUM_EXAMPLES, skip=frozenset({UPDATE_NORM, PARTITION_ID}))
        for reason in rejected:
            logger.warning("Round %d: clients' metrics: %s", server_round, reason)
        if rejected:
            self.rejected_metrics[server_round] = rejected
        self.client_metrics[server_round] = out

    def _usable(self, msg: Message) -> bool:
        try:
            parse_train_reply(
                msg.content, self.server.release_dim, diagnostics=self.cfg.diagnostics, clip=reply_bound(self.server)
            )
        except ValueError:
            return False
        return True

