"""The batched engine against the Flower engine, sweeps (resume, determinism) and run_sim's outputs."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpfedavg.config import RunConfig
from dpfedavg.engines.batched import run_batched
from dpfedavg.experiments.sweep import cell_done, make_cell, run_cells
from dpfedavg.experiments.synthetic import SYNTHETIC_COLUMNS
from dpfedavg.experiments.table1 import TABLE1_COLUMNS, markdown
from dpfedavg.flower import server_app
from dpfedavg.flower.client_app import app as client_app
from dpfedavg.flower.testing import InProcessGrid
from dpfedavg.io.results import read_metrics

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "quadratic-noise": {"task": "quadratic", "dim": 40, "num-clients": 12, "clients-per-round": 5.0,
                        "server-momentum": 0.5, "epsilon": 3.0, "algorithm": "norm"},
    "quadratic-no-noise": {"task": "quadratic", "dim": 40, "num-clients": 12, "clients-per-round": 12.0,
                           "epsilon": 0.0, "noise-multiplier": 0.0, "algorithm": "clip", "clip": 5.0},
    "digits-noise": {"task": "digits", "num-clients": 30, "clients-per-round": 12.0, "local-lr": 0.05,
                     "lr-decay": 0.95, "epsilon": 3.0, "algorithm": "clip", "clip": 1.0, "diagnostics": True},
    "digits-server-noise": {"task": "digits", "num-clients": 30, "clients-per-round": 30.0, "local-lr": 0.05,
                            "epsilon": 0.0, "noise-multiplier": 2.0, "noise-placement": "server"},
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_engine_gives_the_flower_strategy_trajectory(case: str, tmp_path: Path) -> None:
    """One seed, both engines (the real ClientApp and strategy, in process): the same trajectory."""
    values = {"num-rounds": 8, "seed": 4, "cache-dir": str(tmp_path / "cache"), "output-dir": str(tmp_path),
              "save-trajectory": True, **CASES[case]}  # fmt: skip
    cfg_b = RunConfig.from_run_config({**values, "run-name": "batched"})
    cfg_f = RunConfig.from_run_config({**values, "run-name": "flower"})
    out_b = run_batched(cfg_b).directory
    out_f = server_app.run(InProcessGrid(client_app, cfg_f.num_clients, cfg_f.to_run_config()), cfg_f).directory
    traj_b, traj_f = np.load(out_b / "trajectory.npy"), np.load(out_f / "trajectory.npy")
    assert traj_b.shape == (9, traj_f.shape[1])
    np.testing.assert_allclose(traj_b, traj_f, rtol=1e-6, atol=1e-7)
    model_b, model_f = np.load(out_b / "model.npz"), np.load(out_f / "model.npz")
    np.testing.assert_allclose(model_b["w_final"], model_f["w_final"], rtol=1e-6, atol=1e-12)
    assert int(model_b["random_iterate_round"]) == int(model_f["random_iterate_round"])
    final_b = json.loads((out_b / "config.json").read_text())["final"]
    final_f = json.loads((out_f / "config.json").read_text())["final"]
    assert final_b["epsilon"] == pytest.approx(final_f["epsilon"], rel=1e-12)
    eps_b, eps_f = ([row["epsilon"] for row in read_metrics(out / "metrics.csv")[1:]] for out in (out_b, out_f))
    assert not np.isnan(eps_b).any() and eps_b == pytest.approx(eps_f, rel=1e-12)  # every round, every engine
    assert np.linalg.norm(traj_f[-1] - traj_f[0]) > 1e-3  # the run moved


# --------------------------------------------------------------------- sweeps
def _cells(out: Path, rounds: int = 3) -> list:
    base = {"num-clients": 10, "clients-per-round": 10.0, "dim": 20, "num-rounds": rounds, "epsilon": 2.0}
    return [make_cell(out, f"cell-{s}", {**base, "seed": s}) for s in range(3)]


def test_sweep_resumes_and_reruns_only_missing_or_stale_cells(tmp_path: Path, monkeypatch) -> None:
    import dpfedavg.experiments.sweep as sweep

    ran: list[str] = []
    real = sweep._run_unit  # every unit of work (a batch of cells, or a cell alone) goes through it
    monkeypatch.setattr(
        sweep, "_run_unit", lambda cfgs, *a, **k: ran.extend(c.run_name for c in cfgs) or real(cfgs, *a, **k)
    )
    cells = _cells(tmp_path)
    run_cells(cells, jobs=1, progress=False)
    assert sorted(ran) == ["cell-0", "cell-1", "cell-2"] and all(cell_done(c) for c in cells)
    ran.clear()
    run_cells(cells, jobs=1, progress=False)
    assert ran == []  # everything done: nothing reruns
    (cells[1].directory / "config.json").unlink()  # a cell killed before it finished
    run_cells(cells, jobs=1, progress=False)
    assert ran == ["cell-1"]
    ran.clear()
    longer = _cells(tmp_path, rounds=4)  # the grid changed: old results are stale
    assert not any(cell_done(c) for c in longer)
    run_cells(longer[:1], jobs=1, progress=False)
    assert ran == ["cell-0"]


def test_parallel_sweep_is_deterministic(tmp_path: Path) -> None:
    serial, parallel = _cells(tmp_path / "serial"), _cells(tmp_path / "parallel")
    run_cells(serial, jobs=1, progress=False)
    run_cells(parallel, jobs=2, progress=False)
    for a, b in zip(serial, parallel, strict=True):
        np.testing.assert_array_equal(np.load(a.directory / "model.npz")["w_final"],
                                      np.load(b.directory / "model.npz")["w_final"])  # fmt: skip


# -------------------------------------------------------------------- run_sim
def _run_sim(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "run_sim.py"), *args], capture_output=True, text=True,
                          timeout=900, cwd=cwd)  # fmt: skip


def test_run_sim_synthetic_small_grid(tmp_path: Path) -> None:
    out = tmp_path / "syn"
    args = ["synthetic", "--C", "50", "--init", "I1", "--eta", "0.003", "--seeds", "2", "--rounds", "12",
            "--algorithms", "clip", "norm", "adaptive-clip", "--out", str(out), "--jobs", "2",
            "--no-progress"]  # fmt: skip
    result = _run_sim(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    with (out / "synthetic.csv").open() as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
    assert tuple(reader.fieldnames) == SYNTHETIC_COLUMNS
    assert len(rows) == 3 * 2 * 13  # algorithms x seeds x (K + 1 rounds)
    assert {r["algorithm"] for r in rows} == {"clip", "norm", "adaptive-clip"}
    assert all(float(r["snr"]) > 0 for r in rows if r["round"] != "0")
    assert len({r["C_k"] for r in rows if r["algorithm"] == "adaptive-clip" and r["round"] != "0"}) > 1
    assert "adaptive: f - f*" in (out / "summary.md").read_text()
    for name in ("figure1.png", "figure2.png", "figure3.png", "adaptive.png", "summary.md"):
        assert (out / name).stat().st_size > 0
    again = _run_sim(*args, cwd=tmp_path)  # a finished sweep reruns nothing
    assert again.returncode == 0 and "done in" in again.stdout


def test_run_sim_table1_digits_small_grid(tmp_path: Path) -> None:
    out = tmp_path / "t1"
    args = ["table1", "--dataset", "digits", "--epsilon", "5", "--clip", "62.5", "15.625", "--lr", "0.032",
            "--seeds", "1", "--rounds", "10", "--out", str(out), "--cache-dir", str(tmp_path / "cache"),
            "--jobs", "1", "--no-progress", "--algorithms", "clip", "norm", "adaptive-clip"]  # fmt: skip
    result = _run_sim(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    with (out / "table1.csv").open() as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
    assert tuple(reader.fieldnames) == TABLE1_COLUMNS
    assert len(rows) == 3 * 2 + 1  # (clip, norm, adaptive-clip) x 2 C + FedAvg
    assert all(0.0 <= float(r["last5_test_accuracy"]) <= 1.0 for r in rows)
    table = (out / "table1.md").read_text()
    assert "| Clipping |" in table and "| Normalization |" in table and "| FedAvg (w/o privacy) |" in table
    assert "| Adaptive clipping (C = C_0) |" in table and (out / "curves.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["synthetic", "--C", "-1"], "--C = -1.0"),
        (["synthetic", "--init", "I3"], "--init = 'I3'"),
        (["synthetic", "--seeds", "0"], "--seeds = 0"),
        (["table1", "--dataset", "digits", "--lr", "-0.1"], "--lr = -0.1"),
        (["table1", "--dataset", "digits", "--engine", "flower", "--jobs", "2"], "--jobs 1"),
        (["synthetic", "--ray-address", "127.0.0.1:1"], "--ray-address 127.0.0.1:1: nothing answers there"),
        (["table1", "--dataset", "digits", "--ray-address", "headnode"], "expected HOST:PORT"),
        (["synthetic", "--engine", "flower", "--jobs", "1", "--ray-address", "auto"], "--engine batched"),
    ],
)
def test_run_sim_rejects_bad_flags_before_running(args: list[str], fragment: str, tmp_path: Path) -> None:
    result = _run_sim(*args, "--out", str(tmp_path / "x"), cwd=tmp_path)
    assert result.returncode == 2 and fragment in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "x" / "runs").exists()


def test_ray_address_without_ray_is_one_clear_error(monkeypatch) -> None:
    from dpfedavg.experiments.sweep import SweepError, check_ray_address

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(SweepError, match="--ray-address needs ray"):
        check_ray_address("127.0.0.1:6379")


def test_table1_markdown_layout_has_the_paper_beside_ours() -> None:
    best = {("clip", 5.0): (0.7, 0.01, 62.5, 0.016, 3), ("norm", 5.0): (0.75, 0.02, 31.25, 0.032, 3),
            ("none", float("inf")): (0.8, 0.0, float("nan"), 0.064, 3)}  # fmt: skip
    table = markdown("fmnist", best, [5.0], 100)
    assert "70.00% ± 1.00 (C = 62.5, eta0 = 0.016) | 75.59%" in table
    assert "75.00% ± 2.00 (C = 31.25, eta0 = 0.032) | 77.72%" in table
    assert "80.00% ± 0.00 (eta0 = 0.064) | 83.43%" in table


def test_batched_engine_threads_do_not_change_the_result(tmp_path: Path) -> None:
    values = {"num-rounds": 4, "seed": 2, "cache-dir": str(tmp_path / "cache"), "output-dir": str(tmp_path),
              **CASES["digits-noise"]}  # fmt: skip
    models = []
    for threads in (1, 3):
        cfg = RunConfig.from_run_config({**values, "run-name": f"t{threads}"})
        models.append(np.load(run_batched(cfg, threads=threads).directory / "model.npz")["w_final"])
    np.testing.assert_array_equal(models[0], models[1])
