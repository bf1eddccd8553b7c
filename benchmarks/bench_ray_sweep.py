#!/usr/bin/env python
"""A Table 1 sweep with ``--jobs 2`` against the same sweep on a two-node loopback Ray cluster.

The cluster is a head and one more node on this machine, 1 CPU each
(``dpfedavg.deploy.ray_loopback``), so both set-ups run two cells at a time on
the same two cores and the difference is Ray's cost: connecting, shipping the
code (``py_modules``), scheduling each cell as a task and returning its files
as bytes. Each set-up runs ``run_sim.py table1`` in a fresh output folder
(nothing to resume), alternating, ``--repeats`` times; the digits feature
cache is prepared once before.

Reported per run: wall seconds of the whole command and per cell; the span
from the first cell's start to the last cell's end (``config.json``'s
``started_utc`` / ``finished_utc``); the mean time of one run inside the cell
(the same two stamps per cell), and ``overhead_s_per_cell`` = 2 x span / cells
- that mean: what each of the two slots spends per cell outside the run
(process or task scheduling, the privacy calibration, for Ray the files'
round trip). It is the number least disturbed by other load on the machine.
For the cluster also the in-task seconds per cell (``ray_task.json``) and
the cells per node.

    python benchmarks/bench_ray_sweep.py [--seeds 1] [--epsilon 5] [--repeats 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

from dpfedavg.deploy.ray_loopback import LoopbackRayCluster
from dpfedavg.experiments.sweep import RAY_TASK_FILE

ROOT = Path(__file__).resolve().parents[1]


def spans(out: Path) -> dict:
    """First start to last finish, and the mean run time, from the cells' config.json."""
    starts, ends, runs = [], [], []
    for path in (out / "runs").glob("*/config.json"):
        saved = json.loads(path.read_text())
        starts.append(datetime.fromisoformat(saved["started_utc"]))
        ends.append(datetime.fromisoformat(saved["final"]["finished_utc"]))
        runs.append((ends[-1] - starts[-1]).total_seconds())
    span = (max(ends) - min(starts)).total_seconds()
    mean_run = statistics.mean(runs)
    return {"span_s": span, "run_s_per_cell": mean_run, "overhead_s_per_cell": 2 * span / len(runs) - mean_run}


def run(args: list[str], cwd: Path) -> float:
    t0 = time.monotonic()
    result = subprocess.run([sys.executable, str(ROOT / "run_sim.py"), *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    return time.monotonic() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--epsilon", type=float, nargs="+", default=[5.0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    grid = ["table1", "--dataset", "digits", "--epsilon", *map(str, args.epsilon), "--seeds", str(args.seeds),
            "--rounds", str(args.rounds), "--cache-dir", str(tmp / "cache"), "--no-progress"]  # fmt: skip
    warm = ["table1", "--dataset", "digits", "--epsilon", "5", "--clip", "62.5", "--lr", "0.01", "--seeds",
            str(args.seeds), "--rounds", "1", "--cache-dir", str(tmp / "cache"), "--no-progress", "--jobs", "1",
            "--out", str(tmp / "warm")]  # fmt: skip
    run(warm, tmp)  # prepares the feature cache once
    results: dict[str, list[dict]] = {"jobs2": [], "ray2": []}
    t0 = time.monotonic()
    cluster = LoopbackRayCluster(workers=1, num_cpus=1).start()
    cluster_start = time.monotonic() - t0
    try:
        for i in range(args.repeats):
            out = tmp / f"jobs-{i}"
            wall = run([*grid, "--jobs", "2", "--out", str(out)], tmp)
            cells = len(list((out / "runs").iterdir()))
            results["jobs2"].append({"wall_s": wall, "cells": cells, "s_per_cell": wall / cells, **spans(out)})
            print("jobs2", json.dumps(results["jobs2"][-1]), file=sys.stderr, flush=True)
            out = tmp / f"ray-{i}"
            wall = run([*grid, "--ray-address", cluster.address, "--out", str(out)], tmp)
            tasks = [json.loads(p.read_text()) for p in (out / "runs").glob(f"*/{RAY_TASK_FILE}")]
            results["ray2"].append({
                "wall_s": wall, "cells": len(tasks), "s_per_cell": wall / len(tasks),
                "in_task_s_per_cell": statistics.mean(t["seconds"] for t in tasks),
                "cells_per_node": sorted(Counter(t["node_id"] for t in tasks).values()), **spans(out),
            })  # fmt: skip
            print("ray2", json.dumps(results["ray2"][-1]), file=sys.stderr, flush=True)
    finally:
        cluster.stop()
    summary = {"cluster_start_s": cluster_start, **results}
    if args.json:
        print(json.dumps(summary))
        return
    print(f"cluster start (head + 1 node): {cluster_start:.1f} s")
    for name, runs in results.items():
        for r in runs:
            extra = (f", in-task {r['in_task_s_per_cell']:.2f} s/cell, cells per node {r['cells_per_node']}"
                     if "in_task_s_per_cell" in r else "")  # fmt: skip
            print(f"{name}: {r['cells']} cells in {r['wall_s']:.1f} s = {r['s_per_cell']:.3f} s/cell; span "
                  f"{r['span_s']:.1f} s, run {r['run_s_per_cell']:.2f} s/cell, overhead "
                  f"{r['overhead_s_per_cell']:.3f} s/cell{extra}")  # fmt: skip


if __name__ == "__main__":
    main()
