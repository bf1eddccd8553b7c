"""Runs as a batch dimension (engines/batched_runs.py, core/runs.py): the same results as one run at a time.

The equivalence tests run small grids both ways, one cell at a time with `run_batched()` and as
batches through the sweep, and compare ``synthetic.csv`` / ``table1.csv`` (and every ``metrics.csv``
column) to 1e-9, for each algorithm, with q < 1, momentum, both noise placements a sweep uses and a
privacy budget that stops some runs early.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpfedavg.config import RunConfig
from dpfedavg.core import client_update, noise_rng, private_block_update
from dpfedavg.core.local import bound_block
from dpfedavg.core.runs import RunSums, released_sums, shared_standard_normals
from dpfedavg.engines.batch_plan import BatchMemoryError, batch_bytes, parse_memory, plan_batches
from dpfedavg.engines.batched import run_batched
from dpfedavg.engines.batched_runs import BatchError, batch_key, run_batch, unbatchable_reason
from dpfedavg.experiments import synthetic, table1
from dpfedavg.experiments.adaptive import adaptive_values
from dpfedavg.experiments.sweep import make_cell, plan_units, run_cells
from dpfedavg.tasks import build_task
from dpfedavg.tasks.quadratic import local_steps_gain

ROOT = Path(__file__).resolve().parents[1]
RTOL = 1e-9


def _rows(path: Path) -> list[dict]:
    with path.open() as fh:
        return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in csv.DictReader(fh)]


def _assert_close_rows(a: list[dict], b: list[dict], what: str) -> None:
    """Every field equal, numbers to RTOL (relative; 1e-12 absolute near 0)."""
    assert len(a) == len(b), what
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys(), what
        for key in ra:
            x, y = ra[key], rb[key]
            if x == y:
                continue
            fx, fy = float(x), float(y)  # a number that differs in its last digits
            assert math.isclose(fx, fy, rel_tol=RTOL, abs_tol=1e-12), (
                f"{what}: {key} = {x} vs {y} (round {ra.get('round')})"
            )


def _one_at_a_time(cells) -> None:
    for cell in cells:
        run_batched(cell.cfg, threads=1)


def _assert_same_runs(alone, batched) -> None:
    for a, b in zip(alone, batched, strict=True):
        _assert_close_rows(_rows(a.directory / "metrics.csv"), _rows(b.directory / "metrics.csv"), a.key)
        ma, mb = np.load(a.directory / "model.npz"), np.load(b.directory / "model.npz")
        np.testing.assert_allclose(ma["w_final"], mb["w_final"], rtol=RTOL, atol=1e-12)
        assert int(ma["random_iterate_round"]) == int(mb["random_iterate_round"])
        fa = json.loads((a.directory / "config.json").read_text())["final"]
        fb = json.loads((b.directory / "config.json").read_text())["final"]
        assert fa["epsilon"] == fb["epsilon"] and fa["rounds_completed"] == fb["rounds_completed"]
        assert fa["stopped_by_budget_before_round"] == fb["stopped_by_budget_before_round"]


# ------------------------------------------------------------------------------------ equivalence
def test_synthetic_grid_as_batches_equals_one_run_at_a_time(tmp_path: Path) -> None:
    """The paper's grid, every algorithm (clip, norm, adaptive-clip): synthetic.csv equal to 1e-9."""
    grid = {"clips": (40.0, 100.0), "inits": ("I1", "I2"), "etas": (0.003,), "seeds": 1, "rounds": 5}
    alone = synthetic.synthetic_cells(tmp_path / "alone", **grid)
    batched = synthetic.synthetic_cells(tmp_path / "batched", **grid)
    units = plan_units(batched)
    assert len(units) == 1 and units[0][1] and len(units[0][0]) == len(batched)  # one batch of 12 runs
    _one_at_a_time(alone)
    run_cells(batched, jobs=1, progress=False)
    a = synthetic.collect(alone, tmp_path / "alone.csv")
    b = synthetic.collect(batched, tmp_path / "batched.csv")
    _assert_close_rows([{k: str(v) for k, v in r.items()} for r in a], [{k: str(v) for k, v in r.items()} for r in b],
                       "synthetic.csv")  # fmt: skip
    _assert_same_runs(alone, batched)


def _quadratic_cells(out: Path) -> list:
    """q < 1, momentum, three algorithms, two placements, two seeds, a budget that stops some runs early."""
    base = {"task": "quadratic", "num-clients": 20, "clients-per-round": 7.0, "dim": 30, "num-rounds": 10,
            "local-steps": 5, "server-momentum": 0.5, "delta": 1e-5, "epsilon": 3.0}  # fmt: skip
    cells = []
    for seed in (0, 1):
        for alg in ("clip", "norm", "adaptive-clip"):
            for c, lr in ((2.0, 0.05), (8.0, 0.02)):
                for extra in ({}, {"noise-placement": "server", "diagnostics": True}, {"max-epsilon": 2.0}):
                    key = f"{alg}-C{c:g}-lr{lr:g}-s{seed}-{len(extra)}{''.join(extra)[:6]}"
                    values = {**base, **extra, "algorithm": alg, "clip": c, "local-lr": lr, "seed": seed}
                    if alg == "adaptive-clip":  # sigma_b as the sweeps choose it (> z/2)
                        values = adaptive_values({**values, "algorithm": "clip"})
                    cells.append(make_cell(out, key, values))
    return cells


def test_quadratic_runs_with_partial_participation_equal_one_at_a_time(tmp_path: Path) -> None:
    alone, batched = _quadratic_cells(tmp_path / "alone"), _quadratic_cells(tmp_path / "batched")
    units = plan_units(batched)
    assert all(batched_ for _, batched_ in units) and len(units) == 2  # one batch per seed (data depend on it)
    _one_at_a_time(alone)
    run_cells(batched, jobs=1, progress=False)
    _assert_same_runs(alone, batched)
    stopped = [json.loads((c.directory / "config.json").read_text())["final"] for c in batched]
    assert any(f["stopped_by_budget_before_round"] for f in stopped)  # the budget stopped some runs mid-batch
    assert any(f["rounds_completed"] == 10 for f in stopped)


def test_table1_digits_grid_as_batches_equals_one_run_at_a_time(tmp_path: Path) -> None:
    """Logistic regression's closed form over runs: table1.csv equal to 1e-9 (q = 0.2, momentum, lr decay)."""
    grid = {"epsilons": (5.0,), "clips": (62.5, 15.625), "lrs": (0.032, 0.008), "seeds": 1, "rounds": 5,
            "cache_dir": str(tmp_path / "cache")}  # fmt: skip
    alone = table1.table1_cells(tmp_path / "alone", "digits", **grid)
    batched = table1.table1_cells(tmp_path / "batched", "digits", **grid)
    _one_at_a_time(alone)
    run_cells(batched, jobs=1, progress=False)
    a = table1.collect(alone, "digits", tmp_path / "alone.csv")
    b = table1.collect(batched, "digits", tmp_path / "batched.csv")
    _assert_close_rows([{k: str(v) for k, v in r.items()} for r in a], [{k: str(v) for k, v in r.items()} for r in b],
                       "table1.csv")  # fmt: skip
    _assert_same_runs(alone, batched)


def test_private_tuning_trials_share_a_batch_across_seeds(tmp_path: Path) -> None:
    """A fixed data-seed (tuning's trials): runs with different seeds share the data, so one batch holds them."""
    base = {"task": "digits", "num-clients": 30, "clients-per-round": 9.0, "num-rounds": 4, "data-seed": 0,
            "epsilon": 0.0, "noise-multiplier": 1.2, "cache-dir": str(tmp_path / "cache")}  # fmt: skip

    def cells(out: Path) -> list:
        return [make_cell(out, f"t{s}", {**base, "seed": s, "clip": 1.0 + s, "local-lr": 0.02}) for s in range(4)]

    alone, batched = cells(tmp_path / "alone"), cells(tmp_path / "batched")
    units = plan_units(batched)
    assert len(units) == 1 and len(units[0][0]) == 4
    _one_at_a_time(alone)
    run_cells(batched, jobs=1, progress=False)
    _assert_same_runs(alone, batched)


# ------------------------------------------------------------------------------------ the pieces
def test_shared_draws_are_each_clients_own_noise() -> None:
    """Row b is client b's stream; a longer draw (adaptive-clip's d + 1) starts with the shorter one."""
    ids = np.array([0, 3, 7])
    long, short = shared_standard_normals(12345, ids, 11), shared_standard_normals(12345, ids, 10)
    np.testing.assert_array_equal(long[:, :10], short)
    for row, cid in zip(long, ids, strict=True):
        np.testing.assert_array_equal(row * 2.5, noise_rng(12345, int(cid)).standard_normal(11) * 2.5)


def test_released_sums_equal_the_client_pipeline() -> None:
    """Per run: private_block_update's noisy replies summed in client order, NaN rows left out.

    The sums are formed otherwise (``sum_i f_i u_i`` as a product, the noise as ``s sum_i z_i``:
    core.runs._accumulate), so they are the same sums rounded differently: equal to 1e-12 of their largest entry.
    Leaving a diverged client's row or normals in its run's sum, or scaling a run's normals by another run's std,
    is off by about 1 (an update or the std times a normal).
    """
    rng = np.random.default_rng(0)
    runs, clients, d = 5, 6, 4
    u = rng.normal(size=(runs, clients, d)) * 3
    u[1, 2, 0] = np.nan  # run 1's client 2 diverged
    u[3, 4, 1] = np.nan  # run 3's client 4 too, in a noised run: its normals leave run 3's sum only
    ids = np.array([1, 2, 4, 5, 8, 9])
    algorithms = ["clip", "clip", "norm", "adaptive-clip", "adaptive-clip"]
    clips, stds = np.array([1.0, 2.0, 3.0, 1.5, 4.0]), np.array([0.7, 0.0, 1.1, 0.9, 0.3])
    scales = np.array([0.0, 0.0, 0.0, 2.0, 5.0])
    normals = shared_standard_normals(99, ids, d + 1)

    def blocks(*cuts: int) -> RunSums:  # the round's clients in blocks, added to one `into` after the other
        into = RunSums.zeros([d, d, d, d + 1, d + 1], [True] * runs)
        for lo, hi in zip((0, *cuts), (*cuts, clients), strict=True):
            released_sums(u[:, lo:hi], ids[lo:hi], algorithms=algorithms, clips=clips, noise_stds=stds,
                          count_scales=scales, normals=normals[lo:hi], into=into)  # fmt: skip
        return into

    for sums in (blocks(), blocks(2, 5)):
        _assert_equal_to_the_client_pipeline(sums, u, ids, algorithms, clips, stds, scales)


def _assert_equal_to_the_client_pipeline(sums, u, ids, algorithms, clips, stds, scales) -> None:
    runs, clients, d = u.shape
    for r in range(runs):
        updates = private_block_update(u[r], algorithm=algorithms[r], clip=clips[r], noise_std=stds[r],
                                       rngs=[noise_rng(99, int(i)) for i in ids], count_scale=scales[r])  # fmt: skip
        total, clean = np.zeros(d + (algorithms[r] == "adaptive-clip")), 0.0
        for upd in updates:
            if upd is not None:
                total += upd.noisy
                clean = clean + upd.clean
        np.testing.assert_allclose(sums.noisy[r], total, rtol=0, atol=1e-12 * np.abs(total).max())
        np.testing.assert_allclose(sums.clean[r], clean, rtol=0, atol=1e-12 * np.abs(clean).max())
        assert sums.failed[r] == {1: [4], 3: [8]}.get(r, [])  # client ids[2], ids[4]
        assert len(sums.update_norms(r)) == clients - (r in (1, 3))


def test_released_sums_take_runs_without_noise_beside_noised_ones_and_check_the_normals() -> None:
    """An adaptive-clip run with server noise (std 0) beside a noised clip run: the round's normals are d long
    (the noised vectors'), the adaptive run's d + 1 coordinates take none. Normals without a row per client
    are refused (fewer rows would sum less noise)."""
    rng = np.random.default_rng(4)
    u, ids, d = rng.normal(size=(2, 3, 4)) * 3, np.array([2, 5, 6]), 4
    args = dict(algorithms=["clip", "adaptive-clip"], clips=np.array([1.0, 2.0]), noise_stds=np.array([0.5, 0.0]),
                count_scales=np.array([0.0, 2.0]))  # fmt: skip
    sums = released_sums(u, ids, **args, normals=shared_standard_normals(7, ids, d),
                         into=RunSums.zeros([d, d + 1], [True, True]))  # fmt: skip
    np.testing.assert_array_equal(sums.noisy[1], sums.clean[1])  # no noise: its sum as it is
    clean = sum(upd.clean for upd in private_block_update(u[0], algorithm="clip", clip=1.0, noise_std=0.5,
                                                          rngs=[noise_rng(7, int(i)) for i in ids]))  # fmt: skip
    assert np.abs(sums.noisy[0] - clean).max() > 0.1  # the clip run is noised
    with pytest.raises(ValueError, match="one row of normals per client: 3 clients, 2 rows"):
        released_sums(u, ids, **args, normals=shared_standard_normals(7, ids[:2], d),
                      into=RunSums.zeros([d, d + 1], [True, True]))  # fmt: skip


def test_bound_block_takes_one_c_per_run() -> None:
    u = np.random.default_rng(1).normal(size=(3, 4, 5)) * 4
    clips = np.array([1.0, 2.0, 10.0])
    block = bound_block(u, algorithm="clip", clip=clips)
    for r in range(3):
        one = bound_block(u[r], algorithm="clip", clip=float(clips[r]))
        np.testing.assert_array_equal(block.g[r], one.g)
    with pytest.raises(ValueError, match="one C per run"):
        bound_block(u, algorithm="norm", clip=np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="must be > 0"):
        bound_block(u, algorithm="norm", clip=np.array([1.0, 0.0, 2.0]))


@pytest.mark.parametrize("task", ["quadratic", "digits"])
def test_runs_closed_forms_equal_the_local_steps(task: str, tmp_path: Path) -> None:
    """client_runs_update_fn: each run's u equals core.client_update on the task's gradients (1e-9)."""
    cfg = RunConfig.from_run_config({"task": task, "num-clients": 30, "clients-per-round": 30.0, "dim": 40,
                                     "cache-dir": str(tmp_path / "cache")})  # fmt: skip
    t = build_task(cfg)
    rng = np.random.default_rng(2)
    w = t.initial_weights() + rng.normal(size=t.dim) * 0.1
    weights = np.stack([w, w * 1.5, w - 0.2])
    lrs = np.array([0.003, 0.03, 0.01]) if task == "quadratic" else np.array([0.05, 0.01, 0.064])
    for ids in (np.array([0, 4, 5, 29]), np.arange(30)):
        u = t.client_runs_update_fn(ids)(weights, lrs, 7)
        assert u.shape == (3, len(ids), t.dim)
        for r in range(3):
            ref = client_update(np.repeat(weights[r][None], len(ids), 0), t.client_batch_grad_fn(ids), lrs[r], 7)
            np.testing.assert_allclose(u[r], ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())


@pytest.mark.parametrize("task", ["quadratic", "digits"])
def test_runs_update_rejects_a_bad_e_or_eta(task: str, tmp_path: Path) -> None:
    """Alg. 1 lines 5-7 need E >= 1 and every run's eta_k > 0: one clear error naming the value."""
    cfg = RunConfig.from_run_config({"task": task, "num-clients": 4, "clients-per-round": 4.0, "dim": 6,
                                     "cache-dir": str(tmp_path / "cache")})  # fmt: skip
    t = build_task(cfg)
    update = t.client_runs_update_fn(np.arange(4))
    w = np.stack([t.initial_weights()] * 2)
    with pytest.raises(ValueError, match="local-steps E must be >= 1, got 0"):
        update(w, np.array([0.01, 0.02]), 0)
    with pytest.raises(ValueError, match="eta_k must be > 0"):
        update(w, np.array([0.01, 0.0]), 3)


def test_local_steps_gain_limits() -> None:
    lam = np.array([[0.0, 1e-12, 0.5, 3.0]])
    gain = local_steps_gain(lam, np.array([0.1, 1.0]), 20)[0]
    assert gain[0, 0] == 20.0 and gain[0, 1] == pytest.approx(20.0, rel=1e-9)  # eta lambda -> 0: E
    exact = (1 - (1 - 0.1 * lam[0, 2:]) ** 20) / (0.1 * lam[0, 2:])
    np.testing.assert_allclose(gain[0, 2:], exact, rtol=1e-12)
    assert gain[1, 3] == pytest.approx((1 - (-2.0) ** 20) / 3.0)  # a diverging step is reproduced, not hidden


# ------------------------------------------------------------------------------------ the plan
def test_cells_that_cannot_batch_run_alone_and_say_why(tmp_path: Path) -> None:
    base = {"num-clients": 10, "clients-per-round": 10.0, "dim": 8, "num-rounds": 2, "epsilon": 2.0}
    cells = [make_cell(tmp_path, f"c{i}", {**base, "clip": 1.0 + i}) for i in range(3)]
    cells.append(make_cell(tmp_path, "secure", {**base, "secure-noise": True}))
    plan = plan_batches(cells)
    assert [len(b) for b in plan.batches] == [3]
    assert [(c.key, "secure-noise" in why) for c, why in plan.alone] == [("secure", True)]
    assert unbatchable_reason(cells[0].cfg) is None
    with pytest.raises(BatchError, match="secure-noise"):
        run_batch([c.cfg for c in cells])
    with pytest.raises(BatchError, match="dim"):
        run_batch([cells[0].cfg, cells[1].cfg.replace(dim=9, run_name="other")])
    assert batch_key(cells[0].cfg, build_task(cells[0].cfg)) == batch_key(cells[1].cfg, build_task(cells[1].cfg))


def test_batches_are_cut_by_size_and_memory(tmp_path: Path) -> None:
    base = {"num-clients": 10, "clients-per-round": 10.0, "dim": 8, "num-rounds": 50, "epsilon": 2.0}
    cells = [make_cell(tmp_path, f"c{i}", {**base, "clip": 1.0 + i}) for i in range(10)]
    assert [len(b) for b in plan_batches(cells, max_runs=4).batches] == [4, 3, 3]
    one, three = (batch_bytes(cells[0].cfg, 8, k, 4 * 8 * 10 * 8 * 20) for k in (1, 3))
    assert [len(b) for b in plan_batches(cells, max_memory=three).batches] == [3, 3, 2, 2]
    with pytest.raises(BatchMemoryError, match=f"needs at least .*\\({one} bytes\\)"):
        plan_batches(cells, max_memory=one - 1)
    assert [len(b) for b in plan_batches(cells, max_memory=one - 1, strict=False).batches] == [1] * 10


def test_experiments_reject_an_unknown_keyword_before_anything_runs(tmp_path: Path) -> None:
    """A key that is neither the grid's nor a run option (`RunOptions`) is a TypeError naming it; nothing is written."""
    from dpfedavg.experiments.private_tuning import run_private_tuning

    out = tmp_path / "out"
    with pytest.raises(TypeError, match="'enigne': expected one of epsilons, .*, engine, jobs"):
        table1.run_table1(out, "digits", enigne="batched")
    with pytest.raises(TypeError, match="'jobs'"):
        table1.table1_cells(out, "digits", jobs=2)  # the grid alone: the run options are run_table1's
    with pytest.raises(TypeError, match="'job': expected one of engine, jobs, progress"):
        synthetic.run_synthetic(out, job=2)
    with pytest.raises(TypeError, match="'job'"):
        run_private_tuning(out, "digits", epsilons=[5.0], clips=[1.0], lrs=[0.01], rounds=2, job=2)
    assert not out.exists()


def test_parse_memory() -> None:
    assert parse_memory("2G") == 2 * 1000**3 and parse_memory("512MiB") == 512 * 1024**2
    assert parse_memory("1.5kb") == 1500 and parse_memory(4096) == 4096
    for bad in ("", "abc", "-1G", "0", "3 parsecs"):
        with pytest.raises(ValueError, match="--max-batch-memory = "):
            parse_memory(bad)


def test_a_failing_run_fails_alone(tmp_path: Path) -> None:
    """A batch that raises is rerun cell by cell: only the bad cell is reported."""
    from dpfedavg.experiments.sweep import SweepError

    base = {"num-clients": 10, "clients-per-round": 10.0, "dim": 8, "num-rounds": 2, "epsilon": 2.0}
    cells = [make_cell(tmp_path, f"c{i}", adaptive_values({**base, "clip": 1.0 + i})) for i in range(3)]
    # sigma_b = 0.1 <= z/2: refused once z is calibrated (when the run starts), not when the cell is made
    cells.append(make_cell(tmp_path, "bad", {**base, "algorithm": "adaptive-clip", "clip-count-stddev": 0.1}))
    with pytest.raises(SweepError, match="1 of 4 cells failed .*bad: ConfigError"):
        run_cells(cells, jobs=1, progress=False)
    assert all((c.directory / "model.npz").exists() for c in cells[:3])


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--max-batch-memory", "1K"], "--max-batch-memory = 1000 B is too small for one run of 'quadratic'"),
        (["--max-batch-memory", "lots"], "--max-batch-memory = 'lots': expected a size"),
        (["--max-batch-memory", "1G", "--engine", "flower", "--jobs", "1"], "use --engine batched"),
    ],
)
def test_run_sim_rejects_a_bad_batch_memory(flags: list[str], fragment: str, tmp_path: Path) -> None:
    args = ["synthetic", "--C", "50", "--init", "I1", "--eta", "0.003", "--seeds", "1", "--rounds", "3",
            "--algorithms", "norm", "--out", str(tmp_path / "x"), "--no-progress", *flags]  # fmt: skip
    result = subprocess.run([sys.executable, str(ROOT / "run_sim.py"), *args], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2 and fragment in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "x" / "runs").exists()


# ------------------------------------------------------------------------------------ the privacy cache
def test_calibration_is_cached_across_invocations_by_dp_accounting_version(tmp_path: Path, monkeypatch) -> None:
    from dpfedavg.privacy import accountants, cache, calibration

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "privacy"))
    cache.clear_memory()
    calibration.calibrate_noise_multiplier.cache_clear()
    z = calibration.calibrate_noise_multiplier(4.0, 1e-5, 0.5, 7, "rdp")
    eps = calibration.epsilon_for(z, 0.5, 7, 1e-5, "pld")
    files = list((tmp_path / "privacy").glob("*.json"))
    assert len(files) == 1 and "dp-accounting-" in files[0].name
    # a new process: nothing in memory, the bisection must not run again
    cache.clear_memory()
    calibration.calibrate_noise_multiplier.cache_clear()
    monkeypatch.setattr(calibration, "smallest_noise_multiplier", lambda *a, **k: pytest.fail("recomputed"))
    assert calibration.calibrate_noise_multiplier(4.0, 1e-5, 0.5, 7, "rdp") == z
    monkeypatch.setattr(accountants, "_run_pld", lambda *a, **k: pytest.fail("recomputed"))
    assert calibration.epsilon_for(z, 0.5, 7, 1e-5, "pld") == eps
    # another dp-accounting version: another file, computed again
    cache.clear_memory()
    calibration.calibrate_noise_multiplier.cache_clear()
    monkeypatch.setattr(cache, "_code_version", lambda: "dp-accounting-9.9-other")
    with pytest.raises(pytest.fail.Exception, match="recomputed"):
        calibration.calibrate_noise_multiplier(4.0, 1e-5, 0.5, 7, "rdp")
    cache.clear_memory()


def test_disk_cache_can_be_turned_off(monkeypatch) -> None:
    from dpfedavg.privacy import cache

    monkeypatch.setenv(cache.CACHE_ENV, "off")
    assert cache.cache_file() is None
    assert cache.cached("test-kind", (1, 2.5), lambda: 7.25) == 7.25
    cache.clear_memory()


# ------------------------------------------------------------------------------------ torch tasks
def test_torch_runs_axis_equals_each_run_alone(tmp_path: Path) -> None:
    """TorchTask: vmap over runs x clients gives each run's own block update (float64: to the rounding)."""
    pytest.importorskip("torch")
    values = {"task": "mlp-digits", "num-clients": 30, "clients-per-round": 30.0, "torch-dtype": "float64",
              "device": "cpu", "cache-dir": str(tmp_path / "c")}  # fmt: skip
    cfg = RunConfig.from_run_config(values)
    task = build_task(cfg)
    rng = np.random.default_rng(3)
    w = task.initial_weights()
    weights = np.stack([w, w + rng.normal(size=w.shape) * 0.05, w * 0.5])
    lrs = np.array([0.05, 0.2, 0.1])
    ids = np.array([2, 3, 11, 29])
    u = task.client_runs_update_fn(ids)(weights, lrs, 4)
    for r in range(3):
        alone = task.client_batch_update_fn(ids)(weights[r], lrs[r], 4)
        np.testing.assert_allclose(u[r], alone, rtol=1e-12, atol=1e-12 * np.abs(alone).max())
        ref = np.stack([client_update(weights[r], task.client_grad_fn(int(i)), lrs[r], 4) for i in ids])
        np.testing.assert_allclose(u[r], ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())


def test_torch_task_sweep_as_batches_equals_one_run_at_a_time(tmp_path: Path) -> None:
    """A torch model's grid (float64) through the batched sweep: every run equal to 1e-9."""
    pytest.importorskip("torch")
    base = {"task": "mlp-digits", "num-clients": 30, "clients-per-round": 10.0, "num-rounds": 3, "local-steps": 3,
            "torch-dtype": "float64", "device": "cpu", "epsilon": 4.0, "delta": 1e-5, "local-lr": 0.1,
            "cache-dir": str(tmp_path / "c")}  # fmt: skip

    def cells(out: Path) -> list:
        return [make_cell(out, f"{alg}-C{c:g}", {**base, "algorithm": alg, "clip": c})
                for alg in ("clip", "norm") for c in (0.5, 2.0)]  # fmt: skip

    alone, batched = cells(tmp_path / "alone"), cells(tmp_path / "batched")
    units = plan_units(batched)
    assert len(units) == 1 and units[0][1]
    _one_at_a_time(alone)
    run_cells(batched, jobs=1, progress=False)
    _assert_same_runs(alone, batched)


def test_a_gpu_asked_for_but_absent_is_one_config_error_before_anything_runs(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from dpfedavg.config import ConfigError

    base = {"task": "mlp-digits", "num-clients": 30, "clients-per-round": 10.0, "num-rounds": 2, "device": "cuda",
            "cache-dir": str(tmp_path / "c")}  # fmt: skip
    cells = [make_cell(tmp_path / "out", f"c{i}", {**base, "clip": 1.0 + i}) for i in range(2)]
    with pytest.raises(ConfigError, match="'device' = 'cuda', but torch sees no CUDA device"):
        run_cells(cells, jobs=1, progress=False)
    assert not (tmp_path / "out" / "runs").exists()
