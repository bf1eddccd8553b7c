"""Every release is charged after crashes: the write-ahead record of rounds (dpfedavg.server.releases).

With secure noise a round redone after a crash is a fresh release (new cohort, new noise, same clients' data).
The server writes each round's line to ``releases.jsonl`` before the round is sent; a resume charges every line.
The epsilon a crashed and resumed run reports is checked against the closed form of the Gaussian mechanism
composed over the releases the *clients* saw (q = 1: ``n`` releases of ``N(0, (zC)^2)`` on sensitivity ``C`` are
``mu``-GDP with ``mu = sqrt(n) / z``; Dong, Roth, Su 2022, Corollaries 2.13 and 3.3), solved with scipy.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from dpfedavg.config import RunConfig
from dpfedavg.engines.batched import run_batched
from dpfedavg.flower import server_app
from dpfedavg.flower.client_app import app as client_app
from dpfedavg.flower.protocol import ARRAYS, CONFIG, UPDATE_KEY
from dpfedavg.flower.testing import InProcessGrid
from dpfedavg.io.checkpoint import CheckpointError, load_checkpoint

RELEASES_FILE = "releases.jsonl"  # the write-ahead record (docs/how-to/resume.md)

Z, DELTA = 2.0, 1e-5
BASE = {
    "task": "quadratic",
    "dim": 8,
    "num-clients": 6,
    "clients-per-round": 6.0,  # q = 1: every release is the plain Gaussian mechanism (closed form below)
    "num-rounds": 10,
    "epsilon": 0.0,
    "noise-multiplier": Z,
    "delta": DELTA,
    "algorithm": "clip",
    "clip": 1.0,
    "seed": 5,
    "checkpoint-every": 5,
    "run-name": "run",
}


def gaussian_epsilon(releases: int, z: float = Z, delta: float = DELTA) -> float:
    """Epsilon of ``releases`` Gaussian mechanisms of noise multiplier ``z`` at ``delta`` (mu-GDP, closed form)."""
    mu = math.sqrt(releases) / z

    def delta_of(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)

    return brentq(lambda eps: delta_of(eps) - delta, 1e-9, 100.0, xtol=1e-12)


class _Crash(BaseException):
    """The server process dying (not an Exception: nothing may catch it)."""


class _Clients:
    """The SuperNodes' side: what each client received and sent back, per attempt of the run."""

    def __init__(self) -> None:
        self.attempt = 0
        self.trained: dict[tuple[int, int, int], np.ndarray] = {}  # (attempt, round, partition) -> reply sent

    def __call__(self, msg, context):
        reply = client_app(msg, context)
        if msg.metadata.message_type == "train":
            key = (self.attempt, int(msg.content[CONFIG]["server-round"]), int(context.node_config["partition-id"]))
            self.trained[key] = reply.content[ARRAYS][UPDATE_KEY].numpy().copy()
        return reply

    def releases(self) -> int:
        """Round attempts that reached the clients: each one a release of their data."""
        return len({(attempt, k) for attempt, k, _ in self.trained})


class _DiesAfterRound(InProcessGrid):
    """The server dies once the clients' replies of round ``crash_round`` are in (before it aggregates them)."""

    def __init__(self, *args, crash_round: int | None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.crash_round = crash_round

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = super().send_and_receive(messages, timeout=timeout)
        if any(m.metadata.message_type == "train" and m.content[CONFIG]["server-round"] == self.crash_round
               for m in messages):  # fmt: skip
            raise _Crash
        return replies


def _crash_three_times_then_finish(
    tmp: Path, secure: bool, node_config: dict | None = None
) -> tuple[_Clients, RunConfig, object]:
    """Three crashes after round 8 (checkpoint after round 5), then a resume that finishes (the issue's case)."""
    clients = _Clients()
    cfg = RunConfig.from_run_config({**BASE, "output-dir": str(tmp), "secure-noise": secure})
    for attempt in range(4):
        clients.attempt = attempt
        run_cfg = cfg if attempt == 0 else cfg.replace(resume=True)
        grid = _DiesAfterRound(
            clients, 6, run_cfg.to_run_config(), crash_round=8 if attempt < 3 else None, node_config=node_config
        )
        if attempt < 3:
            with pytest.raises(_Crash):
                server_app.run(grid, run_cfg)
            assert load_checkpoint(tmp / "run").round == 5
        else:
            return clients, cfg, server_app.run(grid, run_cfg)
    raise AssertionError("unreachable")


def test_secure_noise_run_crashed_three_times_reports_every_release(tmp_path: Path) -> None:
    clients, cfg, result = _crash_three_times_then_finish(tmp_path, secure=True)
    releases = clients.releases()
    assert releases == 8 + 3 + 3 + 5  # 19 releases for 10 rounds
    # redone rounds are fresh releases: the same client's reply differs between attempts
    assert not np.array_equal(clients.trained[(0, 7, 2)], clients.trained[(1, 7, 2)])
    expected = gaussian_epsilon(releases)
    assert result.epsilon == pytest.approx(expected, rel=2e-3)  # PLD's discretization is pessimistic by < 0.2%
    assert result.epsilon >= expected * (1 - 1e-9)
    assert result.epsilon > gaussian_epsilon(10) * 1.3  # what 10 accounted rounds would report
    final = json.loads((result.directory / "config.json").read_text())["final"]
    assert final["epsilon"] == result.epsilon and final["releases"] == releases
    assert result.history[-1]["epsilon"] == result.epsilon  # metrics.csv's epsilon column too
    lines = (result.directory / RELEASES_FILE).read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [*range(1, 9), *range(6, 9), *range(6, 9), *range(6, 11)]


def test_seeded_clients_redo_rounds_bit_identically_and_the_batched_engine_charges_them_once(tmp_path: Path) -> None:
    """Seeded nodes send bit for bit what they sent in the first attempt; the batched engine (the server simulates
    every client) charges no redone round. A seeded Flower server cannot rule out nodes drawing their own noise:
    it keeps the record and charges all 19 (`test_a_seeded_server_with_secure_noise_nodes_reports_every_release`)."""
    clients, cfg, result = _crash_three_times_then_finish(tmp_path / "flower", secure=False)
    first: dict[tuple[int, int], np.ndarray] = {}
    for (_attempt, k, pid), update in sorted(clients.trained.items(), key=lambda item: item[0]):
        np.testing.assert_array_equal(update, first.setdefault((k, pid), update))  # the same release, not a new one
    assert clients.releases() == 19  # 19 round attempts reached the clients, 9 of them repeats
    assert {(k, pid) for _, k, pid in clients.trained} == {(k, pid) for k in range(1, 11) for pid in range(6)}
    assert result.epsilon == pytest.approx(gaussian_epsilon(19), rel=2e-3)
    batched = RunConfig.from_run_config({**BASE, "output-dir": str(tmp_path / "batched")})

    def crash(server_round: int, w: np.ndarray) -> None:
        if server_round == 8:
            raise _Crash

    with pytest.raises(_Crash):
        run_batched(batched, on_round=crash)
    resumed = run_batched(batched.replace(resume=True))
    assert resumed.epsilon == pytest.approx(gaussian_epsilon(10), rel=2e-3)
    assert not (resumed.directory / RELEASES_FILE).exists()


def test_a_seeded_server_with_secure_noise_nodes_reports_every_release(tmp_path: Path) -> None:
    """Issue 46: a seeded server (``seed`` set, ``secure-noise = false``) whose nodes' policy demands their own noise
    (``secure-noise`` in the node config): each redone round is a fresh release (the replies differ), and the run
    reports 19 releases (11.12 at q = 1, closed form), not the 10 rounds' 7.51."""
    clients, cfg, result = _crash_three_times_then_finish(tmp_path, secure=False, node_config={"secure-noise": True})
    releases = clients.releases()
    assert releases == 8 + 3 + 3 + 5
    assert not np.array_equal(clients.trained[(0, 7, 2)], clients.trained[(1, 7, 2)])  # fresh noise: not a replay
    expected = gaussian_epsilon(releases)
    assert expected == pytest.approx(11.12, abs=0.01) and gaussian_epsilon(10) == pytest.approx(7.51, abs=0.01)
    assert result.epsilon == pytest.approx(expected, rel=2e-3) and result.epsilon >= expected * (1 - 1e-9)
    final = json.loads((result.directory / "config.json").read_text())["final"]
    assert final["epsilon"] == result.epsilon and final["releases"] == releases
    lines = (result.directory / RELEASES_FILE).read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [*range(1, 9), *range(6, 9), *range(6, 9), *range(6, 11)]


# ------------------------------------------------------------------------- the record, edited or missing
def _interrupted(tmp: Path, **overrides) -> RunConfig:
    """A secure-noise run that dies after round 7 (checkpoint after round 5): rounds 6 and 7 will be redone."""
    cfg = RunConfig.from_run_config({**BASE, "output-dir": str(tmp), "secure-noise": True, **overrides})

    def crash(server_round: int, w: np.ndarray) -> None:
        if server_round == 7:
            raise _Crash

    with pytest.raises(_Crash):
        run_batched(cfg, on_round=crash)
    return cfg.replace(resume=True)


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / RELEASES_FILE).read_text().splitlines()]


def _write(run_dir: Path, records: list[dict]) -> None:
    (run_dir / RELEASES_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize(
    ("name", "edit", "fragment"),
    [
        ("record-deleted", None, "is missing"),
        ("redone-rounds-cut", lambda rs: rs[:5], "metrics.csv holds the rows of 2 round(s)"),
        ("redone-round-renumbered", lambda rs: [*rs[:5], {**rs[5], "round": 5}, rs[6]], "line 7"),
        ("truncated-before-the-checkpoint", lambda rs: rs[:4], "it has 4 lines"),
        ("emptied", lambda rs: [], "it has 0 lines"),
        ("z-raised", lambda rs: [{**r, "z": 100.0} for r in rs], "(q, z)"),
        ("round-renumbered", lambda rs: [*rs[:5], {**rs[5], "round": 9}, *rs[6:]], "line 6"),
        ("line-dropped-in-the-middle", lambda rs: rs[:2] + rs[3:], "line 3"),
        ("not-json", lambda rs: ["release 1"], "line 1"),
    ],
)
def test_missing_or_edited_release_record_is_refused(tmp_path: Path, name: str, edit, fragment: str) -> None:
    cfg = _interrupted(tmp_path)
    run_dir = tmp_path / "run"
    if edit is None:
        (run_dir / RELEASES_FILE).unlink()
    else:
        _write(run_dir, edit(_lines(run_dir)))
    before = (run_dir / "metrics.csv").read_text()
    with pytest.raises(CheckpointError) as info:
        run_batched(cfg)
    assert RELEASES_FILE in str(info.value) and fragment in str(info.value), str(info.value)
    assert (run_dir / "metrics.csv").read_text() == before  # refused before anything was written


def test_lines_added_to_the_record_only_raise_epsilon(tmp_path: Path) -> None:
    cfg = _interrupted(tmp_path)
    records = _lines(tmp_path / "run")
    assert [r["round"] for r in records] == [1, 2, 3, 4, 5, 6, 7]
    _write(tmp_path / "run", [*records, {**records[-1], "release": 8, "round": 8}])
    result = run_batched(cfg)
    assert result.epsilon == pytest.approx(gaussian_epsilon(8 + 5), rel=2e-3)  # 8 lines + rounds 6..10 again


def test_partial_last_line_is_dropped_and_the_resume_charges_the_rest(tmp_path: Path, dp_log) -> None:
    """A process killed while writing a line never sent that round (the line is on disk before the round is)."""
    cfg = _interrupted(tmp_path)
    with (tmp_path / "run" / RELEASES_FILE).open("a") as fh:
        fh.write('{"release": 8, "rou')
    with dp_log.at_level(logging.WARNING):
        result = run_batched(cfg)
    assert "partial last line" in dp_log.text
    assert result.epsilon == pytest.approx(gaussian_epsilon(7 + 5), rel=2e-3)
    assert [r["release"] for r in _lines(tmp_path / "run")] == list(range(1, 13))


def test_max_epsilon_counts_the_redone_rounds(tmp_path: Path) -> None:
    """A budget that fits 10 rounds but not 12 releases stops the resumed run early."""
    budget = (gaussian_epsilon(11) + gaussian_epsilon(12)) / 2  # 11 releases fit, 12 do not
    cfg = _interrupted(tmp_path, **{"max-epsilon": budget})
    result = run_batched(cfg)
    assert result.stopped_by_budget_before_round == 10  # releases 1..7, then rounds 6..9 again: 11
    assert result.epsilon <= budget


def test_a_record_that_cannot_be_written_stops_the_run_before_the_round_is_sent(tmp_path: Path, monkeypatch) -> None:
    from dpfedavg.errors import ResultsError
    from dpfedavg.server import releases

    real, calls = releases.append_bytes, {"n": 0}

    def disk_full_at_the_third(path, data, *, durable=False):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real(path, data, durable=durable)

    monkeypatch.setattr(releases, "append_bytes", disk_full_at_the_third)
    cfg = RunConfig.from_run_config({**BASE, "output-dir": str(tmp_path), "secure-noise": True})
    clients = _Clients()
    with pytest.raises(ResultsError, match="before the round is sent"):
        server_app.run(InProcessGrid(clients, 6, cfg.to_run_config()), cfg)
    assert {k for _, k, _ in clients.trained} == {1, 2}  # round 3 reached nobody
    assert [r["round"] for r in _lines(tmp_path / "run")] == [1, 2]


def test_banded_mf_with_secure_noise_refuses_to_redo_rounds(tmp_path: Path) -> None:
    banded = {"noise-mechanism": "banded-mf", "noise-placement": "server", "clients-per-round": 2.0}
    cfg = _interrupted(tmp_path, **banded)
    with pytest.raises(CheckpointError, match="cannot account a round released twice"):
        run_batched(cfg)
