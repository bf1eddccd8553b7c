"""Strategy-level tests, no Ray: DPFedAvg driven through an in-process Grid."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import Context, Message, MetricRecord, RecordDict
from reference import run_reference_for

from dpfedavg.config import RunConfig
from dpfedavg.core import Stream, make_rng, poisson_sample, round_noise_seed
from dpfedavg.flower import server_app
from dpfedavg.flower.app_strategy import DPFedAvg
from dpfedavg.flower.client_app import app as client_app
from dpfedavg.flower.federation import FederationError
from dpfedavg.flower.protocol import (
    ARRAYS,
    CONFIG,
    METRICS,
    UPDATE_KEY,
    instructions_from_config_record,
    instructions_to_config_record,
    to_array_record,
)
from dpfedavg.flower.testing import InProcessGrid, superlink_unavailable_reply
from dpfedavg.privacy.setup import PrivacySetup

DIM = 6


def small_cfg(**overrides) -> RunConfig:
    base = {
        "num-clients": 10,
        "clients-per-round": 5.0,
        "num-rounds": 4,
        "dim": DIM,
        "epsilon": 0.0,
        "noise-multiplier": 0.0,
    }
    base.update(overrides)
    return RunConfig.from_run_config(base)


def constant_client(value_of: Callable[[int], float], drop: set[int] = frozenset()) -> Callable:
    """A ClientApp stand-in replying g + zeta = value_of(partition) * ones, or nothing if dropped."""

    def fn(msg: Message, context: Context) -> Message | None:
        pid = int(context.node_config["partition-id"])
        if msg.metadata.message_type == "query":
            return client_app(msg, context)
        if pid in drop:
            return None
        content = RecordDict(
            {
                ARRAYS: to_array_record(np.full(DIM, value_of(pid)), UPDATE_KEY),
                METRICS: MetricRecord({"num-examples": 1, "update-norm": float(pid), "clipped": 0}),
            }
        )
        return Message(content, reply_to=msg)

    return fn


def one_round(strategy: DPFedAvg, grid: InProcessGrid, w: np.ndarray, server_round: int = 1):
    messages = list(strategy.configure_train(server_round, to_array_record(w), _cfg_record(), grid))
    replies = grid.send_and_receive(messages)
    arrays, metrics = strategy.aggregate_train(server_round, replies)
    return messages, arrays["w"].numpy(), metrics


def _cfg_record():
    from flwr.app import ConfigRecord

    return ConfigRecord()


# ------------------------------------------------------------- sampling/config
def test_configure_train_samples_poisson_by_client_and_sends_round_config() -> None:
    cfg = small_cfg(**{"noise-multiplier": 2.0, "clip": 3.0, "lr-decay": 0.5, "local-lr": 0.1})
    grid = InProcessGrid(constant_client(lambda pid: 1.0), 10, cfg.to_run_config())
    strategy = DPFedAvg(cfg, dim=DIM)
    strategy.discover_clients(grid)
    for server_round in (1, 2, 3):
        messages = list(strategy.configure_train(server_round, to_array_record(np.zeros(DIM)), _cfg_record(), grid))
        expected = poisson_sample(10, 0.5, make_rng(cfg.seed, Stream.SAMPLING, server_round - 1))
        got = sorted(strategy.client_of_node[m.metadata.dst_node_id] for m in messages)
        assert got == expected.tolist()
        ins = instructions_from_config_record(messages[0].content[CONFIG])
        assert ins.noise_seed == round_noise_seed(cfg.seed, server_round - 1)
        assert ins.local_lr == pytest.approx(0.1 * 0.5 ** (server_round - 1))  # eta_k
        assert ins.noise_std == pytest.approx(2.0 * 3.0 / np.sqrt(len(expected)))  # z C / sqrt(|S_k|) (default)
        assert (ins.local_steps, ins.algorithm, ins.clip) == (20, "norm", 3.0)
        strategy.aggregate_train(server_round, grid.send_and_receive(messages))


def test_sampling_does_not_depend_on_node_ids() -> None:
    """Same seed, different node ids / order -> the same clients are sampled."""
    cfg = small_cfg()
    picks = []
    for grid_seed in (0, 1):
        grid = InProcessGrid(constant_client(lambda pid: 1.0), 10, cfg.to_run_config(), seed=grid_seed)
        strategy = DPFedAvg(cfg, dim=DIM)
        strategy.discover_clients(grid)
        messages = strategy.configure_train(1, to_array_record(np.zeros(DIM)), _cfg_record(), grid)
        picks.append(sorted(strategy.client_of_node[m.metadata.dst_node_id] for m in messages))
    assert picks[0] == picks[1]


# ---------------------------------------------------------------- aggregation
def test_fixed_denominator_r_with_dropouts() -> None:
    cfg = small_cfg(**{"clients-per-round": 10.0, "local-lr": 0.1})  # q = 1: everyone sampled
    dropped = {2, 5, 7}
    grid = InProcessGrid(constant_client(lambda pid: pid + 1.0, drop=dropped), 10, cfg.to_run_config())
    strategy = DPFedAvg(cfg, dim=DIM)
    strategy.discover_clients(grid)
    w0 = np.ones(DIM)
    _, w1, metrics = one_round(strategy, grid, w0)
    received = [pid + 1.0 for pid in range(10) if pid not in dropped]
    np.testing.assert_allclose(w1, w0 - 0.1 * sum(received) / 10.0)  # / r, not / 7
    assert metrics["num_sampled"] == 10 and metrics["num_received"] == 7 and metrics["num_dropped"] == 3


def test_empty_round_keeps_going(caplog: pytest.LogCaptureFixture) -> None:
    cfg = small_cfg(**{"clients-per-round": 0.01, "num-rounds": 3})  # q = 0.001
    grid = InProcessGrid(constant_client(lambda pid: 1.0), 10, cfg.to_run_config())
    strategy = DPFedAvg(cfg, dim=DIM)
    strategy.discover_clients(grid)
    assert strategy.server.sample_clients(1).size == 0
    with caplog.at_level(logging.WARNING, logger="dpfedavg"):
        logging.getLogger("dpfedavg").propagate = True
        try:
            messages, w1, metrics = one_round(strategy, grid, np.ones(DIM))
        finally:
            logging.getLogger("dpfedavg").propagate = False
    assert messages == []
    np.testing.assert_array_equal(w1, np.ones(DIM))
    assert metrics["num_sampled"] == 0
    assert "selected no client" in caplog.text


def test_server_momentum_recursion_through_strategy() -> None:
    mu, beta = 0.8, 0.05
    cfg = small_cfg(**{"clients-per-round": 10.0, "server-momentum": mu, "server-lr": beta})
    grid = InProcessGrid(constant_client(lambda pid: float(pid)), 10, cfg.to_run_config())
    strategy = DPFedAvg(cfg, dim=DIM)
    strategy.discover_clients(grid)
    a = sum(range(10)) / 10.0  # every round a_k = 4.5 * ones
    w = np.zeros(DIM)
    for k in range(1, 5):
        _, w, _ = one_round(strategy, grid, w, k)
    # m_k = a (1 + mu + ... + mu^(k-1)); w_4 = -beta * sum_k m_k
    expected = -beta * sum(a * sum(mu**j for j in range(k)) for k in range(1, 5))
    np.testing.assert_allclose(w, np.full(DIM, expected), rtol=1e-12)


# ----------------------------------------------------------------- discovery
def test_wrong_federation_size_fails_fast_with_the_fix() -> None:
    cfg = small_cfg()
    grid = InProcessGrid(client_app, 2, cfg.to_run_config())  # e.g. flwr's default of 2 supernodes
    with pytest.raises(FederationError, match="num-supernodes=10"):
        DPFedAvg(cfg, dim=DIM).discover_clients(grid, timeout=5)


def test_duplicate_partition_ids_rejected() -> None:
    cfg = small_cfg()
    grid = InProcessGrid(client_app, 10, cfg.to_run_config(), partition_ids=[0, 1, 2, 3, 4, 5, 6, 7, 8, 8])
    with pytest.raises(FederationError, match="partition-id=8 is reported by two nodes"):
        DPFedAvg(cfg, dim=DIM).discover_clients(grid, timeout=5)


def test_waits_for_late_nodes_and_times_out_clearly() -> None:
    cfg = small_cfg()

    class LateGrid(InProcessGrid):
        polls = 0

        def get_node_ids(self):
            LateGrid.polls += 1
            ids = list(self.contexts)
            return ids[: min(len(ids), 3 * LateGrid.polls)]

    strategy = DPFedAvg(cfg, dim=DIM, sleep=lambda s: None)
    mapping = strategy.discover_clients(LateGrid(client_app, 10, cfg.to_run_config()), timeout=5)
    assert sorted(mapping) == list(range(10)) and LateGrid.polls >= 4

    class StuckGrid(InProcessGrid):
        def get_node_ids(self):
            return list(self.contexts)[:4]

    with pytest.raises(FederationError, match="only 4 of 10 SuperNodes registered"):
        DPFedAvg(cfg, dim=DIM, sleep=lambda s: None).discover_clients(
            StuckGrid(client_app, 10, cfg.to_run_config()), timeout=0.05
        )


# ---------------------------------------------------------- bad client replies
def test_failed_and_malformed_replies_are_counted_not_fatal() -> None:
    cfg = small_cfg(**{"clients-per-round": 10.0, "local-lr": 1.0})

    def fn(msg: Message, context: Context) -> Message | None:
        pid = int(context.node_config["partition-id"])
        if msg.metadata.message_type == "query":
            return client_app(msg, context)
        if pid == 0:
            raise RuntimeError("boom")
        vec = np.ones(DIM)
        if pid == 1:
            vec = np.ones(DIM + 1)  # wrong shape
        if pid == 2:
            vec = np.full(DIM, np.nan)
        if pid == 3:
            return Message(RecordDict({METRICS: MetricRecord({"x": 1})}), reply_to=msg)  # no arrays
        content = RecordDict({ARRAYS: to_array_record(vec, UPDATE_KEY), METRICS: MetricRecord({"update-norm": 1.0})})
        return Message(content, reply_to=msg)

    grid = InProcessGrid(fn, 10, cfg.to_run_config())
    strategy = DPFedAvg(cfg, dim=DIM)
    strategy.discover_clients(grid)
    _, w1, metrics = one_round(strategy, grid, np.zeros(DIM))
    assert metrics["num_failed"] == 1 and metrics["num_rejected"] == 3 and metrics["num_received"] == 6
    assert metrics["num_dropped"] == 0
    np.testing.assert_allclose(w1, -np.full(DIM, 6 / 10))
    reasons = " ".join(strategy.history[1].rejected_reasons)
    assert "shape" in reasons and "NaN" in reasons and "lacks" in reasons


# ------------------------------------------------------------------ client app
def _train_message(cfg: RunConfig, w: np.ndarray, algorithm: str) -> Message:
    strategy = DPFedAvg(cfg.replace(algorithm=algorithm), dim=DIM)
    config = instructions_to_config_record(strategy.server.instructions(3, 5))
    record = RecordDict({ARRAYS: to_array_record(w), CONFIG: config})
    return Message(record, dst_node_id=5, message_type="train")


def test_clip_and_norm_add_the_same_noise_vectors() -> None:
    """Paper §4.4: in each run both algorithms see the exact same noise vectors."""
    cfg = small_cfg(**{"noise-multiplier": 1.0, "clip": 0.5})
    ctx = Context(
        run_id=1,
        node_id=5,
        node_config={"partition-id": 4, "num-partitions": 10},
        state=RecordDict(),
        run_config=cfg.to_run_config(),
    )
    w = np.random.default_rng(0).standard_normal(DIM)
    noise = {}
    for algorithm in ("clip", "norm"):
        cfg_d = cfg.replace(diagnostics=True)
        ctx.run_config = cfg_d.replace(algorithm=algorithm).to_run_config()  # the client checks the run config
        reply = client_app(_train_message(cfg_d, w, algorithm), ctx)
        noisy = reply.content[ARRAYS][UPDATE_KEY].numpy()
        clean = reply.content["diagnostics"]["clean-update"].numpy()
        assert np.linalg.norm(clean) <= 0.5 + 1e-12
        noise[algorithm] = noisy - clean
        assert reply.content[METRICS]["partition-id"] == 4
    np.testing.assert_allclose(noise["clip"], noise["norm"], rtol=1e-12)
    assert np.linalg.norm(noise["clip"]) > 0


def test_client_without_partition_id_fails_clearly() -> None:
    cfg = small_cfg()
    ctx = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config=cfg.to_run_config())
    with pytest.raises(RuntimeError, match="partition-id"):
        client_app(_train_message(cfg, np.zeros(DIM), "norm"), ctx)


# ------------------------------------------------------- whole run vs reference
CASES = {
    "norm-noise-full": {"algorithm": "norm", "noise-multiplier": 3.0, "clients-per-round": 10.0},
    "norm-no-noise": {"algorithm": "norm", "noise-multiplier": 0.0, "clients-per-round": 10.0},
    "norm-calibrated-eps2": {"algorithm": "norm", "epsilon": 2.0, "clients-per-round": 10.0},
    "clip-client-calibrated": {
        "algorithm": "clip",
        "noise-multiplier": 2.0,
        "noise-placement": "client-calibrated",
        "clients-per-round": 5.0,
    },
    "norm-server-noise": {
        "algorithm": "norm",
        "noise-multiplier": 2.0,
        "noise-placement": "server",
        "clients-per-round": 5.0,
    },
    "clip-noise-poisson-momentum": {
        "algorithm": "clip",
        "noise-multiplier": 1.5,
        "clients-per-round": 4.0,
        "server-momentum": 0.8,
        "lr-decay": 0.9,
        "clip": 20.0,
    },
    "none-poisson-const-beta": {"algorithm": "none", "clients-per-round": 6.0, "server-lr": 0.01, "init": "I2"},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_in_process_run_matches_numpy_reference(case: str, tmp_path) -> None:
    values = {"num-clients": 12, "num-rounds": 6, "dim": 30, "seed": 3, "epsilon": 0.0, **CASES[case]}
    cfg = RunConfig.from_run_config({"output-dir": str(tmp_path), "run-name": case, **values})
    setup = PrivacySetup.resolve(cfg)
    out = server_app.run(InProcessGrid(client_app, 12, cfg.to_run_config()), cfg, setup=setup).directory
    ref = run_reference_for(cfg, setup.plan.noise_multiplier)
    model = np.load(out / "model.npz")
    np.testing.assert_allclose(model["w_final"], ref.w_final, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(model["w_random_iterate"], ref.w_random_iterate, rtol=1e-6, atol=1e-9)
    assert int(model["random_iterate_round"]) == ref.random_iterate_round
    assert np.linalg.norm(ref.w_final - ref.trajectory[0]) > 1e-3  # the run moved


def test_snr_diagnostic_is_signal_over_noise_norm(tmp_path) -> None:
    cfg = RunConfig.from_run_config(
        {
            "num-clients": 8,
            "clients-per-round": 8.0,
            "num-rounds": 1,
            "dim": 20,
            "noise-multiplier": 0.5,
            "epsilon": 0.0,
            "diagnostics": True,
            "output-dir": str(tmp_path),
            "run-name": "snr",
        }
    )
    grid = InProcessGrid(client_app, 8, cfg.to_run_config())
    strategy = DPFedAvg(cfg, dim=20)
    strategy.discover_clients(grid)
    w0 = np.ones(20)
    messages = list(strategy.configure_train(1, to_array_record(w0), _cfg_record(), grid))
    replies = list(grid.send_and_receive(messages))
    _, metrics = strategy.aggregate_train(1, replies)
    noisy = sum(r.content[ARRAYS][UPDATE_KEY].numpy() for r in replies) / 8
    clean = sum(r.content["diagnostics"]["clean-update"].numpy() for r in replies) / 8
    assert metrics["snr"] == pytest.approx(np.linalg.norm(clean) / np.linalg.norm(noisy - clean), rel=1e-9)


# ------------------------------------------------------------------ server app
def test_server_app_bad_config_logs_one_error_line(tmp_path) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("dpfedavg")
    logger.addHandler(handler)
    try:
        ctx = Context(
            run_id=1,
            node_id=1,
            node_config={},
            state=RecordDict(),
            run_config={"algorithm": "median", "clip": -1.0, "output-dir": str(tmp_path)},
        )
        server_app.main(grid=None, context=ctx)  # type: ignore[arg-type]
    finally:
        logger.removeHandler(handler)
    errors = [r for r in records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None
    assert "'algorithm' = 'median'" in errors[0].getMessage() and "'clip' = -1.0" in errors[0].getMessage()
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written


def test_results_files_and_columns(tmp_path) -> None:
    import csv
    import json

    cfg = small_cfg(**{"output-dir": str(tmp_path), "run-name": "cols", "noise-multiplier": 1.0})
    out = server_app.run(InProcessGrid(client_app, 10, cfg.to_run_config()), cfg).directory
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert [int(r["round"]) for r in rows] == list(range(cfg.num_rounds + 1))
    for col in ("round", "num_sampled", "suboptimality", "snr", "dist_to_opt", "frac_clipped", "epsilon"):
        assert col in rows[0]
    config = json.loads((out / "config.json").read_text())
    assert config["run_config"]["clip"] == cfg.clip and config["derived"]["q"] == 0.5
    assert config["privacy"]["sigma"] == pytest.approx(1.0 * 50.0 / 5.0)
    assert config["privacy"]["noise_multiplier"] == 1.0 and config["privacy"]["accountant"] == "pld"
    assert config["final"]["rounds_completed"] == cfg.num_rounds
    assert config["final"]["epsilon"] == pytest.approx(float(rows[-1]["epsilon"]))
    assert "flwr" in config["versions"]
    model = np.load(out / "model.npz")
    assert model["w_final"].shape == (DIM,) and model["w_random_iterate"].shape == (DIM,)


def test_in_process_grid_push_and_pull_deliver_each_reply_once() -> None:
    cfg = small_cfg()
    grid = InProcessGrid(constant_client(lambda pid: float(pid), drop={3}), 10, cfg.to_run_config())
    strategy = DPFedAvg(cfg.replace(clients_per_round=10.0), dim=DIM)
    strategy.discover_clients(grid)
    messages = list(strategy.configure_train(1, to_array_record(np.zeros(DIM)), _cfg_record(), grid))
    ids = list(grid.push_messages(messages))
    assert len(set(ids)) == 10
    replies = list(grid.pull_messages(ids))
    assert len(replies) == 9 and {r.metadata.reply_to_message_id for r in replies} <= set(ids)
    assert list(grid.pull_messages(ids)) == []


# ------------------------------------------------------- deployment behaviour
def _replying(make_content) -> Callable:
    """A client whose train reply content is ``make_content(pid, msg)`` (None: no reply)."""

    def fn(msg: Message, context: Context) -> Message | None:
        pid = int(context.node_config["partition-id"])
        if msg.metadata.message_type == "query":
            return client_app(msg, context)
        content = make_content(pid, msg)
        return None if content is None else Message(content, reply_to=msg)

    return fn


def _good(pid: int, value: float = 1.0, clean_norm: float | None = None) -> RecordDict:
    from flwr.app import Array, ArrayRecord

    from dpfedavg.flower.protocol import CLEAN_UPDATE_KEY, DIAGNOSTICS

    content = RecordDict({ARRAYS: to_array_record(np.full(DIM, value), UPDATE_KEY),
                          METRICS: MetricRecord({"update-norm": 1.0})})  # fmt: skip
    if clean_norm is not None:
        clean = np.zeros(DIM)
        clean[0] = clean_norm
        content[DIAGNOSTICS] = ArrayRecord({CLEAN_UPDATE_KEY: Array(clean)})
    return content


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("two-arrays", "2 arrays"),
        ("int-dtype", "dtype int64"),
        ("inf", "NaN or Inf"),
        ("norm-above-C", "above C = 5"),
        ("no-metrics", "lacks 'metrics'"),
    ],
)
def test_each_kind_of_malformed_reply_is_rejected_with_its_reason(kind: str, reason: str) -> None:
    from flwr.app import Array, ArrayRecord

    cfg = small_cfg(**{"clients-per-round": 10.0, "clip": 5.0, "diagnostics": True, "local-lr": 1.0})

    def make(pid: int, msg: Message) -> RecordDict:
        content = _good(pid, clean_norm=4.0)
        if pid != 7:
            return content
        if kind == "two-arrays":
            content[ARRAYS] = ArrayRecord({UPDATE_KEY: Array(np.ones(DIM)), "extra": Array(np.ones(3))})
        elif kind == "int-dtype":
            content[ARRAYS] = ArrayRecord({UPDATE_KEY: Array(np.ones(DIM, dtype=np.int64))})
        elif kind == "inf":
            content[ARRAYS] = to_array_record(np.full(DIM, np.inf), UPDATE_KEY)
        elif kind == "norm-above-C":
            content = _good(pid, clean_norm=5.5)
        elif kind == "no-metrics":
            del content[METRICS]
        return content

    grid = InProcessGrid(_replying(make), 10, cfg.to_run_config())
    strategy = DPFedAvg(cfg, dim=DIM)
    strategy.discover_clients(grid)
    _, w1, metrics = one_round(strategy, grid, np.zeros(DIM))
    assert (metrics["num_rejected"], metrics["num_received"], metrics["num_failed"]) == (1, 9, 0)
    assert reason in " ".join(strategy.history[1].rejected_reasons)
    np.testing.assert_allclose(w1, -np.full(DIM, 9 / 10))  # the 9 good replies over the fixed r = 10


def test_a_second_reply_from_the_same_node_is_rejected() -> None:
    cfg = small_cfg(**{"clients-per-round": 10.0})
    grid = InProcessGrid(_replying(lambda pid, msg: _good(pid)), 10, cfg.to_run_config(), shuffle_replies=False)
    strategy = DPFedAvg(cfg, dim=DIM)
    strategy.discover_clients(grid)
    messages = list(strategy.configure_train(1, to_array_record(np.zeros(DIM)), _cfg_record(), grid))
    replies = list(grid.send_and_receive(messages))
    _, metrics = strategy.aggregate_train(1, [*replies, replies[0]])  # a replayed reply
    assert metrics["num_received"] == 10 and metrics["num_rejected"] == 1
    assert "second reply" in strategy.history[1].rejected_reasons[0]


def test_unavailable_and_disconnected_nodes_are_dropouts_not_failures(caplog) -> None:

    cfg = small_cfg(**{"clients-per-round": 10.0, "local-lr": 1.0})

    def fn(msg: Message, context: Context) -> Message | None:
        pid = int(context.node_config["partition-id"])
        if msg.metadata.message_type == "query":
            return client_app(msg, context)
        if pid == 4:  # what the SuperLink answers for a node that went offline
            return superlink_unavailable_reply(msg)
        if pid == 5:
            raise RuntimeError("a real failure")
        return Message(_good(pid), reply_to=msg)

    grid = InProcessGrid(fn, 10, cfg.to_run_config())
    strategy = DPFedAvg(cfg, dim=DIM)
    strategy.discover_clients(grid)
    gone = strategy.node_of_client[6]
    context_of_gone = grid.contexts.pop(gone)  # client 6's SuperNode disconnected after discovery
    with caplog.at_level(logging.WARNING):
        messages, w1, metrics = one_round(strategy, grid, np.zeros(DIM))
    assert gone not in {m.metadata.dst_node_id for m in messages}  # nothing sent to a disconnected node
    assert (metrics["num_received"], metrics["num_failed"], metrics["num_dropped"]) == (7, 1, 2)
    np.testing.assert_allclose(w1, -np.full(DIM, 7 / 10))
    assert "not connected (dropouts): [6]" in caplog.text
    # the client comes back as a new node: it is mapped again and sampled again
    grid.contexts[12345] = context_of_gone
    messages, _, metrics = one_round(strategy, grid, w1, server_round=2)
    assert strategy.node_of_client[6] == 12345 and 12345 in {m.metadata.dst_node_id for m in messages}
    assert metrics["num_received"] == 8


def test_a_clientapp_that_does_not_speak_dpfedavg_stops_the_run_in_round_one(tmp_path) -> None:
    """A user's unmodified train function (its own arrays and metrics, no 'update'): one ERROR with the fix,
    round 1 accounted, no training on noise for the rest of the run."""
    from flwr.app import ArrayRecord

    def users_own_train(msg: Message, context: Context) -> Message | None:
        if msg.metadata.message_type != "train":
            return client_app(msg, context)  # the partition query
        content = RecordDict({"arrays": ArrayRecord([np.zeros(3)]), "metrics": MetricRecord({"num-examples": 5})})
        return Message(content, reply_to=msg)

    cfg = RunConfig(num_clients=6, clients_per_round=6.0, num_rounds=10, dim=10, output_dir=str(tmp_path),
                    run_name="foreign")  # fmt: skip
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("dpfedavg")
    logger.addHandler(handler)
    try:
        ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=cfg.to_run_config())
        server_app.main(grid=InProcessGrid(users_own_train, 6, cfg.to_run_config()), context=ctx)
    finally:
        logger.removeHandler(handler)
    errors = [r.getMessage() for r in records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert "round 1: every sampled client's reply was unusable" in errors[0]
    assert "lacks the array 'update'" in errors[0] and "wrapped with dp_mod" in errors[0]
    assert "Rounds 1-1 ran and are accounted: epsilon = " in errors[0]
    final = json.loads((tmp_path / "foreign" / "config.json").read_text())["final"]
    assert final["rounds_completed"] == 1 and final["stopped_because"] == errors[0]
