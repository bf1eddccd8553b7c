"""Sweeps and `flwr run` on an existing Ray cluster: a head and one more node, both on 127.0.0.1.

Each node is its own ``ray start --block`` (1 CPU, free ports, private temp dir),
as on two machines; work must run on both, give the results of a local run,
survive the death of the second node mid-sweep, and leave no process behind.
Slow (~1.5-2 min on 2 cores); marked ``slow`` and run in CI.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from dpfedavg.config import RunConfig
from dpfedavg.deploy.ray_loopback import LoopbackRayCluster
from dpfedavg.engines.batched import run_batched
from dpfedavg.engines.local_superlink import LocalSuperLink
from dpfedavg.experiments.sweep import RAY_TASK_FILE

#: One worker runs this module's tests, in order, on one cluster (the last one kills its second node).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group("ray-cluster")]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray")
    c = LoopbackRayCluster(workers=1, num_cpus=1).start()
    try:
        yield c
    finally:
        c.stop()
        assert c.leftover_pids() == [], "Ray processes survived stop()"


def _run_sim(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "run_sim.py"), *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)  # fmt: skip


def _node_ids(out: Path) -> list[str]:
    return [json.loads(p.read_text())["node_id"] for p in sorted((out / "runs").glob(f"*/{RAY_TASK_FILE}"))]


def _cluster_nodes(cluster: LoopbackRayCluster) -> set[str]:
    probe = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False); "
             "print(' '.join(n['NodeID'] for n in ray.nodes()))")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", probe, cluster.address], env=cluster.env, capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    return set(result.stdout.split())


def _assert_same_cells(a: Path, b: Path) -> None:
    """Every cell of sweep ``a`` has the results of the same cell of sweep ``b`` (timings aside)."""
    cells = sorted(p.name for p in (a / "runs").iterdir())
    assert cells == sorted(p.name for p in (b / "runs").iterdir())
    for name in cells:
        x, y = a / "runs" / name, b / "runs" / name
        with (x / "metrics.csv").open() as fx, (y / "metrics.csv").open() as fy:
            rows_x = [{k: v for k, v in r.items() if k != "elapsed_s"} for r in csv.DictReader(fx)]
            rows_y = [{k: v for k, v in r.items() if k != "elapsed_s"} for r in csv.DictReader(fy)]
        assert rows_x == rows_y, name
        mx, my = np.load(x / "model.npz"), np.load(y / "model.npz")
        for key in mx.files:
            np.testing.assert_array_equal(mx[key], my[key])
        cx, cy = json.loads((x / "config.json").read_text()), json.loads((y / "config.json").read_text())
        for c, sweep in ((cx, a), (cy, b)):
            c.pop("started_utc")
            c["final"].pop("finished_utc")
            assert c["run_config"].pop("output-dir") == str(sweep / "runs")  # as written by a local run
        assert cx == cy, name


def test_table1_sweep_on_the_cluster_equals_a_local_sweep(cluster: LoopbackRayCluster, tmp_path: Path) -> None:
    """Digits Table 1 batches of cells (one per seed) as Ray tasks on both nodes: the local sweep's files; a rerun
    runs nothing."""
    grid = ["table1", "--dataset", "digits", "--epsilon", "5", "--clip", "62.5", "--lr", "0.032", "0.008",
            "--algorithms", "clip", "norm", "--seeds", "2", "--rounds", "10",
            "--cache-dir", str(tmp_path / "cache"), "--no-progress"]  # fmt: skip
    local = _run_sim(*grid, "--jobs", "1", "--out", str(tmp_path / "local"), cwd=tmp_path)
    assert local.returncode == 0, local.stderr[-3000:]
    remote = _run_sim(*grid, "--ray-address", cluster.address, "--out", str(tmp_path / "ray"), cwd=tmp_path)
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert f"Ray cluster {cluster.address}" in remote.stdout
    assert (tmp_path / "ray" / "table1.csv").read_text() == (tmp_path / "local" / "table1.csv").read_text()
    assert (tmp_path / "ray" / "table1.md").read_text() == (tmp_path / "local" / "table1.md").read_text()
    _assert_same_cells(tmp_path / "ray", tmp_path / "local")
    nodes = _node_ids(tmp_path / "ray")
    assert len(nodes) == 12 and set(nodes) == _cluster_nodes(cluster) and len(set(nodes)) == 2, nodes
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "ray" / "runs").glob("*/config.json")}
    again = _run_sim(*grid, "--ray-address", cluster.address, "--out", str(tmp_path / "ray"), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert stamps == {p: p.stat().st_mtime_ns for p in stamps}  # done cells are not rerun


def test_flwr_run_on_the_cluster_uses_both_nodes(cluster: LoopbackRayCluster, tmp_path: Path) -> None:
    """`flwr run` through a SuperLink started with RAY_ADDRESS: ClientApps on both nodes, the batched result."""
    values = {"num-clients": 10, "clients-per-round": 6.0, "num-rounds": 3, "dim": 20, "seed": 3, "epsilon": 0.0,
              "noise-multiplier": 1.0, "output-dir": str(tmp_path), "run-name": "fl"}  # fmt: skip
    overrides = " ".join(f"{k}='{v}'" if isinstance(v, str) else f"{k}={v}" for k, v in values.items())
    with LocalSuperLink(tmp_path / "link", ray_address=cluster.address) as link:
        result = link.flwr_run(overrides, "num-supernodes=10 client-resources-num-cpus=1", run_dir=tmp_path / "fl")
    assert link.leftover_pids() == []
    assert (tmp_path / "fl" / "model.npz").exists(), result.stdout[-4000:]
    # the simulation attached to the cluster: its ClientApp actors ran on both nodes (one CPU each)
    for node in ("n0", "n1"):
        logs = list((cluster.root / node).glob("session_*/logs/worker-*.out"))
        assert any("ClientAppActor" in p.read_text(errors="replace") for p in logs), node
    batched = run_batched(RunConfig.from_run_config({**values, "run-name": "batched"})).directory
    np.testing.assert_allclose(
        np.load(tmp_path / "fl" / "model.npz")["w_final"], np.load(batched / "model.npz")["w_final"], rtol=1e-6
    )


def test_a_node_killed_mid_sweep_loses_no_cell(cluster: LoopbackRayCluster, tmp_path: Path) -> None:
    """Kill the second node while it runs a cell: its cells rerun on the head, finished cells stay, same results.

    Runs last: the cluster has one node afterwards.
    """
    # six seeds: six batches of four cells (one per seed), so that node 1 runs one after another has finished
    grid = ["synthetic", "--C", "50", "--init", "I1", "--eta", "0.003", "0.001", "--seeds", "6", "--rounds", "150",
            "--algorithms", "clip", "norm", "--no-progress"]  # fmt: skip
    out = tmp_path / "ray"
    cmd = [sys.executable, str(ROOT / "run_sim.py"), *grid, "--ray-address", cluster.address, "--out", str(out)]
    with (tmp_path / "sweep.log").open("w") as log:
        sweep = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        # wait until a cell finished and node 1 is running one, then kill node 1 (every process of it)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and sweep.poll() is None:
            busy = [pid for pid in cluster.node_pids(1) if _running_cell(pid)]
            if busy and list((out / "runs").glob(f"*/{RAY_TASK_FILE}")):
                break
            time.sleep(0.1)
        assert sweep.poll() is None, "the sweep ended before node 1 could be killed"
        done_before = {p.parent.name: p.read_bytes() for p in (out / "runs").glob(f"*/{RAY_TASK_FILE}")}
        cluster.kill_node(1)
        assert sweep.wait(timeout=180) == 0, (tmp_path / "sweep.log").read_text()[-3000:]
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()
    assert all((out / "runs" / k / RAY_TASK_FILE).read_bytes() == v for k, v in done_before.items())
    assert len(_node_ids(out)) == 24
    local = _run_sim(*grid, "--jobs", "2", "--out", str(tmp_path / "local"), cwd=tmp_path)
    assert local.returncode == 0, local.stderr[-3000:]
    assert (out / "synthetic.csv").read_text() == (tmp_path / "local" / "synthetic.csv").read_text()
    _assert_same_cells(out, tmp_path / "local")


def _running_cell(pid: int) -> bool:
    """Whether process ``pid`` is a Ray worker running a batch of cells (a process may exit meanwhile: False)."""
    try:
        command = " ".join(psutil.Process(pid).cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return False
    return "_ray_cells" in command and "IDLE" not in command


def test_batches_go_to_the_alive_cpu_nodes_in_turn() -> None:
    """`_nodes_in_turn`: the alive nodes in turn (by id, softly), each as often as it has CPUs; dead and CPU-less
    nodes get nothing."""
    pytest.importorskip("ray")
    from dpfedavg.experiments.sweep import _nodes_in_turn

    class FakeRay:
        def __init__(self, nodes: list[dict]) -> None:
            self._nodes = nodes

        def nodes(self) -> list[dict]:
            return self._nodes

    a, b, c, d = ("a" * 56, "b" * 56, "c" * 56, "d" * 56)  # node ids are hex strings
    node_for = _nodes_in_turn(FakeRay([
        {"NodeID": c, "Alive": True, "Resources": {"CPU": 1.0}},
        {"NodeID": a, "Alive": True, "Resources": {"CPU": 3.0}},
        {"NodeID": b, "Alive": False, "Resources": {"CPU": 1.0}},
        {"NodeID": d, "Alive": True, "Resources": {"GPU": 1.0}},
    ]))  # fmt: skip
    strategies = [node_for(i) for i in range(6)]
    assert [s.node_id for s in strategies] == [a, c, a, a, a, c] and all(s.soft for s in strategies)
    assert _nodes_in_turn(FakeRay([]))(0) == "SPREAD"
