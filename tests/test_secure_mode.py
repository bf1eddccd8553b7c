"""Secure mode: the noise, the sampling and the random iterate come from the OS, and the guarantee says so."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Message, RecordDict

from dpfedavg import InProcessGrid, RunConfig
from dpfedavg.core import SECURE_NOISE_SEED
from dpfedavg.flower.client_app import app as client_app
from dpfedavg.server.dp_server import DPServer


def _seeded_train_message(cfg: RunConfig, node: int, dim: int) -> Message:
    from dpfedavg.flower.protocol import ARRAYS, CONFIG, instructions_to_config_record, to_array_record

    ins = DPServer(cfg, dim).instructions(3, cfg.num_clients)
    assert ins.noise_seed != SECURE_NOISE_SEED  # the server sends a replayable seed
    content = RecordDict({ARRAYS: to_array_record(np.zeros(dim)), CONFIG: instructions_to_config_record(ins)})
    return Message(content, dst_node_id=node, message_type="train")


@pytest.mark.parametrize("node_says", [True, False], ids=["node-secure", "node-default"])
def test_the_client_enforces_secure_noise_from_its_own_node_config(node_says: bool) -> None:
    """A SuperNode started with secure-noise=true ignores the server's noise seed; by default it follows it."""
    from dpfedavg.flower.protocol import ARRAYS, METRICS, UPDATE_KEY

    dim = 2000
    cfg = RunConfig.from_run_config({"num-clients": 4, "clients-per-round": 4.0, "dim": dim, "epsilon": 0.0,
                                     "noise-multiplier": 1.0})  # fmt: skip
    grid = InProcessGrid(client_app, 4, cfg.to_run_config(), node_config={"secure-noise": node_says})
    node = next(iter(grid.contexts))
    replies = [grid.send_and_receive([_seeded_train_message(cfg, node, dim)])[0] for _ in range(2)]
    updates = [r.content[ARRAYS][UPDATE_KEY].numpy() for r in replies]
    metrics = dict(replies[0].content[METRICS])
    if node_says:
        assert np.corrcoef(updates[0] - updates[0].mean(), updates[1] - updates[1].mean())[0, 1] < 0.9
        assert "update-norm" not in metrics and "clipped" not in metrics  # no un-noised statistic leaves the node
    else:
        np.testing.assert_array_equal(updates[0], updates[1])  # seeded: replayable by whoever knows the seed
        assert "update-norm" in metrics


def test_secure_mode_draws_the_sampling_from_the_os_not_the_seed() -> None:
    values = {"num-clients": 200, "clients-per-round": 100.0}
    seeded = [DPServer(RunConfig.from_run_config(values), 10).sample_clients(1) for _ in range(2)]
    secure = [DPServer(RunConfig.from_run_config({**values, "secure-noise": True}), 10).sample_clients(1)
              for _ in range(2)]  # fmt: skip
    np.testing.assert_array_equal(seeded[0], seeded[1])
    assert not np.array_equal(secure[0], secure[1])  # P(equal) = 2^-200


@pytest.mark.parametrize(
    ("values", "level"),
    [({}, "seeded"), ({"secure-noise": True}, "dp"), ({"secure-noise": True, "diagnostics": True}, "none")],
)
def test_the_guarantee_is_labelled_and_secure_mode_withholds_training_data_metrics(
    tmp_path: Path, values: dict, level: str, caplog: pytest.LogCaptureFixture
) -> None:
    from dpfedavg.engines.batched import run_batched

    cfg = RunConfig.from_run_config({"num-clients": 10, "clients-per-round": 5.0, "dim": 20, "num-rounds": 3,
                                     "output-dir": str(tmp_path), "run-name": level, **values})  # fmt: skip
    with caplog.at_level("INFO"):
        out = run_batched(cfg).directory
    described = json.loads((out / "config.json").read_text())
    assert described["privacy"]["guarantee"]["level"] == level
    assert described["final"]["guarantee"] == level
    assert (out / "metrics.png").stat().st_size > 1000  # the headline metric and epsilon over the rounds
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    rows = list(csv.DictReader((out / "metrics.csv").open()))[1:]
    if level == "seeded":
        assert "NONE against anyone who knows seed = 0" in caplog.text
        assert "seeded mode: no protection against anyone who knows the seed" in caplog.text
        assert "suboptimality" in header and rows[0]["mean_update_norm"] != ""
    else:
        assert "suboptimality" not in header  # computed from the clients' data (A_i, w_i*)
        assert all(r["mean_update_norm"] == "" and r["frac_clipped"] == "" for r in rows)
    if level == "none":
        assert "NO privacy guarantee" in caplog.text


def test_secure_mode_draws_the_random_iterate_from_the_os_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """begin_round's two secret draws (S_k and the reservoir step for k~) come from secure_rng, not the seed."""
    import dpfedavg.server.dp_server as dp_server

    calls: list[int] = []

    def counting_secure_rng() -> np.random.Generator:
        calls.append(1)
        return np.random.default_rng(len(calls))

    monkeypatch.setattr(dp_server, "secure_rng", counting_secure_rng)
    server = DPServer(RunConfig.from_run_config({"num-clients": 10, "clients-per-round": 5.0, "secure-noise": True}), 4)
    server.begin_round(1, np.zeros(4))
    assert len(calls) == 2  # sampling and k~
    seeded = DPServer(RunConfig.from_run_config({"num-clients": 10, "clients-per-round": 5.0}), 4)
    seeded.begin_round(1, np.zeros(4))
    assert len(calls) == 2  # the seeded run never asks the OS
