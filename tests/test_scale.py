"""Scale: a 5000-node Flower simulation starts, registers every node and samples Binomial(5000, q) clients.

Slow (about two minutes on 2 cores); marked ``slow`` and run in CI.
"""

from __future__ import annotations

import csv
import json
import math

import pytest

from dpfedavg.engines.local_superlink import LocalSuperLink

pytestmark = pytest.mark.slow


def test_5000_node_simulation_registers_every_node_and_samples_plausibly(tmp_path) -> None:
    n, q = 5000, 0.2
    values = (
        f"task='quadratic' dim=2 local-steps=1 num-clients={n} clients-per-round={q * n} num-rounds=2 "
        f"epsilon=0.0 noise-multiplier=1.0 checkpoint-every=0 node-wait-timeout=600.0 "
        f"output-dir='{tmp_path}' run-name='scale'"
    )
    with LocalSuperLink(tmp_path / "superlink") as link:
        result = link.flwr_run(values, f"num-supernodes={n} client-resources-num-cpus=1", timeout=1200)
    assert link.leftover_pids() == []
    assert f"All {n} clients registered" in result.stdout, result.stdout[-3000:]
    run_dir = tmp_path / "scale"
    final = json.loads((run_dir / "config.json").read_text())["final"]
    assert final["rounds_completed"] == 2
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))[1:]
    mean, sd = n * q, math.sqrt(n * q * (1 - q))  # Binomial(5000, 0.2): 1000 +- 28.3
    for row in rows:
        sampled = int(row["num_sampled"])
        assert abs(sampled - mean) < 5 * sd, sampled
        assert int(row["num_received"]) == sampled  # every sampled node replied
