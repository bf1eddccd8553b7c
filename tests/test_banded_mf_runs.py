"""Banded-MF noise in whole runs: both engines, virtual clients, the participation gate, resume, bad input.

The privacy numbers are checked against computations written here (scipy's Gaussian DP, a dense ``C``),
the schedules against an independent checker, and ``b = 1`` against today's mechanism bit for bit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message
from scipy.linalg import toeplitz
from scipy.optimize import brentq
from scipy.stats import norm

from dpfedavg.config import ConfigError, RunConfig
from dpfedavg.engines.batched import run_batched
from dpfedavg.flower import server_app
from dpfedavg.flower.app_strategy import DPFedAvg
from dpfedavg.flower.client_app import app as client_app
from dpfedavg.flower.protocol import CLIENT_IDS, CONFIG, to_array_record
from dpfedavg.flower.testing import InProcessGrid
from dpfedavg.io.checkpoint import load_checkpoint
from dpfedavg.privacy.setup import PrivacySetup
from dpfedavg.server.run import plan_for

BANDED = {"noise-mechanism": "banded-mf", "noise-placement": "server"}


def _cfg(tmp_path: Path, name: str, **values) -> RunConfig:
    base = {"task": "quadratic", "dim": 12, "num-clients": 12, "clients-per-round": 3.0, "num-rounds": 10,
            "epsilon": 4.0, "seed": 7, "output-dir": str(tmp_path), "run-name": name,
            "save-trajectory": True}  # fmt: skip
    return RunConfig.from_run_config({**base, **values})


def _trajectory(directory: Path) -> np.ndarray:
    return np.load(directory / "trajectory.npy")


def _config_json(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def _gdp_epsilon(mu: float, delta: float) -> float:
    """Epsilon of mu-GDP at delta (Dong, Roth, Su 2022, Corollary 2.13), by root finding."""

    def excess(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    return brentq(excess, 0.0, 200.0, xtol=1e-12)


def _asked(grid: InProcessGrid, node_clients: dict[int, list[int]]) -> list[list[int]]:
    """Round -> the clients the server asked, read from the TRAIN messages the grid carried."""
    by_round: dict[int, list[int]] = {}
    for msg in grid.sent:
        if msg.metadata.message_type != "train":
            continue
        config = msg.content[CONFIG]
        clients = list(config[CLIENT_IDS]) if CLIENT_IDS in config else node_clients[msg.metadata.dst_node_id]
        by_round.setdefault(int(config["server-round"]), []).extend(int(c) for c in clients)
    return [sorted(by_round.get(k, [])) for k in range(1, max(by_round) + 1)]


def _rule_holds(schedule: list[list[int]], bands: int, most: int) -> bool:
    """Every client's rounds are >= bands apart and at most ``most`` (written here, not the tracker's check)."""
    seen: dict[int, list[int]] = {}
    for k, cohort in enumerate(schedule):
        for c in cohort:
            seen.setdefault(c, []).append(k)
    return all(len(v) <= most and all(b - a >= bands for a, b in zip(v, v[1:], strict=False)) for v in seen.values())


# ------------------------------------------------------------------------------------------------- b = 1
def test_one_band_with_full_participation_is_todays_server_placement_run(tmp_path: Path) -> None:
    """r = n: b = 1, c_0 = 1, group = everyone: the same z, the same noise, the same trajectory, bit for bit."""
    today = run_batched(_cfg(tmp_path, "today", **{"clients-per-round": 12.0, "noise-placement": "server"}))
    banded = run_batched(_cfg(tmp_path, "banded", **{"clients-per-round": 12.0}, **BANDED))
    np.testing.assert_array_equal(_trajectory(today.directory), _trajectory(banded.directory))
    np.testing.assert_array_equal(today.weights, banded.weights)
    assert today.random_round == banded.random_round
    record = _config_json(banded.directory)["privacy"]["banded_mf"]
    assert record["bands"] == 1 and record["strategy_coefficients"] == [1.0] and record["denominator"] == 12.0
    assert (
        _config_json(banded.directory)["privacy"]["noise_multiplier"]
        == (_config_json(today.directory)["privacy"]["noise_multiplier"])
    )
    assert banded.epsilon == pytest.approx(today.epsilon, rel=1e-9)


# ------------------------------------------------------------------------------------------- both engines
def test_engines_and_virtual_clients_give_one_trajectory_and_ask_only_the_rule(tmp_path: Path) -> None:
    """b = 4 cyclic groups: batched == Flower (one client per node) == Flower (4 clients per node), and the
    messages the grid carried name only clients the (k, b) rule allows."""
    batched = run_batched(_cfg(tmp_path, "batched", **BANDED)).directory
    single_cfg = _cfg(tmp_path, "single", **BANDED)
    single_grid = InProcessGrid(client_app, 12, single_cfg.to_run_config())
    single = server_app.run(single_grid, single_cfg).directory
    virtual_cfg = _cfg(tmp_path, "virtual", **BANDED, **{"clients-per-node": 4})
    virtual_grid = InProcessGrid(client_app, virtual_cfg.num_nodes, virtual_cfg.to_run_config())
    virtual = server_app.run(virtual_grid, virtual_cfg).directory
    for other in (single, virtual):
        np.testing.assert_allclose(_trajectory(other), _trajectory(batched), rtol=1e-6, atol=1e-9)
    record = _config_json(batched)["privacy"]["banded_mf"]
    assert record["bands"] == 4 and record["participation"] == "cyclic" and record["max_participations"] == 3
    nodes = {nid: [ctx.node_config["partition-id"]] for nid, ctx in single_grid.contexts.items()}
    schedule = _asked(single_grid, nodes)
    assert schedule == [list(range(k % 4, 12, 4)) for k in range(10)]  # group k mod b, client i in group i mod b
    assert _rule_holds(schedule, 4, 3)
    assert _asked(virtual_grid, {}) == schedule
    assert np.linalg.norm(_trajectory(batched)[-1] - _trajectory(batched)[0]) > 1e-3  # the run moved


def test_reported_epsilon_is_the_gaussian_dp_epsilon_of_the_recorded_numbers(tmp_path: Path) -> None:
    """config.json alone gives epsilon: mu = sensitivity / noise_std, and the sensitivity is the dense C's."""
    result = run_batched(_cfg(tmp_path, "run", **BANDED, **{"num-rounds": 11, "epsilon": 3.0}))
    saved = _config_json(result.directory)
    record = saved["privacy"]["banded_mf"]
    exact = _gdp_epsilon(record["sensitivity"] / record["noise_std"], record["delta"])
    assert exact <= result.epsilon == saved["final"]["epsilon"] <= exact + 2e-3
    assert result.epsilon <= 3.0
    col = np.zeros(11)
    col[: record["bands"]] = record["strategy_coefficients"]
    c = toeplitz(col, np.zeros(11))
    worst = c[:, 0 : record["bands"] * record["max_participations"] : record["bands"]]  # rounds 0, b, 2b
    assert record["sensitivity"] == pytest.approx(record["clip"] * np.linalg.norm(worst), rel=1e-12)
    assert record["noise_std"] == pytest.approx(saved["privacy"]["noise_multiplier"] * record["clip"], rel=1e-12)


# ---------------------------------------------------------------------------------------- the server's gate
def test_min_separation_asks_only_connected_rested_clients(tmp_path: Path) -> None:
    """Nodes come and go: the cohort is the connected clients whose last turn is >= b rounds ago."""

    class FlakyGrid(InProcessGrid):
        calls = 0

        def get_node_ids(self):
            FlakyGrid.calls += 1
            ids = sorted(super().get_node_ids())
            rng = np.random.default_rng(FlakyGrid.calls)
            return [nid for nid in ids if rng.random() < 0.7]

    cfg = _cfg(tmp_path, "flaky", **BANDED, **{"participation": "min-separation", "bands": 3,
                                                 "max-participations": 2})  # fmt: skip
    grid = FlakyGrid(client_app, 12, cfg.to_run_config())
    result = server_app.run(grid, cfg)
    nodes = {nid: [ctx.node_config["partition-id"]] for nid, ctx in grid.contexts.items()}
    schedule = _asked(grid, nodes)
    assert _rule_holds(schedule, 3, 2) and sum(map(len, schedule)) > 0
    assert result.epsilon <= 4.0


def test_a_reply_from_outside_the_cohort_is_rejected(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "rogue", **BANDED)
    grid = InProcessGrid(client_app, 12, cfg.to_run_config(), shuffle_replies=False)
    strategy = DPFedAvg(cfg, 12, setup=PrivacySetup.resolve(cfg))
    w0 = np.zeros(12)
    messages = list(strategy.configure_train(1, to_array_record(w0), ConfigRecord(), grid))
    cohort = {strategy.federation.partition_of_node[m.metadata.dst_node_id] for m in messages}
    assert cohort == {0, 4, 8}  # group 0
    outsider = next(nid for nid, pid in strategy.federation.partition_of_node.items() if pid not in cohort)
    rogue = Message(messages[0].content, dst_node_id=outsider, message_type=messages[0].metadata.message_type)
    replies = list(grid.send_and_receive(messages + [rogue]))
    assert len(replies) == 4
    strategy.aggregate_train(1, replies)
    stats = strategy.history[1]
    assert stats.num_received == 3 and stats.num_rejected == 1
    assert "not sampled" in stats.rejected_reasons[0]


# ------------------------------------------------------------------------------------------------ resume
class _Crash(RuntimeError):
    pass


def test_resume_is_bit_identical_and_refuses_another_strategy(tmp_path: Path) -> None:
    values = {**BANDED, "num-rounds": 12, "checkpoint-every": 5}
    full = run_batched(_cfg(tmp_path / "full", "run", **values)).directory

    def crash(server_round: int, w: np.ndarray) -> None:
        if server_round == 8:
            raise _Crash

    cfg = _cfg(tmp_path / "cut", "run", **values)
    with pytest.raises(_Crash):
        run_batched(cfg, on_round=crash)
    saved = load_checkpoint(tmp_path / "cut" / "run")
    assert saved.round == 5 and saved.server.mechanism["stream/history"].shape == (3, 12)
    assert saved.server.mechanism["tracker/cohort_sizes"].sum() == 5 * 3
    resumed = run_batched(cfg.replace(resume=True)).directory
    np.testing.assert_array_equal(_trajectory(resumed), _trajectory(full))
    assert _config_json(resumed)["final"]["epsilon"] == _config_json(full)["final"]["epsilon"]
    with pytest.raises(ConfigError, match="strategy-coefficients"):
        run_batched(cfg.replace(resume=True, strategy_coefficients="1.0, 0.4, 0.3, 0.2"))


def test_every_round_releases_correlated_noise_even_when_nobody_replies(tmp_path: Path) -> None:
    """Group 1's clients never answer: its rounds release noise only, the stream stays aligned, epsilon as planned."""

    def silent_group_one(msg: Message, context: Context):
        silent = msg.metadata.message_type == "train" and int(context.node_config["partition-id"]) % 4 == 1
        return None if silent else client_app(msg, context)

    cfg = _cfg(tmp_path, "silent", **BANDED)
    result = server_app.run(InProcessGrid(silent_group_one, 12, cfg.to_run_config()), cfg)
    rows = result.history[1:]
    assert [int(r["num_received"]) for r in rows] == [0 if k % 4 == 1 else 3 for k in range(10)]
    assert result.epsilon == pytest.approx(plan_for(cfg).nominal_epsilon, rel=1e-12)
    moved = np.diff(_trajectory(result.directory), axis=0)
    assert np.all(np.linalg.norm(moved[1::4], axis=1) > 0)  # an empty round still moves the model (noise)


def test_budget_stops_before_the_round_that_would_exceed_it(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "budget", **BANDED, **{"epsilon": 0.0, "noise-multiplier": 3.0, "max-epsilon": 2.0})
    result = run_batched(cfg)
    stop = result.stopped_by_budget_before_round
    assert stop is not None and 1 < stop <= 10 and result.epsilon <= 2.0


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"bands": 0}, r"'bands' = 0: expected an integer in \[1, num-rounds\]"),
        ({"bands": 11}, r"'bands' = 11 exceeds 'num-rounds' = 10"),
        ({"bands": 5}, r"'clients-per-round' = 3 with bands = 5: .* allowed bands <= 4"),
        ({"noise-placement": "client-calibrated"}, r"'noise-placement' = 'client-calibrated' .* allowed: .*'server'"),
        ({"algorithm": "adaptive-clip"}, r"'algorithm' = 'adaptive-clip' .* allowed: a fixed-clip algorithm"),
        ({"secure-aggregation": True, "secure-noise": True}, r"'secure-aggregation' = True .* allowed: secure-agg"),
        ({"strategy-coefficients": "0, 1, 0.5, 0.2"}, r"'strategy-coefficients' = '0, 1, 0.5, 0.2': c_0 = 0 makes C"),
        ({"bands": 4, "strategy-coefficients": "1, 0.5"}, r"'strategy-coefficients' has 2 number\(s\) but 'bands' = 4"),
        ({"num-clients": 3, "clients-per-round": 0.5, "bands": 4},
         r"'num-clients' = 3 in bands = 4 cyclic groups leaves 0 client"),
        ({"max-participations": 2}, r"'max-participations' = 2 with participation = 'cyclic': .* allowed: >= 3"),
        ({"participation": "round-robin"}, r"'participation' = 'round-robin': allowed values are 'cyclic'"),
    ],
)  # fmt: skip
def test_bad_banded_settings_raise_one_config_error_before_anything_runs(
    tmp_path: Path, values: dict, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        _cfg(tmp_path, "bad", **{**BANDED, **values})
    assert str(err.value).count("invalid run config") == 1
    assert not (tmp_path / "bad").exists()


def test_banded_keys_with_independent_noise_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'bands' = 4 with 'noise-mechanism' = 'independent'"):
        _cfg(tmp_path, "bad", bands=4)


# ----------------------------------------------------------------------------------------------- the auditor
def _audit_setting(epsilon: float, **kwargs):
    from dpfedavg.core.banded_mf import sqrt_prefix_coefficients
    from dpfedavg.core.participation import ParticipationRule
    from dpfedavg.privacy.audit_banded import BandedAuditSetting
    from dpfedavg.privacy.banded_mf_accounting import calibrate_noise_std

    coefs, rounds = sqrt_prefix_coefficients(4), 12
    z = calibrate_noise_std(epsilon, ParticipationRule("min-separation", 2, 4, rounds), coefs, clip=1.0, delta=1e-5)
    cls = kwargs.pop("cls", BandedAuditSetting)
    return cls(coefs, rounds, z, delta=1e-5, **kwargs)


def test_audit_of_a_min_separated_canary_stays_below_the_reported_epsilon() -> None:
    """Canary in rounds 0, 4, 8 (the rule's worst pattern): the lower bound (95%) is below the reported epsilon,
    which equals the canary's exact Gaussian DP epsilon (computed from a dense C, not the accountant)."""
    from dpfedavg.privacy.audit_banded import run_banded_audit

    setting = _audit_setting(2.0)
    assert setting.canary_rounds == (0, 4, 8)
    result = run_banded_audit(setting, 20000, seed=3)
    assert result.epsilon_reported == pytest.approx(result.epsilon_exact, abs=2e-3)
    assert 0.5 < result.epsilon_lower_bound <= result.epsilon_reported <= 2.0


def test_audit_catches_the_disjoint_columns_formula_on_participations_closer_than_b() -> None:
    """A deliberately mis-computed sensitivity: the closed form (columns >= b apart) applied to a canary that takes
    part every round. Its columns of C overlap, the true epsilon is about 4x the reported one, and the auditor's
    lower bound (95% confidence, 20000 trials per world, seed fixed) exceeds the reported epsilon."""
    from dpfedavg.core.participation import ParticipationError
    from dpfedavg.privacy.audit_banded import BandedAuditSetting, run_banded_audit

    with pytest.raises(ParticipationError, match="1 apart"):  # the honest setting refuses the pattern
        _audit_setting(1.0, canary_rounds=tuple(range(12)))

    class MisAccounted(BandedAuditSetting):
        def _check_pattern(self) -> None:  # reports the closed form whatever the pattern
            pass

    setting = _audit_setting(1.0, canary_rounds=tuple(range(12)), cls=MisAccounted)
    result = run_banded_audit(setting, 20000, seed=3)
    assert result.epsilon_reported <= 1.0 < 3.0 < result.epsilon_exact
    assert result.epsilon_lower_bound > 1.5 * result.epsilon_reported


def test_run_sim_audit_banded_mf(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, str(root / "run_sim.py"), "audit", "--mechanism", "banded-mf", "--bands", "3", "--rounds",
         "9", "--epsilon", "2", "--trials", "2000", "--json"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    report = json.loads(out)
    assert report["canary_rounds"] == [0, 3, 6] and report["epsilon_lower_bound"] <= report["epsilon_reported"] <= 2.0


# -------------------------------------------------------------------------------------------- the comparison
def test_the_comparison_grid_runs_each_mechanism_at_the_same_epsilon(tmp_path: Path) -> None:
    from dpfedavg.experiments.mechanisms import run_mechanisms

    outputs = run_mechanisms(tmp_path, progress=False, settings=["synthetic"], algorithms=["norm"], epsilons=[5.0],
                             seeds=1, rounds=4)  # fmt: skip
    rows = list(__import__("csv").DictReader(outputs["csv"].open()))
    assert [r["mechanism"] for r in rows] == ["independent", "banded-mf", "banded-mf-poisson"]
    assert [r["bands"] for r in rows] == ["", "4", "2"]  # b = n / r groups; cyclic Poisson: n / 2r, p = 0.5
    assert all(float(r["epsilon_spent"]) <= 5.0 for r in rows)
    assert "| banded-mf | norm |" in outputs["table"].read_text() and outputs["plot"].stat().st_size > 0


def test_banded_runs_in_one_sweep_batch_equal_their_runs_one_at_a_time(tmp_path: Path) -> None:
    """A sweep runs cells as batches (runs sharing a round's clients); each run keeps its own gate and stream."""
    from dpfedavg.experiments.sweep import make_cell, run_cells

    base = {"task": "quadratic", "dim": 12, "num-clients": 12, "clients-per-round": 3.0, "num-rounds": 8,
            "save-trajectory": True, "seed": 1, **BANDED}  # fmt: skip
    cells = [make_cell(tmp_path / "batch", f"eps{e:g}", {**base, "epsilon": e}) for e in (2.0, 5.0)]
    run_cells(cells, jobs=1, progress=False)
    for cell in cells:
        alone = run_batched(cell.cfg.replace(output_dir=str(tmp_path / "alone"))).directory
        np.testing.assert_array_equal(_trajectory(alone), _trajectory(cell.directory))
