"""A run's epsilon: calibrated, charged the nominal event whoever replies, capped by the budget, said loudly."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Message

from dpfedavg import InProcessGrid, RunConfig, epsilon_for
from dpfedavg.flower import server_app
from dpfedavg.flower.client_app import app as client_app


def _run(tmp_path: Path, name: str, values: dict, client_fn=client_app):
    cfg = RunConfig.from_run_config(
        {"num-clients": 10, "dim": 20, "num-rounds": 5, "output-dir": str(tmp_path), "run-name": name, **values}
    )
    out = server_app.run(InProcessGrid(client_fn, cfg.num_clients, cfg.to_run_config()), cfg).directory
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    return cfg, out, rows


def _dropping(dropped: set[int]):
    def fn(msg: Message, context: Context):
        if msg.metadata.message_type == "train" and int(context.node_config["partition-id"]) in dropped:
            return None
        return client_app(msg, context)

    return fn


@pytest.mark.parametrize("placement", ["client", "client-calibrated", "server"])
def test_dropouts_spend_exactly_the_nominal_epsilon(tmp_path: Path, placement: str) -> None:
    """3 of 10 clients drop out every round: the server tops up their noise, so epsilon is the planned one."""
    values = {"clients-per-round": 10.0, "epsilon": 0.0, "noise-multiplier": 3.0, "noise-placement": placement}
    cfg, out, rows = _run(tmp_path, placement, values, _dropping({1, 4, 7}))
    nominal = epsilon_for(3.0, 1.0, cfg.num_rounds, cfg.delta, "pld")
    spent = float(rows[-1]["epsilon"])
    assert all(int(r["num_dropped"]) == 3 for r in rows[1:])
    assert all(float(r["noise_multiplier"]) == 3.0 for r in rows[1:])
    assert spent == pytest.approx(nominal, rel=1e-9)
    assert json.loads((out / "config.json").read_text())["final"]["epsilon"] == pytest.approx(spent)


def test_poisson_rounds_are_charged_the_same_event_whatever_the_count(tmp_path: Path) -> None:
    values = {"clients-per-round": 5.0, "epsilon": 0.0, "noise-multiplier": 2.0, "num-rounds": 8}
    cfg, _, rows = _run(tmp_path, "poisson", values)
    counts = [int(r["num_received"]) for r in rows[1:]]
    assert len(set(counts)) > 1  # the seed gives rounds of different sizes ...
    for k, row in enumerate(rows[1:], start=1):  # ... and every round costs the same
        assert float(row["epsilon"]) == pytest.approx(epsilon_for(2.0, 0.5, k, cfg.delta, "pld"), rel=1e-9)


def test_quadratic_run_calibrated_to_epsilon_5_ends_at_or_below_5(tmp_path: Path) -> None:
    values = {
        "num-clients": 100,
        "clients-per-round": 100.0,
        "dim": 200,
        "num-rounds": 12,
        "epsilon": 5.0,
        "delta": 1e-6,
    }
    _, out, rows = _run(tmp_path, "eps5", values)
    eps = [float(r["epsilon"]) for r in rows[1:]]
    assert all(b > a for a, b in zip(eps, eps[1:], strict=False))
    assert 4.95 < eps[-1] <= 5.0
    privacy = json.loads((out / "config.json").read_text())["privacy"]
    assert privacy["noise_multiplier_calibrated"] and privacy["accountant"] == "pld" and privacy["delta"] == 1e-6
    assert privacy["sigma"] == pytest.approx(privacy["noise_multiplier"] * 50.0 / 100.0)


def test_budget_stops_cleanly_before_the_exceeding_round(tmp_path: Path) -> None:
    values = {"clients-per-round": 10.0, "epsilon": 0.0, "noise-multiplier": 3.0, "max-epsilon": 4.0, "num-rounds": 20}
    cfg, out, rows = _run(tmp_path, "budget", values)
    eps = [float(r["epsilon"]) for r in rows[1:]]
    completed = len(eps)
    assert 1 <= completed < 20 and eps[-1] <= 4.0
    assert epsilon_for(3.0, 1.0, completed + 1, cfg.delta, "pld") > 4.0  # the next round would have exceeded it
    final = json.loads((out / "config.json").read_text())["final"]
    assert final["stopped_by_budget_before_round"] == completed + 1 and final["rounds_completed"] == completed
    model = np.load(out / "model.npz")
    assert 0 <= int(model["random_iterate_round"]) < completed and model["w_final"].shape == (20,)


def test_budget_is_a_hard_cap_with_dropouts(tmp_path: Path) -> None:
    """Issue 16's case: budget 4, z = 3, 2 of 10 replies in round 6; epsilon never passes the budget."""
    dropped = set(range(2, 10))

    def fn(msg: Message, context: Context):
        if msg.metadata.message_type == "train" and int(context.node_config["partition-id"]) in dropped:
            if int(msg.content["config"]["server-round"]) >= 6:
                return None
        return client_app(msg, context)

    values = {"clients-per-round": 10.0, "epsilon": 0.0, "noise-multiplier": 3.0, "max-epsilon": 4.0,
              "num-rounds": 30}  # fmt: skip
    cfg, out, rows = _run(tmp_path, "budget", values, fn)
    spent = [float(r["epsilon"]) for r in rows[1:]]
    assert max(spent) <= 4.0
    allowed = max(k for k in range(1, 31) if epsilon_for(3.0, 1.0, k, cfg.delta, "pld") <= 4.0)
    assert len(spent) == allowed  # it stops exactly before the first round that would exceed the budget
    assert json.loads((out / "config.json").read_text())["final"]["stopped_by_budget_before_round"] == allowed + 1


def test_no_dp_is_said_loudly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    logger = logging.getLogger("dpfedavg")
    logger.addHandler(caplog.handler)
    try:
        _, _, rows = _run(tmp_path, "nodp", {"clients-per-round": 10.0, "epsilon": 0.0, "noise-multiplier": 0.0})
    finally:
        logger.removeHandler(caplog.handler)
    assert "NO DIFFERENTIAL PRIVACY" in caplog.text
    assert all(math.isinf(float(r["epsilon"])) for r in rows[1:])
