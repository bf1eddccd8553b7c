"""Reliability: exact checkpoint/resume, secure noise, numerical safety and fault injection."""

from __future__ import annotations

import csv
import json
import logging
import os
import stat
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Message, MetricRecord, RecordDict

from dpfedavg.config import ConfigError, RunConfig
from dpfedavg.core import SECURE_NOISE_SEED
from dpfedavg.engines.batched import run_batched
from dpfedavg.flower import server_app
from dpfedavg.flower.app_strategy import DPFedAvg
from dpfedavg.flower.client_app import app as client_app
from dpfedavg.flower.protocol import (
    ARRAYS,
    CONFIG,
    DIAGNOSTICS,
    METRICS,
    UPDATE_KEY,
    instructions_to_config_record,
    to_array_record,
)
from dpfedavg.flower.testing import InProcessGrid
from dpfedavg.io import atomic
from dpfedavg.io.checkpoint import CHECKPOINT_FILE, CheckpointError, load_checkpoint
from dpfedavg.server.health import TrainingStopped

BASE = {
    "task": "quadratic",
    "dim": 30,
    "num-clients": 12,
    "clients-per-round": 5.0,
    "num-rounds": 10,
    "server-momentum": 0.7,
    "epsilon": 4.0,
    "delta": 1e-5,
    "algorithm": "norm",
    "clip": 3.0,
    "seed": 3,
    "checkpoint-every": 5,
    "save-trajectory": True,
    "run-name": "run",
}


class _Crash(BaseException):
    """Stands in for the server process dying (not an Exception: nothing may catch it)."""


def _cfg(tmp: Path, **overrides) -> RunConfig:
    return RunConfig.from_run_config({**BASE, "output-dir": str(tmp), **overrides})


def _rows(run_dir: Path) -> list[dict[str, str]]:
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    for row in rows:
        row.pop("elapsed_s")
    return rows


def _final(run_dir: Path) -> dict:
    return json.loads((run_dir / "config.json").read_text())["final"]


def _assert_same_run(a: Path, b: Path) -> None:
    model_a, model_b = np.load(a / "model.npz"), np.load(b / "model.npz")
    for key in ("w_final", "w_random_iterate", "random_iterate_round"):
        np.testing.assert_array_equal(model_a[key], model_b[key])  # bit-identical
    assert _final(a)["epsilon"] == _final(b)["epsilon"]
    assert _rows(a) == _rows(b)
    np.testing.assert_array_equal(np.load(a / "trajectory.npy"), np.load(b / "trajectory.npy"))


# ---------------------------------------------------------------- batched engine
@pytest.mark.parametrize("placement", ["client-calibrated", "server"])
def test_batched_resume_is_bit_identical(tmp_path: Path, placement: str) -> None:
    full = run_batched(_cfg(tmp_path / "full", **{"noise-placement": placement})).directory

    def crash_after_round_7(server_round: int, w: np.ndarray) -> None:
        if server_round == 7:
            raise _Crash

    cfg = _cfg(tmp_path / "cut", **{"noise-placement": placement})
    with pytest.raises(_Crash):
        run_batched(cfg, on_round=crash_after_round_7)
    assert load_checkpoint(tmp_path / "cut" / "run").round == 5  # rounds 6-7 are lost and redone
    resumed = run_batched(cfg.replace(resume=True)).directory
    _assert_same_run(full, resumed)


def test_resume_continues_the_accountant_not_from_zero(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, **{"epsilon": 0.0, "noise-multiplier": 1.5})

    def crash(server_round: int, w: np.ndarray) -> None:
        if server_round == 5:
            raise _Crash

    with pytest.raises(_Crash):
        run_batched(cfg, on_round=crash)
    saved = load_checkpoint(tmp_path / "run")
    assert len(saved.server.accountant["history"]) == 5
    resumed = run_batched(cfg.replace(resume=True, checkpoint_every=0)).directory
    rows = _rows(resumed)
    epsilons = [float(r["epsilon"]) for r in rows[1:] if r["epsilon"]]
    assert len(rows) == 11 and epsilons[-1] == pytest.approx(_final(resumed)["epsilon"])
    fresh = run_batched(cfg.replace(run_name="five", num_rounds=5, checkpoint_every=0)).directory
    assert _final(resumed)["epsilon"] > _final(fresh)["epsilon"] * 1.2  # 10 rounds' worth, not 5


# ----------------------------------------------------------------- Flower engine
class _CrashingGrid(InProcessGrid):
    """Dies while round ``crash_round`` is out."""

    def __init__(self, *args, crash_round: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.crash_round = crash_round

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for msg in messages:
            if msg.metadata.message_type == "train" and msg.content[CONFIG]["server-round"] == self.crash_round:
                raise _Crash
        return super().send_and_receive(messages, timeout=timeout)


def test_a_flower_run_is_durable_every_round_by_default_and_a_batched_run_every_10(tmp_path: Path) -> None:
    """Issue 47 item 3: ``checkpoint-every = "auto"`` (the default) under Flower makes every round durable before the
    next is sent: a server that dies with round 8 out resumes from round 7's checkpoint. The batched engine, whose
    rounds take milliseconds, checkpoints every 10 rounds."""
    cfg = _cfg(tmp_path / "cut", **{"checkpoint-every": "auto"})  # BASE sets 5
    with pytest.raises(_Crash):
        server_app.run(_CrashingGrid(client_app, 12, cfg.to_run_config(), crash_round=8), cfg)
    assert load_checkpoint(tmp_path / "cut" / "run").round == 7

    def crash(server_round: int, w: np.ndarray) -> None:
        if server_round == 8:
            raise _Crash

    batched = _cfg(tmp_path / "batched", **{"num-rounds": 12, "checkpoint-every": "auto"})
    with pytest.raises(_Crash):
        run_batched(batched, on_round=crash)
    assert not (tmp_path / "batched" / "run" / "checkpoint.npz").exists()


def test_flower_resume_is_bit_identical(tmp_path: Path) -> None:
    cfg_full = _cfg(tmp_path / "full", **{"checkpoint-every": 3})
    full = server_app.run(InProcessGrid(client_app, 12, cfg_full.to_run_config()), cfg_full).directory
    cfg = _cfg(tmp_path / "cut", **{"checkpoint-every": 3})
    with pytest.raises(_Crash):
        server_app.run(_CrashingGrid(client_app, 12, cfg.to_run_config(), crash_round=8), cfg)
    assert load_checkpoint(tmp_path / "cut" / "run").round == 6
    resumed_cfg = cfg.replace(resume=True)
    resumed = server_app.run(InProcessGrid(client_app, 12, resumed_cfg.to_run_config(), seed=9), resumed_cfg).directory
    # the model and every iterate bit for bit; the privacy charge is not the uninterrupted run's: a Flower server
    # cannot rule out that its nodes drew their own noise (issue 46), so the redone rounds 7 and 8 are charged
    # (the record holds 12 releases; the closed-form check of such a charge is in tests/test_release_log.py)
    model_a, model_b = np.load(full / "model.npz"), np.load(resumed / "model.npz")
    for key in ("w_final", "w_random_iterate", "random_iterate_round"):
        np.testing.assert_array_equal(model_a[key], model_b[key])
    np.testing.assert_array_equal(np.load(full / "trajectory.npy"), np.load(resumed / "trajectory.npy"))
    strip = lambda rows: [{k: v for k, v in r.items() if k != "epsilon"} for r in rows]  # noqa: E731
    assert strip(_rows(full)) == strip(_rows(resumed))
    releases = [json.loads(line) for line in (resumed / "releases.jsonl").read_text().splitlines() if line.strip()]
    assert [r["round"] for r in releases if "round" in r] == [*range(1, 9), 7, 8, 9, 10]
    import dp_accounting

    z = float(_rows(full)[1]["noise_multiplier"])
    twelve = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    twelve.compose(dp_accounting.PoissonSampledDpEvent(5 / 12, dp_accounting.GaussianDpEvent(z)), 12)
    assert _final(resumed)["epsilon"] == pytest.approx(twelve.get_epsilon(1e-5), rel=1e-3)
    assert _final(resumed)["epsilon"] > _final(full)["epsilon"]
    # and the batched engine agrees with both
    batched = run_batched(_cfg(tmp_path / "batched")).directory
    np.testing.assert_allclose(np.load(batched / "model.npz")["w_final"], np.load(resumed / "model.npz")["w_final"],
                               rtol=1e-9)  # fmt: skip


# -------------------------------------------------------------- resume refusals
def _interrupted(tmp_path: Path) -> RunConfig:
    cfg = _cfg(tmp_path)

    def crash(server_round: int, w: np.ndarray) -> None:
        if server_round == 6:
            raise _Crash

    with pytest.raises(_Crash):
        run_batched(cfg, on_round=crash)
    return cfg.replace(resume=True)


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        ({"clip": 4.0}, ["clip", "privacy-relevant"]),
        ({"epsilon": 6.0}, ["noise multiplier (z)", "privacy-relevant"]),
        ({"clients_per_round": 6.0}, ["sampling rate (q = r/n)"]),
        ({"delta": 1e-6}, ["delta"]),
        ({"noise_placement": "server"}, ["noise-placement"]),
        ({"accountant": "rdp"}, ["accountant"]),
        ({"algorithm": "clip"}, ["algorithm"]),
        ({"diagnostics": True}, ["diagnostics", "privacy-relevant"]),
        ({"local_lr": 0.01}, ["'local-lr'"]),
        ({"seed": 4}, ["'seed'"]),
        ({"dim": 31}, ["'dim'", "model dimension"]),
    ],
)
def test_resume_with_changed_settings_is_refused(tmp_path: Path, change: dict, fragments: list[str]) -> None:
    cfg = _interrupted(tmp_path)
    before = (tmp_path / "run" / "metrics.csv").read_text()
    with pytest.raises(CheckpointError) as info:
        run_batched(cfg.replace(**change))
    for fragment in fragments:
        assert fragment in str(info.value)
    assert (tmp_path / "run" / "metrics.csv").read_text() == before  # refused before anything was written


def test_resume_allows_operational_changes(tmp_path: Path) -> None:
    cfg = _interrupted(tmp_path)
    out = run_batched(cfg.replace(round_timeout=10.0, eval_every=2, checkpoint_every=1)).directory
    assert _final(out)["rounds_completed"] == 10


def test_resume_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'resume' = True needs 'run-name'"):
        RunConfig.from_run_config({"resume": True})
    with pytest.raises(CheckpointError, match="no checkpoint at .*checkpoint.npz"):
        run_batched(_cfg(tmp_path, resume=True))
    finished = run_batched(_cfg(tmp_path, **{"run-name": "done"})).directory
    with pytest.raises(CheckpointError, match="nothing to do"):
        run_batched(_cfg(tmp_path, **{"run-name": "done", "resume": True}))
    (finished / CHECKPOINT_FILE).write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(CheckpointError, match="unreadable"):
        run_batched(_cfg(tmp_path, **{"run-name": "done", "resume": True}))


def test_bad_resume_through_the_server_app_is_one_error_line(tmp_path: Path, dp_log) -> None:
    cfg = _cfg(tmp_path, resume=True)
    grid = InProcessGrid(client_app, 12, cfg.to_run_config())
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=cfg.to_run_config())
    with dp_log.at_level(logging.ERROR):
        server_app.main(grid, context)
    errors = list({id(r): r for r in dp_log.records if r.levelno >= logging.ERROR}.values())  # once if it propagates
    assert len(errors) == 1 and "no checkpoint" in errors[0].getMessage() and errors[0].exc_info is None


# ------------------------------------------------------------ checkpoint failure
def test_failed_checkpoint_write_keeps_the_last_good_one(tmp_path: Path, monkeypatch, caplog) -> None:
    real_fsync = os.fsync
    calls = {"n": 0}

    def fsync_that_fails_after_the_first(fd: int) -> None:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # the folder's fsync after a rename
            return real_fsync(fd)
        calls["n"] += 1  # a checkpoint's file: written, now flushed to a disk that is full from the 2nd on
        if calls["n"] == 1:
            return real_fsync(fd)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", fsync_that_fails_after_the_first)
    with caplog.at_level(logging.ERROR):
        out = run_batched(_cfg(tmp_path, **{"checkpoint-every": 2})).directory
    assert _final(out)["rounds_completed"] == 10  # training kept going
    assert calls["n"] == 5  # rounds 2, 4, 6, 8 and the final one
    assert load_checkpoint(out).round == 2  # the last good checkpoint is intact and readable
    assert not list(out.glob(".*.tmp"))  # no temporary file left behind
    failures = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert (
        len(failures) == 4 and "No space left on device" in failures[0] and "previous checkpoint is kept" in failures[0]
    )


# ------------------------------------------------------------------ secure noise
def test_secure_noise_is_not_reproducible_and_seeded_noise_is(tmp_path: Path) -> None:
    runs = {}
    for name, secure in (("s1", True), ("s2", True), ("p1", False), ("p2", False)):
        out = run_batched(_cfg(tmp_path, **{"run-name": name, "secure-noise": secure, "checkpoint-every": 0})).directory
        runs[name] = np.load(out / "model.npz")["w_final"]
    np.testing.assert_array_equal(runs["p1"], runs["p2"])
    assert np.abs(runs["s1"] - runs["s2"]).max() > 1e-3
    assert np.abs(runs["s1"] - runs["p1"]).max() > 1e-3


@pytest.mark.parametrize("placement", ["client-calibrated", "server"])
def test_secure_noise_has_the_right_scale_and_no_seed_leaves_the_server(placement: str) -> None:
    cfg = RunConfig.from_run_config({**BASE, "dim": 4000, "secure-noise": True, "diagnostics": True,
                                     "noise-placement": placement})  # fmt: skip
    strategy = DPFedAvg(cfg, dim=4000)
    ins = strategy.server.instructions(3, 5)
    assert ins.noise_seed == SECURE_NOISE_SEED
    client_std, server_std = strategy.server.noise_stds(5)
    if placement == "server":
        assert ins.noise_std == 0.0 and server_std > 0
        return
    grid = InProcessGrid(client_app, 12, cfg.to_run_config())
    node = next(iter(grid.contexts))
    w = np.zeros(4000)
    noises = []
    for _ in range(2):
        msg = Message(RecordDict({ARRAYS: to_array_record(w), CONFIG: instructions_to_config_record(ins)}),
                      dst_node_id=node, message_type="train")  # fmt: skip
        (reply,) = grid.send_and_receive([msg])
        noisy = reply.content[ARRAYS][UPDATE_KEY].numpy()
        clean = reply.content[DIAGNOSTICS]["clean-update"].numpy()
        noises.append(noisy - clean)
    assert abs(noises[0].std() / client_std - 1) < 0.05  # 4000 draws: the std is within ~2.2% (2 sigma)
    assert abs(np.corrcoef(noises[0], noises[1])[0, 1]) < 0.06  # fresh noise each time, same instructions


# ------------------------------------------------------------ numerical safety
def test_diverging_local_training_is_reported_as_failure_on_both_engines(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, **{"local-lr": 1e20, "num-rounds": 2, "clients-per-round": 12.0, "checkpoint-every": 0,
                            "server-lr": 0.001})  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # overflow inside the diverging local steps
        batched = run_batched(cfg.replace(run_name="batched")).directory
        with pytest.raises(TrainingStopped) as stop:
            server_app.run(InProcessGrid(client_app, 12, cfg.to_run_config()), cfg.replace(run_name="flower"))
        flower = stop.value.result.directory
    rows = _rows(batched)  # the batched engine records the failures and goes on
    assert [int(r["num_failed"]) for r in rows[1:]] == [12, 12] and [int(r["num_received"]) for r in rows[1:]] == [0, 0]
    assert np.all(np.isfinite(np.load(batched / "model.npz")["w_final"]))
    rows = _rows(flower)  # flwr run fails fast: round 1 had no usable reply; it stays accounted
    assert [int(r["num_failed"]) for r in rows[1:]] == [12] and int(rows[1]["num_received"]) == 0
    assert np.all(np.isfinite(np.load(flower / "model.npz")["w_final"]))
    stopped = json.loads((flower / "config.json").read_text())["final"]["stopped_because"]
    assert "every sampled client's reply was unusable" in stopped and "lower the ClientApp's learning rate" in stopped


# --------------------------------------------------------------- fault injection
def test_faulty_clients_do_not_stop_the_run(tmp_path: Path) -> None:
    """One client raises, one hangs past round-timeout, one replies with the wrong shape; the rest are real."""
    cfg = _cfg(tmp_path, **{"clients-per-round": 12.0, "num-rounds": 3, "round-timeout": 1.0, "checkpoint-every": 1})

    def faulty(msg: Message, context: Context) -> Message | None:
        pid = int(context.node_config["partition-id"])
        if msg.metadata.message_type == "train":
            if pid == 0:
                raise RuntimeError("client crashed")
            if pid == 1:
                time.sleep(2.5)  # hangs past the 1 s round timeout
            if pid == 2:
                content = RecordDict({ARRAYS: to_array_record(np.ones(7), UPDATE_KEY),
                                      METRICS: MetricRecord({"update-norm": 1.0})})  # fmt: skip
                return Message(content, reply_to=msg)
        return client_app(msg, context)

    grid = InProcessGrid(faulty, 12, cfg.to_run_config(), enforce_timeout=True)
    out = server_app.run(grid, cfg).directory
    rows = _rows(out)[1:]
    assert [(int(r["num_failed"]), int(r["num_dropped"]), int(r["num_rejected"]), int(r["num_received"]))
            for r in rows] == [(1, 1, 1, 9)] * 3  # fmt: skip
    assert _final(out)["rounds_completed"] == 3
    assert load_checkpoint(out).round == 3


def test_round_stats_state_dict_is_asdict_without_shared_lists() -> None:
    """The checkpoint's per-round rows: the same dict as ``dataclasses.asdict``, lists copied, round-trips."""
    from dataclasses import asdict

    from dpfedavg.io.metrics import RoundStats

    stats = RoundStats(round=4, num_sampled=7, num_received=5, num_rejected=1, eta=0.1, snr=float("nan"),
                       rejected_reasons=["norm above the bound"], failed_reasons=["client 3: diverged"])  # fmt: skip
    state = stats.state_dict()
    lists = {"rejected_reasons": ["norm above the bound"], "failed_reasons": ["client 3: diverged"]}
    assert state == {**asdict(stats), **lists} and list(state) == list(asdict(stats))
    state["rejected_reasons"].append("edited")
    assert stats.rejected_reasons == ("norm above the bound",)
    assert RoundStats(**stats.state_dict()) == stats
