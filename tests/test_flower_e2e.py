"""End-to-end: the real `flwr run` CLI, a local SuperLink and the Ray simulation engine.

Slow (each run starts a Ray simulation, ~15-25 s); marked ``slow`` and run in CI.
"""

from __future__ import annotations

import csv
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
from reference import run_reference_for

from dpfedavg.config import RunConfig
from dpfedavg.engines.batched import run_batched
from dpfedavg.engines.local_superlink import LocalSuperLink

#: Each xdist worker that runs some of these tests starts its own private SuperLink (4-5 s): the runs spread
#: over the workers instead of queueing on one (about 8 minutes of them).
pytestmark = pytest.mark.slow

REQUIRED_COLUMNS = ("round", "num_sampled", "suboptimality", "snr", "dist_to_opt", "frac_clipped", "epsilon")
SMALL_FED = "num-supernodes=10 client-resources-num-cpus=1"


@pytest.fixture(scope="module")
def superlink(tmp_path_factory: pytest.TempPathFactory):
    link = LocalSuperLink(tmp_path_factory.mktemp("superlink"))
    link.start()
    try:
        yield link
    finally:
        link.stop()
        assert link.leftover_pids() == [], "processes survived stop()"


def _overrides(values: dict) -> str:
    parts = []
    for key, value in values.items():
        if isinstance(value, str):
            parts.append(f"{key}='{value}'")
        elif isinstance(value, bool):
            parts.append(f"{key}={'true' if value else 'false'}")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


def _run(superlink: LocalSuperLink, tmp_path: Path, name: str, values: dict, federation: str = SMALL_FED):
    values = {"output-dir": str(tmp_path), "run-name": name, **values}
    result = superlink.flwr_run(_overrides(values), federation, run_dir=tmp_path / name)
    return result, tmp_path / name


def _rows(run_dir: Path) -> list[dict]:
    return list(csv.DictReader((run_dir / "metrics.csv").open()))


@pytest.mark.parametrize(
    ("noise", "per_node"), [(0.0, 1), (2.0, 1), (2.0, 4)], ids=["noise-off", "noise-on", "virtual-clients-noise-on"]
)
def test_flower_simulation_matches_numpy_reference_and_batched_engine(
    superlink: LocalSuperLink, tmp_path: Path, noise: float, per_node: int
) -> None:
    """10 clients, Poisson sampling, momentum: the Flower run equals plain numpy Alg. 1/2 and the batched engine.

    ``per_node = 4``: 3 SuperNodes hosting 4, 4 and 2 virtual clients, the same trajectory.
    """
    values = {
        "num-clients": 10,
        "clients-per-round": 6.0,
        "num-rounds": 4,
        "dim": 40,
        "seed": 11,
        "epsilon": 0.0,
        "noise-multiplier": noise,
        "server-momentum": 0.5,
        "lr-decay": 0.95,
        "algorithm": "norm",
        "clip": 30.0,
        "save-trajectory": True,
    }
    federation = SMALL_FED
    if per_node > 1:
        values["clients-per-node"] = per_node
        federation = "num-supernodes=3 client-resources-num-cpus=1"
    result, run_dir = _run(superlink, tmp_path, f"ref-{noise}-{per_node}", values, federation)
    assert (run_dir / "model.npz").exists(), result.stdout[-4000:]
    cfg = RunConfig.from_run_config(values)
    ref = run_reference_for(cfg)
    model = np.load(run_dir / "model.npz")
    np.testing.assert_allclose(model["w_final"], ref.w_final, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(model["w_random_iterate"], ref.w_random_iterate, rtol=1e-6, atol=1e-9)
    # the per-round trajectory too, through the logged distance to the optimum
    from dpfedavg.tasks import build_task

    task = build_task(cfg)
    dists = [float(r["dist_to_opt"]) for r in _rows(run_dir)]
    expected = [task.evaluate(w)["dist_to_opt"] for w in ref.trajectory]
    np.testing.assert_allclose(dists, expected, rtol=1e-6)
    # the batched engine, same seed: the same trajectory, round by round
    batched = run_batched(
        RunConfig.from_run_config({**values, "output-dir": str(tmp_path), "run-name": "batched"})
    ).directory
    np.testing.assert_allclose(
        np.load(batched / "trajectory.npy"), np.load(run_dir / "trajectory.npy"), rtol=1e-6, atol=1e-6
    )


def test_secure_aggregation_in_the_ray_simulation_equals_the_clear_sum(
    superlink: LocalSuperLink, tmp_path: Path
) -> None:
    """SecAgg+ through Ray: the model equals the batched engine summing the same encoded updates in the clear."""
    values = {
        "num-clients": 10,
        "clients-per-round": 6.0,
        "num-rounds": 3,
        "dim": 40,
        "seed": 4,
        "epsilon": 0.0,
        "noise-multiplier": 1.0,
        "algorithm": "clip",
        "clip": 30.0,
        "server-momentum": 0.5,
        "secure-aggregation": True,
        "secagg-num-shares": 5.0,
    }
    result, run_dir = _run(superlink, tmp_path, "secagg", values)
    assert (run_dir / "model.npz").exists(), result.stdout[-4000:]
    assert "Secure aggregation completed" in result.stdout
    rows = _rows(run_dir)[1:]
    assert all(int(r["skipped"]) == 0 and int(r["num_received"]) == int(r["num_sampled"]) for r in rows)
    assert all(r["mean_update_norm"] == "" for r in rows)  # no per-client norm reaches the server
    batched = run_batched(
        RunConfig.from_run_config({**values, "output-dir": str(tmp_path), "run-name": "clear"})
    ).directory
    np.testing.assert_allclose(
        np.load(run_dir / "model.npz")["w_final"], np.load(batched / "model.npz")["w_final"], rtol=1e-12, atol=1e-12
    )


def test_default_run_smoke(superlink: LocalSuperLink, tmp_path: Path) -> None:
    """The README's default (quadratic, norm, C=50, I1, eta=0.003, n=r=100) for a few rounds."""
    t0 = time.monotonic()
    result, run_dir = _run(
        superlink, tmp_path, "default", {"num-rounds": 3}, "num-supernodes=100 client-resources-num-cpus=1"
    )
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    rows = _rows(run_dir)
    assert [int(r["round"]) for r in rows] == [0, 1, 2, 3]
    assert all(col in rows[0] for col in REQUIRED_COLUMNS)
    assert all(int(r["num_sampled"]) == 100 for r in rows[1:])  # full participation
    assert re.search(r"round 3/3 \| sampled 100, received 100 .* epsilon 4\.9", out)
    assert f"metrics in {run_dir / 'metrics.csv'}" in out.replace("\n", "")
    config = json.loads((run_dir / "config.json").read_text())
    assert config["run_config"]["algorithm"] == "norm" and config["run_config"]["clip"] == 50.0
    # (5, 1e-6) calibrated over the K = 3 rounds of this run: the epsilon column ends at <= 5
    epsilons = [float(r["epsilon"]) for r in rows[1:]]
    assert 4.9 < epsilons[-1] <= 5.0 and config["final"]["epsilon"] == epsilons[-1]
    assert time.monotonic() - t0 < 300


def test_no_dp_runs_and_says_so(superlink: LocalSuperLink, tmp_path: Path) -> None:
    """algorithm='none' through flwr run (clip is compared with the batched engine by the SecAgg+ test above)."""
    values = {"algorithm": "none", "clip": 50.0, "num-clients": 10, "clients-per-round": 10.0, "num-rounds": 2}
    result, run_dir = _run(superlink, tmp_path, "none", values)
    rows = _rows(run_dir)
    assert len(rows) == 3, result.stdout[-4000:]
    assert all(col in rows[0] for col in REQUIRED_COLUMNS)
    assert "NO DIFFERENTIAL PRIVACY" in result.stdout


def test_bad_config_is_one_error_line_without_traceback(superlink: LocalSuperLink, tmp_path: Path) -> None:
    result, run_dir = _run(superlink, tmp_path, "bad", {"algorithm": "clipp", "clip": -1.0, "num-clients": 10})
    errors = [line for line in result.stdout.splitlines() if "ERROR" in line]
    assert len(errors) == 1, result.stdout[-4000:]
    assert "'algorithm' = 'clipp'" in errors[0] and "'clip' = -1.0" in errors[0]
    assert "Traceback" not in result.stdout
    assert not run_dir.exists()


def test_wrong_number_of_supernodes_is_a_clear_error(superlink: LocalSuperLink, tmp_path: Path) -> None:
    result, run_dir = _run(
        superlink,
        tmp_path,
        "wrongsize",
        {"num-clients": 10, "clients-per-round": 10.0},
        "num-supernodes=3 client-resources-num-cpus=1",
    )
    errors = [line for line in result.stdout.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "num-supernodes=10" in errors[0], result.stdout[-4000:]
    assert "Traceback" not in result.stdout
    assert "the simulation has num-supernodes=3" in errors[0] and not run_dir.exists()  # before anything is written


def test_digits_task_runs_offline_far_above_chance(superlink: LocalSuperLink, tmp_path: Path) -> None:
    """A real dataset (scikit-learn's digits) end to end: DP-NormFedAvg at epsilon = 5, audited by 50 canaries."""
    values = {
        "task": "digits",
        "algorithm": "norm",
        "epsilon": 5.0,
        "num-rounds": 30,
        "eval-every": 10,
        "cache-dir": str(tmp_path / "cache"),
        "canary-clients": 50,
    }
    result, run_dir = _run(superlink, tmp_path, "digits", values, "num-supernodes=100 client-resources-num-cpus=1")
    assert (run_dir / "config.json").exists(), result.stdout[-4000:]
    final = json.loads((run_dir / "config.json").read_text())["final"]
    assert final["last5_test_accuracy"] > 0.5 and final["epsilon"] <= 5.0  # chance: 0.1
    assert "test_accuracy averaged over the last 5 evaluated rounds" in result.stdout
    rows = _rows(run_dir)
    assert rows[15]["test_accuracy"] == "" and rows[10]["test_accuracy"] != ""  # eval-every 10
    # the run audited itself: the canaries were sampled with the real clients (q = 1: all n + inserted each round)
    audit = final["audit"]
    assert audit["federation_clients"] == 100 + audit["inserted"] and audit["rounds_observed"] == 30
    assert all(int(r["num_sampled"]) == 100 + audit["inserted"] for r in rows[1:])
    assert audit["epsilon_accountant"] == final["epsilon"] and audit["epsilon_lower_bound"] <= final["epsilon"]
    assert "one-run lower bound" in result.stdout and (run_dir / "audit.png").stat().st_size > 0


def test_banded_mf_noise_through_flwr_run(superlink: LocalSuperLink, tmp_path: Path) -> None:
    """noise-mechanism='banded-mf' from the run config: b = n / r = 2 cyclic groups, config.json's record."""
    values = {"noise-mechanism": "banded-mf", "noise-placement": "server", "num-clients": 10,
              "clients-per-round": 5.0, "num-rounds": 4, "epsilon": 3.0}  # fmt: skip
    result, run_dir = _run(superlink, tmp_path, "banded", values)
    assert result.returncode == 0 and "Traceback" not in result.stdout, result.stdout[-4000:]
    rows = _rows(run_dir)
    assert [int(r["num_sampled"]) for r in rows[1:]] == [5, 5, 5, 5]  # the groups {0, 2, ..} and {1, 3, ..}
    record = json.loads((run_dir / "config.json").read_text())["privacy"]["banded_mf"]
    assert record["bands"] == 2 and record["strategy_coefficients"] == [1.0, 0.5] and record["max_participations"] == 2
    assert record["epsilon"] <= 3.0 and record["sensitivity"] > 0 and record["noise_std"] > 0
