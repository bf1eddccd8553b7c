"""One guard on the node, one Gaussian noise addition (issue 45, items 4 and 5).

Both of the node's ClientApps (the project's and ``dp_mod`` in a user's app) must decide every message through
`dpfedavg.privacy.node_guard.guard()` and refuse only through `dpfedavg.flower.guard.refusal()`: a spy on each counts
the calls per message, and a reading of the sources finds no other refusal, train reply or zero update. The one
Gaussian addition, `dpfedavg.core.noise.add_gaussian()`, is checked against ``g + (z * s)`` formed here from
the generator's own draws, for each way the engines call it (a generator, a block's rows, a sweep's run axis,
a torch tensor).
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, RecordDict

from dpfedavg.core.noise import GaussianLaw, add_gaussian
from dpfedavg.flower import client_app as client_app_module
from dpfedavg.flower import guard as guard_module
from dpfedavg.flower import mod as mod_module
from dpfedavg.flower.protocol import ARRAYS, REFUSED

PACKAGE = Path(__file__).resolve().parents[1] / "dpfedavg"


# ------------------------------------------------------------------ one Gaussian addition
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("std", [0.0, 0.7])
def test_the_generator_path_adds_the_generators_draws_times_std(dtype, std) -> None:
    g = np.linspace(-1.0, 1.0, 33).astype(dtype)
    expected = g + (np.random.default_rng(5).standard_normal(33) * std if std else np.zeros(33)).astype(dtype)
    got = GaussianLaw().add(g, 1.0, std, np.random.default_rng(5))
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, expected)
    with pytest.raises(ValueError, match="noise std must be >= 0"):
        add_gaussian(g, -1.0, rng=np.random.default_rng(5))


def test_rows_runs_and_a_tensor_add_the_same_numbers_as_one_client_alone() -> None:
    """A block's rows, a sweep's run axis (one std per run) and a torch block: each row is what one client adds."""
    rng = np.random.default_rng(0)
    g = rng.standard_normal((3, 10))
    seeds = [11, 12, 13]
    normals = np.stack([np.random.default_rng(s).standard_normal(10) for s in seeds])
    alone = np.stack([add_gaussian(g[b], 0.3, rng=np.random.default_rng(s)) for b, s in enumerate(seeds)])
    np.testing.assert_array_equal(add_gaussian(g, 0.3, normals.copy(), scale_in_place=True), alone)
    stds = np.array([0.0, 0.3, 1.5])  # runs x one client: run r is g_r + z * std_r
    runs = add_gaussian(g, stds[:, None], normals[1])
    np.testing.assert_array_equal(runs[1], g[1] + normals[1] * 0.3)
    np.testing.assert_array_equal(runs[2], g[2] + normals[1] * 1.5)
    assert add_gaussian(g, 0.3, None) is g  # no client noise this round: nothing is added
    torch = pytest.importorskip("torch")
    on_torch = add_gaussian(torch.from_numpy(g), 0.3, normals.copy())
    np.testing.assert_array_equal(on_torch.numpy(), alone)


# ------------------------------------------------------------------ one guard
def _spy(monkeypatch) -> tuple[list[str], list[str]]:
    decided: list[str] = []
    refused: list[str] = []
    guard, refusal = guard_module.guard, guard_module.refusal

    def spy_guard(app, message_type, *args, **kwargs):
        decided.append(message_type)
        return guard(app, message_type, *args, **kwargs)

    def spy_refusal(msg, reason, app):
        refused.append(msg.metadata.message_type)
        return refusal(msg, reason, app)

    for module in (client_app_module, mod_module):
        monkeypatch.setattr(module, "guard", spy_guard)
        monkeypatch.setattr(module, "refusal", spy_refusal)
    return decided, refused


@pytest.mark.parametrize("policy", [None, {"max-clip": 100.0}])
@pytest.mark.parametrize("message_type", ["train", "train.finetune", "evaluate", "query", "query.x"])
def test_every_message_to_either_app_is_decided_by_the_one_guard(monkeypatch, message_type, policy) -> None:
    from test_node_enforcement import _send, _user_train_message, user_app

    from dpfedavg.flower.client_app import app as own_app

    decided, refused = _spy(monkeypatch)
    content = _user_train_message() if message_type.startswith("train") else RecordDict(
        {ARRAYS: ArrayRecord({"b": Array(np.arange(10.0))})}
    )
    for app, registered in ((user_app("app"), True), (own_app, message_type in ("train", "query"))):
        decided.clear()
        refused.clear()
        reply = _send(app, message_type, content, policy)
        assert (message_type in refused) == (reply.has_error() and reply.error.code == REFUSED)
        if not registered:  # no handler: Flower answers with its own error before any of the app's code runs
            assert reply.has_error() and reply.error.code != REFUSED and not decided
            continue
        assert decided and set(decided) == {message_type}


def _calls(path: Path) -> set[str]:
    """The names of the functions and classes ``path`` calls (``f(...)`` and ``x.f(...)``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.id if isinstance(func, ast.Name) else getattr(func, "attr", ""))
    return names


def test_refusals_train_replies_and_zero_updates_are_built_in_one_place_each() -> None:
    """The refusal Error, the reply records and the zero update are written once in the client-side code."""
    client_side = ["flower/client_app.py", "flower/mod.py", "flower/guard.py", "flower/protocol.py"]
    builders = {"Error": [], "MetricRecord": [], "fitres_to_recorddict": [], "zero_updates": [], "zeros_like": []}
    for name in client_side:
        calls = _calls(PACKAGE / name)
        for builder in builders:
            if builder in calls:
                builders[builder].append(name)
    assert builders["fitres_to_recorddict"] == ["flower/protocol.py"]  # the SecAgg+ masked vector
    assert set(builders["MetricRecord"]) <= {"flower/protocol.py", "flower/client_app.py"}  # + the partition query
    assert set(builders["Error"]) <= {"flower/guard.py", "flower/mod.py"}  # refusal(); dp_mod's own error replies
    assert "REFUSED" not in (PACKAGE / "flower/mod.py").read_text()
    assert "REFUSED" not in (PACKAGE / "flower/client_app.py").read_text()
    assert builders["zeros_like"] == []  # a diverged update becomes zero in core/local.py zero_updates only
    assert set(builders["zero_updates"]) == {"flower/client_app.py", "flower/mod.py"}


# ------------------------------------------------------------------ secure-noise set on one side only
def test_a_node_that_draws_its_own_noise_warns_once_per_run_when_the_server_runs_seeded(caplog, tmp_path) -> None:
    """Issue 48 item 4: ``secure-noise`` cannot be implied by the nodes' policies (the server cannot read them, and
    its sampling and its own noise come from its seed); a node whose policy draws its own noise says so, once a run,
    when the server's instructions carry a seed."""
    import logging

    from dpfedavg.config import RunConfig
    from dpfedavg.flower.protocol import instructions_to_config_record
    from dpfedavg.privacy.node_guard import CLIENT_APP, Route, TrainRequest, guard
    from dpfedavg.server.dp_server import DPServer

    seeded = RunConfig.from_run_config({"task": "quadratic", "dim": 4, "num-clients": 4, "clients-per-round": 2.0,
                                        "num-rounds": 3, "epsilon": 0.0, "noise-multiplier": 1.0, "clip": 1.0})
    secure = RunConfig.from_run_config({**seeded.to_run_config(), "secure-noise": True})
    policy = {"secure-noise": True, "privacy-ledger": str(tmp_path / "ledger.json")}
    for cfg, node_config, run_id, warned in ((seeded, policy, 9001, True), (seeded, {}, 9002, False),
                                             (secure, policy, 9003, False)):
        caplog.clear()
        for k in (1, 2):
            config = instructions_to_config_record(DPServer(cfg, 4).instructions(k, 2))
            with caplog.at_level(logging.WARNING):
                verdict = guard(CLIENT_APP, "train", node_config, train=TrainRequest(config, run_id, cfg))
            assert verdict.route is Route.TRAIN
        lines = [r.getMessage() for r in caplog.records if "secure-noise = true in the run config" in r.getMessage()]
        assert len(lines) == (1 if warned else 0), lines
        if warned:
            assert f"run {run_id}" in lines[0] and "its policy: secure-noise" in lines[0]
