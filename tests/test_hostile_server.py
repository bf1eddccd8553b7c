"""A malicious or compromised server against the real ClientApp: the SuperNode operator's policy (issue 29, part 1).

Every test drives `dpfedavg.flower.client_app.app` through `InProcessGrid`
with the node's ``--node-config`` (``partition-id``, ``num-partitions`` and the policy keys of
`dpfedavg.privacy.policy`). A TRAIN message is built from the honest server's instructions for the round
and then tampered with, as a server that lies would.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Message, RecordDict

from dpfedavg.config import RunConfig
from dpfedavg.flower import server_app
from dpfedavg.flower.client_app import app as client_app
from dpfedavg.flower.protocol import (
    ARRAYS,
    CONFIG,
    DIAGNOSTICS,
    UPDATE_KEY,
    instructions_to_config_record,
    to_array_record,
)
from dpfedavg.flower.testing import InProcessGrid
from dpfedavg.server.dp_server import DPServer
from dpfedavg.server.health import TrainingStopped

DIM = 20
BASE = {
    "task": "quadratic",
    "dim": DIM,
    "num-clients": 8,
    "clients-per-round": 4.0,
    "num-rounds": 5,
    "epsilon": 4.0,
    "delta": 1e-5,
    "algorithm": "clip",
    "clip": 3.0,
    "seed": 1,
    "checkpoint-every": 0,
}
#: An operator's policy that the honest server's rounds (BASE) satisfy.
POLICY = {
    "min-noise-multiplier": 0.5,
    "max-clip": 10.0,
    "allowed-algorithms": "clip,norm,adaptive-clip",
    "allow-diagnostics": False,
}


def _cfg(**overrides) -> RunConfig:
    return RunConfig.from_run_config({**BASE, **overrides})


def _grid(cfg: RunConfig, node_config: dict | None = None) -> InProcessGrid:
    return InProcessGrid(client_app, cfg.num_clients, cfg.to_run_config(), node_config=node_config)


def _send(grid: InProcessGrid, ins, w: np.ndarray | None = None) -> Message:
    """One plain TRAIN message with these instructions to the first node; its reply."""
    node = next(iter(grid.contexts))
    w = np.zeros(DIM) if w is None else w
    content = RecordDict({ARRAYS: to_array_record(w), CONFIG: instructions_to_config_record(ins)})
    (reply,) = grid.send_and_receive([Message(content, dst_node_id=node, message_type="train")])
    return reply


def _honest(cfg: RunConfig, server_round: int = 2, num_sampled: int = 4):
    return DPServer(cfg, DIM).instructions(server_round, num_sampled)


def _refused(reply: Message, *fragments: str) -> str:
    assert reply.has_error(), "the client answered a round it must refuse"
    reason = reply.error.reason or ""
    for fragment in fragments:
        assert fragment in reason, reason
    return reason


# ------------------------------------------------------------ the honest round
def test_honest_round_under_a_policy_is_answered_with_the_clients_own_noise_share() -> None:
    """The client draws N(0, (zC)^2/|S_k|) per coordinate, computed from z, C and |S_k|; d = 4000 draws."""
    cfg = _cfg(dim=4000, diagnostics=True)
    server = DPServer(cfg, 4000)
    ins = server.instructions(2, 4)
    grid = InProcessGrid(client_app, 8, cfg.to_run_config(), node_config={**POLICY, "allow-diagnostics": True})
    node = next(iter(grid.contexts))
    content = RecordDict({ARRAYS: to_array_record(np.zeros(4000)), CONFIG: instructions_to_config_record(ins)})
    (reply,) = grid.send_and_receive([Message(content, dst_node_id=node, message_type="train")])
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    noise = reply.content[ARRAYS][UPDATE_KEY].numpy() - reply.content[DIAGNOSTICS]["clean-update"].numpy()
    own = server.plan.noise_multiplier * cfg.clip / np.sqrt(4)
    assert abs(noise.std() / own - 1) < 0.05  # 4000 draws: the sample std is within ~2.2% (2 sigma)


# ------------------------------------------------------------ lies about noise
def test_server_sending_noise_std_zero_is_refused() -> None:
    """The client computes its own share: a server that asks for none gets a refusal, with or without a policy."""
    cfg = _cfg()
    ins = dataclasses.replace(_honest(cfg), noise_std=0.0)
    _refused(_send(_grid(cfg), ins), "noise-std")
    _refused(_send(_grid(cfg, {**POLICY, "secure-noise": True}), ins), "noise-std")


def test_server_lying_about_z_in_a_calibrated_run_is_refused() -> None:
    """z = z_plan / 10 with a matching noise-std: the client's own check of epsilon(z, q, K, delta) <= target fails."""
    cfg = _cfg()
    honest = _honest(cfg)
    z = DPServer(cfg, DIM).plan.noise_multiplier
    low = dataclasses.replace(honest, noise_std=honest.noise_std / 10, **_z_field(z / 10))
    _refused(_send(_grid(cfg), low), "epsilon")


def test_noise_multiplier_below_the_policy_is_refused() -> None:
    cfg = _cfg(epsilon=0.0, **{"noise-multiplier": 0.6})
    _refused(_send(_grid(cfg, {**POLICY, "min-noise-multiplier": 1.0}), _honest(cfg)), "min-noise-multiplier")
    assert not _send(_grid(cfg, {**POLICY, "min-noise-multiplier": 0.5}), _honest(cfg)).has_error()


def test_inflated_cohort_size_is_refused_by_the_update_noise_floor() -> None:
    """|S_k| sets the client's share (zC/sqrt(|S_k|)): a server claiming all 8 clients to shrink it is refused."""
    cfg = _cfg(epsilon=0.0, **{"noise-multiplier": 2.0})
    policy = {**POLICY, "min-update-noise-multiplier": 0.8}  # z / sqrt(4) = 1.0 passes, z / sqrt(8) = 0.71 does not
    honest = _honest(cfg, num_sampled=4)
    assert not _send(_grid(cfg, policy), honest).has_error()
    inflated = _honest(cfg, num_sampled=8)
    _refused(_send(_grid(cfg, policy), inflated), "min-update-noise-multiplier")


def test_max_epsilon_of_the_policy_is_checked_by_the_client() -> None:
    cfg = _cfg()  # calibrated for epsilon = 4
    _refused(_send(_grid(cfg, {**POLICY, "max-epsilon": 2.0}), _honest(cfg)), "max-epsilon")
    at_run_delta = {**POLICY, "max-epsilon-released": 4.5, "max-epsilon-delta": 1e-5}  # without it: read at 1e-6
    assert not _send(_grid(cfg, at_run_delta), _honest(cfg)).has_error()


# ------------------------------------------------------- lies about the bound
@pytest.mark.parametrize("policy", [None, POLICY], ids=["run-config", "policy"])
def test_server_sending_clip_1e9_is_refused(policy: dict | None) -> None:
    cfg = _cfg()
    ins = dataclasses.replace(_honest(cfg), clip=1e9)
    _refused(_send(_grid(cfg, policy), ins), "max-clip" if policy else "clip")


@pytest.mark.parametrize("policy", [None, POLICY], ids=["run-config", "policy"])
def test_server_sending_algorithm_none_is_refused(policy: dict | None) -> None:
    cfg = _cfg()
    ins = dataclasses.replace(_honest(cfg), algorithm="none", noise_std=0.0)
    _refused(_send(_grid(cfg, policy), ins), "allowed-algorithms" if policy else "algorithm")


def test_policy_refuses_an_algorithm_the_run_config_names() -> None:
    cfg = _cfg(algorithm="norm")
    _refused(_send(_grid(cfg, {**POLICY, "allowed-algorithms": "clip"}), _honest(cfg)), "allowed-algorithms")


# ------------------------------------------------------- diagnostics and SecAgg
@pytest.mark.parametrize("policy", [None, POLICY], ids=["run-config", "policy"])
def test_server_asking_for_diagnostics_is_refused(policy: dict | None) -> None:
    """The clean g would leave the node beside g + zeta although the run config says diagnostics = false."""
    cfg = _cfg()
    ins = dataclasses.replace(_honest(cfg), diagnostics=True)
    reply = _send(_grid(cfg, policy), ins)
    _refused(reply, "allow-diagnostics" if policy else "diagnostics")


def test_secure_noise_node_never_sends_diagnostics_even_if_the_run_config_asks() -> None:
    cfg = _cfg(diagnostics=True)
    _refused(_send(_grid(cfg, {"secure-noise": True}), _honest(cfg)), "allow-diagnostics")


def test_plain_train_message_in_a_secure_aggregation_run_is_refused() -> None:
    """A run configured with secure-aggregation = true never answers a TRAIN message outside SecAgg+."""
    cfg = _cfg(**{"secure-aggregation": True, "epsilon": 0.0, "noise-multiplier": 1.0})
    ins = _honest(cfg)
    _refused(_send(_grid(cfg), ins), "secure-aggregation")


def test_policy_requiring_secure_aggregation_refuses_a_plain_run() -> None:
    cfg = _cfg()
    _refused(_send(_grid(cfg, {**POLICY, "require-secure-aggregation": True}), _honest(cfg)), "secure-aggregation")


# ------------------------------------------------------------- bad policies
@pytest.mark.parametrize(
    ("node_config", "fragments"),
    [
        ({"min-noise-multiplier": "lots"}, ["min-noise-multiplier", "'lots'", "a number >= 0"]),
        ({"max-clip": -1.0}, ["max-clip", "-1.0", "> 0"]),
        ({"allowed-algorithms": "clip,fedprox"}, ["allowed-algorithms", "fedprox", "'norm'"]),
        ({"allow-diagnostics": "perhaps"}, ["allow-diagnostics", "'perhaps'", "true or false"]),
        ({"min-noise-multiplyer": 1.0}, ["min-noise-multiplyer", "did you mean 'min-noise-multiplier'"]),
    ],
)
def test_bad_policy_is_one_clear_refusal_naming_the_key(node_config: dict, fragments: list[str]) -> None:
    cfg = _cfg()
    _refused(_send(_grid(cfg, node_config), _honest(cfg)), *fragments)


# ------------------------------------------------------------ the server's side
def test_policy_refusals_are_counted_as_rejections_by_the_server(tmp_path: Path, dpfedavg_log) -> None:
    """Every node's policy caps C below the run's: each sampled client refuses, the server counts 8 rejections, and
    the run stops after round 1 (fail fast: it would train on noise alone) naming the rule and the fix."""
    cfg = _cfg(**{"output-dir": str(tmp_path), "run-name": "refused", "clients-per-round": 8.0})
    grid = InProcessGrid(client_app, 8, cfg.to_run_config(), node_config={"max-clip": 1.0})
    with pytest.raises(TrainingStopped, match=r"max-clip.*privacy policy \(their --node-config\)") as stop:
        server_app.run(grid, cfg)
    assert stop.value.server_round == 1
    out = tmp_path / "refused"
    rows = list(csv.DictReader((out / "metrics.csv").open()))[1:]
    assert [(int(r["num_sampled"]), int(r["num_rejected"]), int(r["num_received"])) for r in rows] == [(8, 8, 0)]
    warnings = " ".join(r.getMessage() for r in dpfedavg_log if r.levelno == logging.WARNING)
    assert "max-clip" in warnings and "refused" in warnings
    model = np.load(out / "model.npz")["w_final"]
    assert np.all(np.isfinite(model))


def _z_field(z: float) -> dict:
    """The instructions' noise multiplier, where the message schema has one (the client checks it)."""
    fields = {f.name for f in dataclasses.fields(DPServer(_cfg(), DIM).instructions(1, 4))}
    return {"noise_multiplier": z} if "noise_multiplier" in fields else {}


def test_policy_refusal_inside_secure_aggregation_leaves_the_client_out_of_the_sum(
    tmp_path: Path, dpfedavg_log
) -> None:
    """Node 0's policy caps C below the run's: it refuses in SecAgg+'s masked-vector stage; the other 7 are summed."""
    cfg = _cfg(**{"secure-aggregation": True, "epsilon": 0.0, "noise-multiplier": 1.0, "clients-per-round": 8.0,
                  "num-rounds": 2, "output-dir": str(tmp_path), "run-name": "secagg"})  # fmt: skip
    grid = _grid(cfg)
    first = next(iter(grid.contexts))
    grid.contexts[first].node_config["max-clip"] = 1.0
    out = server_app.run(grid, cfg).directory
    rows = list(csv.DictReader((out / "metrics.csv").open()))[1:]
    assert [(int(r["num_received"]), int(r["num_rejected"])) for r in rows] == [(7, 1), (7, 1)]
    server_side = [r.getMessage() for r in dpfedavg_log if r.name.startswith("dpfedavg.flower.strategy")]
    assert sum("refused the round" in m and "max-clip" in m for m in server_side) == 2


def test_trust_table_names_tests_that_exist() -> None:
    """Every test named by the privacy page's trust table (honest or malicious server, policy or not) exists."""
    import re

    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "privacy" / "index.md").read_text()
    table = page.split("## What each party learns with an honest or a malicious server", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"`(?:tests/(test_\w+)\.py::)?(test_\w+)(?:\[[\w-]+\])?`", table)
    assert len(named) >= 15
    for module, name in named:
        source = (root / "tests" / f"{module or 'test_hostile_server'}.py").read_text()
        assert f"def {name}(" in source, f"{module}::{name}"


def test_every_policy_key_is_documented_on_the_deployment_page() -> None:
    from dpfedavg.privacy.policy import POLICY_KEYS

    page = (Path(__file__).resolve().parents[1] / "docs" / "how-to" / "deploy.md").read_text()
    for key in POLICY_KEYS:
        assert f"| `{key}` |" in page, key
