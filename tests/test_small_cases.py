"""The small cases of issue 36 item 8 (the server and config side) and issue 39 item 2: one clear error or a rule each.

* ``run-name = "ok\\n"``: a folder name with a newline is refused (one folder name, the characters named);
* ``task = "os:system"``: a callable that is not a task factory is one ConfigError, not a TypeError;
* ``noise-multiplier = -0.0``: refused (0, spelled 0, is the explicit opt-out);
* ``epsilon = 0`` with ``noise-multiplier = "auto"``: refused, saying how to get privacy or opt out (issue 39.2);
* a read-only output directory: one error line from the ServerApp, before the calibration;
* a reply from a node that was not sampled: rejected with its reason, and the sampled node that did not answer
  still counts as a dropout;
* one client's ``num-examples = 1e12`` / NaN, or a NaN metric: that client's metrics are left out of the round's
  average (with the reason), which stays the honest clients' average.
"""

from __future__ import annotations

import copy
import csv
import logging
import math
import os
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

import dpfedavg
from dpfedavg import DPFedAvg, dp_mod
from dpfedavg.config import MAX_RUN_NAME, ConfigError, RunConfig
from dpfedavg.flower import server_app
from dpfedavg.flower.app_strategy import AppDPFedAvg
from dpfedavg.flower.client_app import app as client_app
from dpfedavg.flower.testing import InProcessGrid
from dpfedavg.privacy.setup import PrivacySetup
from dpfedavg.server.run import plan_for
from dpfedavg.tasks import build_task, resolve_task

QUADRATIC = {"task": "quadratic", "dim": 20, "num-clients": 6, "clients-per-round": 3.0, "num-rounds": 2,
             "epsilon": 4.0, "delta": 1e-5, "clip": 1.0, "seed": 5, "checkpoint-every": 0}  # fmt: skip


def _main(run_config: dict, num_nodes: int = 2) -> None:
    """The ServerApp's main, as Flower calls it, on an in-process grid."""
    grid = InProcessGrid(client_app, num_nodes, {})
    server_app.main(grid, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=run_config))


def _one_error_line(log) -> str:
    errors = [r for r in log if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None, [r.getMessage() for r in errors]
    message = errors[0].getMessage()
    assert "\n" not in message
    return message


# ------------------------------------------------------------------ run-name
@pytest.mark.parametrize(
    "name", ["ok\n", "ok\r", "ok\n\n", "a/b", "..", ".hidden", " ok", "ok ", "x" * (MAX_RUN_NAME + 1)]
)
def test_run_name_with_a_newline_or_not_one_folder_name_is_refused(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig(run_name=name)
    message = str(info.value)
    assert f"'run-name' = {name!r}" in message and "letters, digits, '.', '_', '-'" in message, message
    assert f"1 to {MAX_RUN_NAME}" in message


def test_run_name_accepts_one_folder_name() -> None:
    for name in ("ok", "exp-1.v2_a", "x" * MAX_RUN_NAME, ""):
        assert RunConfig(run_name=name).run_name == name


# ------------------------------------------------------------------ task
TASKS_THAT_ARE_NOT_FACTORIES = [
    ("os:system", "built-in function"),
    ("os:getcwd", "built-in function"),
    ("math:pi", "float"),
    ("json:JSONDecoder", "cannot be called with one argument"),
]


@pytest.mark.parametrize(("spec", "kind"), TASKS_THAT_ARE_NOT_FACTORIES)
def test_task_os_system_is_one_config_error_not_a_type_error(spec: str, kind: str) -> None:
    """``os.system`` is callable, but not a task factory: refused when the task is resolved (before the calibration),
    and ``build_task`` raises the same ConfigError (today: ``TypeError`` from ``os.system(cfg)``)."""
    with pytest.raises(ConfigError) as info:
        resolve_task(spec)
    message = str(info.value)
    assert f"'task' = {spec!r}" in message and kind in message and "factory(cfg)" in message, message
    if spec == "os:system":
        with pytest.raises(ConfigError, match="built-in function"):
            build_task(RunConfig(task=spec))


def test_a_task_factory_of_ones_own_still_loads(tmp_path: Path) -> None:
    module = tmp_path / "my_small_task.py"
    module.write_text(
        "from dpfedavg.tasks.quadratic import QuadraticTask\n\ndef make(cfg):\n    return QuadraticTask(cfg)\n"
    )
    cfg = RunConfig(task=f"{module}:make", dim=5, num_clients=4, clients_per_round=2.0)
    assert build_task(cfg).dim == 5


# ------------------------------------------------------------------ noise-multiplier = -0.0
def test_noise_multiplier_minus_zero_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig(epsilon=0.0, noise_multiplier=-0.0)
    message = str(info.value)
    assert "'noise-multiplier' = -0.0" in message and "-0.0 too, is refused" in message and "0 (explicitly" in message
    # 0 spelled 0 is the explicit opt-out: no noise, and the plan says so
    assert not plan_for(RunConfig(epsilon=0.0, noise_multiplier=0.0)).dp


def test_noise_multiplier_minus_zero_from_the_run_config_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"'noise-multiplier' = -0\.0"):
        RunConfig.from_run_config({"epsilon": 0.0, "noise-multiplier": -0.0})


# ------------------------------------------------------------------ epsilon = 0 with noise-multiplier = "auto"
@pytest.mark.parametrize("algorithm", ["norm", "clip", "adaptive-clip"])
def test_epsilon_zero_with_auto_noise_is_refused_saying_how_to_get_privacy(algorithm: str) -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_run_config({"epsilon": 0.0, "noise-multiplier": "auto", "algorithm": algorithm})
    message = str(info.value)
    for fragment in ("'epsilon' = 0", "'noise-multiplier' = 'auto'", "WITHOUT differential privacy", "set epsilon",
                     "algorithm='none'", "noise-multiplier=0"):  # fmt: skip
        assert fragment in message, message


def test_training_without_dp_is_still_possible_when_asked_for_explicitly() -> None:
    assert not plan_for(RunConfig(epsilon=0.0, algorithm="none")).dp
    assert not plan_for(RunConfig(epsilon=0.0, noise_multiplier=0.0)).dp
    assert RunConfig(epsilon=0.0, noise_multiplier=1.0).noise_multiplier == 1.0  # a fixed z, its epsilon reported


def test_epsilon_zero_with_auto_noise_through_the_server_app_is_one_error_line(tmp_path: Path, dpfedavg_log) -> None:
    run_config = RunConfig(output_dir=str(tmp_path)).to_run_config() | {"epsilon": 0.0}
    _main(run_config)
    assert "set epsilon" in _one_error_line(dpfedavg_log)
    assert not list(tmp_path.iterdir())  # nothing trained, nothing written


# ------------------------------------------------------------------ a read-only output directory
def _refuse_to_calibrate(cfg):
    raise AssertionError("the output directory must be checked before the calibration")


def test_output_dir_under_a_file_is_one_error_line_before_start(tmp_path: Path, dpfedavg_log, monkeypatch) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file")
    monkeypatch.setattr(PrivacySetup, "resolve", staticmethod(_refuse_to_calibrate))
    _main({**QUADRATIC, "output-dir": str(blocker / "outputs")})
    message = _one_error_line(dpfedavg_log)
    assert f"'output-dir' = {str(blocker / 'outputs')!r}" in message and "is not a folder" in message, message
    assert blocker.read_text() == "a file"


def test_output_dir_under_a_file_is_a_config_error_in_the_batched_engine(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file")
    cfg = RunConfig.from_run_config({**QUADRATIC, "output-dir": str(blocker / "outputs")})
    with pytest.raises(ConfigError, match="'output-dir' = .* is not a folder"):
        dpfedavg.run(cfg, progress=False)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only folder (the test above covers root)")
def test_read_only_output_dir_is_one_error_line_before_start(tmp_path: Path, dpfedavg_log, monkeypatch) -> None:
    out = tmp_path / "ro"
    out.mkdir(mode=0o500)
    monkeypatch.setattr(PrivacySetup, "resolve", staticmethod(_refuse_to_calibrate))
    try:
        _main({**QUADRATIC, "output-dir": str(out)})
    finally:
        out.chmod(0o700)
    message = _one_error_line(dpfedavg_log)
    assert f"'output-dir' = {str(out)!r}" in message and "cannot write in" in message, message
    assert not list(out.iterdir())


def test_read_only_file_system_is_one_error_line_before_start(tmp_path: Path, dpfedavg_log, monkeypatch) -> None:
    """Root included: a file system that refuses the write (EROFS here, injected where the check writes)."""

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr("dpfedavg.io.results.tempfile.mkstemp", read_only)
    monkeypatch.setattr(PrivacySetup, "resolve", staticmethod(_refuse_to_calibrate))
    _main({**QUADRATIC, "output-dir": str(tmp_path / "out")})
    message = _one_error_line(dpfedavg_log)
    assert "'output-dir'" in message and "Read-only file system" in message, message
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------ a reply from a node that was not sampled
class _UnaskedReplyGrid(InProcessGrid):
    """Every round, one node that was not sampled answers too (a copy of a sampled node's TRAIN message, sent to it;
    never partition 0, which does not answer).

    ``asked`` records the nodes each round's TRAIN messages went to.
    """

    asked: list[set[int]]

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = list(super().send_and_receive(messages, timeout=timeout))
        if not messages or messages[0].metadata.message_type != MessageType.TRAIN:
            return replies  # the discovery's queries
        asked = {m.metadata.dst_node_id for m in messages}
        self.asked = [*getattr(self, "asked", []), asked]
        others = sorted(n for n in set(self.contexts) - asked if self.contexts[n].node_config["partition-id"] != 0)
        if others:
            forged = copy.deepcopy(messages[0])
            forged.metadata.dst_node_id = others[0]
            replies.append(self._call(forged))
        return replies


def test_reply_from_an_unsampled_node_is_rejected_and_hides_no_dropout(tmp_path: Path, dpfedavg_log) -> None:
    """Partition 0 never answers a TRAIN message; an unsampled node answers every round. metrics.csv counts both:
    the unasked reply as rejected (its reason logged), partition 0 as a dropout whenever it was sampled."""
    cfg = RunConfig.from_run_config({**QUADRATIC, "num-rounds": 6, "output-dir": str(tmp_path), "run-name": "unasked"})

    def silent_partition_0(msg: Message, context: Context) -> Message | None:
        if msg.metadata.message_type == MessageType.TRAIN and int(context.node_config["partition-id"]) == 0:
            return None
        return client_app(msg, context)

    grid = _UnaskedReplyGrid(silent_partition_0, 6, cfg.to_run_config())
    out = server_app.run(grid, cfg, setup=PrivacySetup.resolve(cfg)).directory
    rows = list(csv.DictReader((out / "metrics.csv").open()))[1:]
    node_0 = next(nid for nid, ctx in grid.contexts.items() if ctx.node_config["partition-id"] == 0)
    assert len(grid.asked) == len(rows) == 6  # every round sent TRAIN messages (the seed's cohorts are not empty)
    assert any(node_0 in a for a in grid.asked) and any(node_0 not in a for a in grid.asked)  # both cases
    for asked, row in zip(grid.asked, rows, strict=True):
        silent = int(node_0 in asked)
        assert int(row["num_sampled"]) == len(asked) and len(asked | {node_0}) < 6, row
        assert int(row["num_dropped"]) == silent, (asked, row)
        assert int(row["num_received"]) == len(asked) - silent, (asked, row)
        assert int(row["num_rejected"]) == 1, row
    assert sum("which was not sampled this round" in r.getMessage() for r in dpfedavg_log) == 6


# ------------------------------------------------------------------ clients' metrics
def _train_with_metrics(bad: dict):
    """Every client trains nothing and reports train_loss 1 on 30 examples; partition 0 reports ``bad`` instead."""

    def train(msg: Message, context: Context) -> Message:
        metrics = {"train_loss": 1.0, "num-examples": 30}
        if int(context.node_config["partition-id"]) == 0:
            metrics |= bad
        return Message(RecordDict({"arrays": msg.content["arrays"], "metrics": MetricRecord(metrics)}), reply_to=msg)

    app = ClientApp()
    app.train(mods=[dp_mod])(train)
    return app


@pytest.mark.parametrize(
    ("bad", "fragment"),
    [
        ({"num-examples": 1e12, "train_loss": 1e300}, "'num-examples' = 1000000000000.0"),
        ({"num-examples": float("nan"), "train_loss": 5.0}, "'num-examples' = nan"),
        ({"num-examples": 0, "train_loss": 5.0}, "'num-examples' = 0"),
        ({"num-examples": -30, "train_loss": 5.0}, "'num-examples' = -30"),
        ({"train_loss": float("nan")}, "metric 'train_loss' = nan"),
        ({"train_loss": float("inf")}, "metric 'train_loss' = inf"),
    ],
    ids=["num-examples=1e12", "num-examples=nan", "num-examples=0", "num-examples=-30", "metric=nan", "metric=inf"],
)
def test_one_clients_num_examples_1e12_or_nan_never_poisons_the_averaged_metrics(
    bad: dict, fragment: str, dpfedavg_log, monkeypatch
) -> None:
    monkeypatch.setattr(AppDPFedAvg, "settle_seconds", 0.05)  # every in-process node is there from the start
    strategy = DPFedAvg(algorithm="none", clip=1.0, epsilon=0.0, fraction_train=1.0)
    grid = InProcessGrid(_train_with_metrics(bad), 5, {})
    arrays = ArrayRecord({"w": Array(np.zeros(3, dtype=np.float32))})
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=2)
    for k in (1, 2):
        assert result.train_metrics_clientapp[k]["train_loss"] == 1.0  # the four honest clients' average
        assert math.isfinite(result.train_metrics_clientapp[k]["train_loss"])
        assert len(strategy.client_metrics_rejected[k]) == 1 and fragment in strategy.client_metrics_rejected[k][0]
    logged = [r.getMessage() for r in dpfedavg_log if "left out of the round's average" in r.getMessage()]
    assert len(logged) == 2 and all(fragment in m for m in logged), logged
