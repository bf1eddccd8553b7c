"""Virtual clients (``clients-per-node`` > 1): a simulated SuperNode computes a block of clients.

The trajectory equals the one-client-per-node run's (seeded mode, noise on and off), and the server
still counts every client's reply separately: a node's failure counts each of its sampled clients.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

from dpfedavg.config import ConfigError, RunConfig
from dpfedavg.flower import server_app
from dpfedavg.flower.app_strategy import DPFedAvg
from dpfedavg.flower.client_app import app as client_app
from dpfedavg.flower.client_app import hosted_clients
from dpfedavg.flower.federation import FederationError
from dpfedavg.flower.protocol import (
    ARRAYS,
    CLIENT_IDS,
    CONFIG,
    METRICS,
    UPDATE_KEY,
    block_key,
    instructions_to_config_record,
    to_array_record,
)
from dpfedavg.flower.testing import InProcessGrid, superlink_unavailable_reply

CASES = {
    "quadratic-noise": {"task": "quadratic", "dim": 30, "num-clients": 12, "clients-per-round": 6.0,
                        "server-momentum": 0.5, "epsilon": 3.0, "algorithm": "norm", "clients-per-node": 5},
    "quadratic-no-noise": {"task": "quadratic", "dim": 30, "num-clients": 12, "clients-per-round": 12.0,
                           "epsilon": 0.0, "noise-multiplier": 0.0, "algorithm": "clip", "clip": 5.0,
                           "clients-per-node": 4},
    "digits-noise-diagnostics": {"task": "digits", "num-clients": 30, "clients-per-round": 12.0, "local-lr": 0.05,
                                 "epsilon": 3.0, "algorithm": "clip", "clip": 1.0, "diagnostics": True,
                                 "clients-per-node": 7},
    "quadratic-adaptive-clip": {"task": "quadratic", "dim": 20, "num-clients": 12, "clients-per-round": 6.0,
                                "epsilon": 3.0, "algorithm": "adaptive-clip", "clip": 2.0, "clip-count-stddev": 3.0,
                                "clients-per-node": 5},
    "mlp-digits-minibatch-torch": {"task": "mlp-digits", "num-clients": 20, "clients-per-round": 8.0,
                                   "local-lr": 0.3, "clip": 5.0, "epsilon": 3.0, "local-steps": 3,
                                   "local-batch-size": 4, "torch-dtype": "float64", "clients-per-node": 6},
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_virtual_clients_give_the_one_client_per_node_trajectory(case: str, tmp_path: Path) -> None:
    """The same seed through ceil(n/m) nodes hosting m clients each and through n one-client nodes."""
    values = {"num-rounds": 6, "seed": 3, "cache-dir": str(tmp_path / "cache"), "output-dir": str(tmp_path),
              "save-trajectory": True, **CASES[case]}  # fmt: skip
    virtual = RunConfig.from_run_config({**values, "run-name": "virtual"})
    single = virtual.replace(clients_per_node=1, run_name="single")
    assert virtual.num_nodes == -(-virtual.num_clients // virtual.clients_per_node) < virtual.num_clients
    grid_v = InProcessGrid(client_app, virtual.num_nodes, virtual.to_run_config())
    out_v = server_app.run(grid_v, virtual).directory
    out_s = server_app.run(InProcessGrid(client_app, single.num_clients, single.to_run_config()), single).directory
    assert max(len(m.content["config"][CLIENT_IDS]) for m in grid_v.sent if m.metadata.message_type == "train") > 1
    traj_v, traj_s = np.load(out_v / "trajectory.npy"), np.load(out_s / "trajectory.npy")
    np.testing.assert_allclose(traj_v, traj_s, rtol=1e-6, atol=1e-7)
    assert np.linalg.norm(traj_s[-1] - traj_s[0]) > 1e-3  # the run moved
    csv_v = (out_v / "metrics.csv").read_text().splitlines()
    csv_s = (out_s / "metrics.csv").read_text().splitlines()
    # the per-round counts and statistics agree too (elapsed_s, the last column, differs)
    for row_v, row_s in zip(csv_v[1:], csv_s[1:], strict=True):
        a, b = row_v.split(",")[:-1], row_s.split(",")[:-1]
        np.testing.assert_allclose([float(x or "nan") for x in a], [float(x or "nan") for x in b], rtol=1e-6)


def _virtual_cfg(**overrides) -> RunConfig:
    base = {"num-clients": 20, "clients-per-round": 20.0, "clients-per-node": 5, "num-rounds": 2, "dim": 4,
            "epsilon": 0.0, "noise-multiplier": 0.0, "local-lr": 1.0}  # fmt: skip
    return RunConfig.from_run_config({**base, **overrides})


def test_a_node_failure_counts_each_of_its_sampled_clients() -> None:
    """Node 1 raises (its 5 clients failed), node 2 is gone (5 dropouts), node 3 mangles one client (1 rejected)."""
    cfg = _virtual_cfg()

    def fn(msg: Message, context: Context) -> Message | None:
        pid = int(context.node_config["partition-id"])
        if msg.metadata.message_type == "train" and pid == 1:
            raise RuntimeError("the node crashed")
        if msg.metadata.message_type == "train" and pid == 2:
            return superlink_unavailable_reply(msg)
        reply = client_app(msg, context)
        if msg.metadata.message_type == "train" and pid == 3:
            reply.content[ARRAYS][block_key(UPDATE_KEY, 16)] = to_array_record(np.full(4, np.nan))["w"]
        return reply

    grid = InProcessGrid(fn, cfg.num_nodes, cfg.to_run_config())
    strategy = DPFedAvg(cfg, dim=4)
    strategy.discover_clients(grid)
    assert sorted(strategy.federation.node_of_partition) == [0, 1, 2, 3]
    messages = list(strategy.configure_train(1, to_array_record(np.zeros(4)), _cr(), grid))
    assert len(messages) == 4  # one message per node, each naming its 5 clients
    assert sorted(c for m in messages for c in m.content["config"][CLIENT_IDS]) == list(range(20))
    _, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert (metrics["num_sampled"], metrics["num_received"]) == (20, 9)
    assert (metrics["num_failed"], metrics["num_dropped"], metrics["num_rejected"]) == (5, 5, 1)
    assert "client 16: update contains NaN or Inf" in strategy.history[1].rejected_reasons


def _cr() -> ConfigRecord:
    return ConfigRecord()


def test_a_block_reply_is_checked_client_by_client() -> None:
    """A reply for a client the node was not asked for voids the node's reply; a missing client is rejected alone."""
    cfg = _virtual_cfg()

    def fn(msg: Message, context: Context) -> Message | None:
        pid = int(context.node_config["partition-id"])
        reply = client_app(msg, context)
        if msg.metadata.message_type != "train":
            return reply
        if pid == 0:  # answers for a client of another node
            metrics = dict(reply.content[METRICS])
            metrics[CLIENT_IDS] = [*metrics[CLIENT_IDS][:-1], 19]
            reply.content[METRICS] = MetricRecord(metrics)
        if pid == 1:  # leaves its last client out
            metrics = dict(reply.content[METRICS])
            metrics[CLIENT_IDS] = metrics[CLIENT_IDS][:-1]
            metrics.pop("update-norms", None)
            del reply.content[ARRAYS][block_key(UPDATE_KEY, 9)]
            reply.content[METRICS] = MetricRecord(metrics)
        return reply

    grid = InProcessGrid(fn, cfg.num_nodes, cfg.to_run_config())
    strategy = DPFedAvg(cfg, dim=4)
    strategy.discover_clients(grid)
    messages = list(strategy.configure_train(1, to_array_record(np.zeros(4)), _cr(), grid))
    _, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert (metrics["num_received"], metrics["num_rejected"], metrics["num_failed"]) == (14, 6, 0)
    reasons = " ".join(strategy.history[1].rejected_reasons)
    assert "not asked for: [19]" in reasons and "client 9 is missing" in reasons


def test_a_node_asked_for_clients_it_does_not_host_fails() -> None:
    cfg = _virtual_cfg()
    assert list(hosted_clients(cfg, 3)) == [15, 16, 17, 18, 19]
    grid = InProcessGrid(client_app, cfg.num_nodes, cfg.to_run_config(), seed=1)
    strategy = DPFedAvg(cfg, dim=4)
    strategy.discover_clients(grid)
    (node,) = [nid for nid, ctx in grid.contexts.items() if ctx.node_config["partition-id"] == 0]
    config = instructions_to_config_record(strategy.server.instructions(1, 2))
    config[CLIENT_IDS] = [0, 7]  # client 7 lives on node 1: a server that asks a node for a client it does not host
    content = RecordDict({ARRAYS: to_array_record(np.zeros(4)), CONFIG: config})
    (reply,) = grid.send_and_receive([Message(content, dst_node_id=node, message_type=MessageType.TRAIN)])
    assert reply.has_error() and "hosts clients 0..4" in reply.error.reason


def test_virtual_federation_of_the_wrong_size_names_the_fix() -> None:
    cfg = _virtual_cfg()
    grid = InProcessGrid(client_app, 20, cfg.to_run_config())  # one node per client, but m = 5
    with pytest.raises(
        FederationError, match='needs 4 SuperNodes: start it with --federation-config "num-supernodes=4"'
    ):
        DPFedAvg(cfg, dim=4).discover_clients(grid)


def test_the_strategy_uses_only_flowers_public_strategy_api() -> None:
    """DPFedAvg implements Flower's Strategy hooks; it is not a FedAvg with options its overrides ignore."""
    from flwr.serverapp.strategy import FedAvg, Strategy

    assert issubclass(DPFedAvg, Strategy) and not issubclass(DPFedAvg, FedAvg)
    strategy = DPFedAvg(_virtual_cfg(), dim=4)
    assert strategy.aggregate_evaluate(1, []) is None and strategy.configure_evaluate(1, None, None, None) == []


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"clients-per-node": 0}, "'clients-per-node' = 0: expected an integer >= 1"),
        ({"clients-per-node": 21}, "'clients-per-node' = 21 exceeds 'num-clients' = 20"),
        ({"secure-aggregation": True, "epsilon": 1.0, "noise-multiplier": "auto"},
         "'secure-aggregation' = True with 'clients-per-node' = 5"),
    ],
)  # fmt: skip
def test_bad_virtual_client_settings_are_one_config_error(values: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        _virtual_cfg(**values)
    assert fragment in str(err.value)
