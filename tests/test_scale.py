"""Scale: a 5000-client Flower simulation (the recommended setup: virtual clients, 20 SuperNodes of 250).

It starts, registers every client, samples Binomial(5000, q) clients and counts every sampled client's
reply. Slow (``flwr run`` with Ray); marked ``slow`` and run in CI.
"""

from __future__ import annotations

import csv
import json
import math

import pytest

from dpfedavg.config import RunConfig
from dpfedavg.engines.flower import federation_config, recommended_clients_per_node
from dpfedavg.engines.local_superlink import LocalSuperLink

pytestmark = pytest.mark.slow


def test_5000_client_simulation_registers_every_client_and_counts_every_reply(tmp_path) -> None:
    n, q = 5000, 0.2
    m = recommended_clients_per_node(n)
    values = (
        f"task='quadratic' dim=2 local-steps=1 num-clients={n} clients-per-round={q * n} num-rounds=2 "
        f"clients-per-node={m} epsilon=0.0 noise-multiplier=1.0 checkpoint-every=0 node-wait-timeout=600.0 "
        f"output-dir='{tmp_path}' run-name='scale'"
    )
    cfg = RunConfig.from_run_config({"num-clients": n, "clients-per-round": q * n, "clients-per-node": m})
    assert (m, cfg.num_nodes) == (250, 20)
    with LocalSuperLink(tmp_path / "superlink") as link:
        result = link.flwr_run(values, federation_config(cfg), timeout=1200, run_dir=tmp_path / "scale")
    assert link.leftover_pids() == []
    assert f"All {n} clients registered on 20 SuperNodes" in result.stdout, result.stdout[-3000:]
    run_dir = tmp_path / "scale"
    final = json.loads((run_dir / "config.json").read_text())["final"]
    assert final["rounds_completed"] == 2
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))[1:]
    mean, sd = n * q, math.sqrt(n * q * (1 - q))  # Binomial(5000, 0.2): 1000 +- 28.3
    for row in rows:
        sampled = int(row["num_sampled"])
        assert abs(sampled - mean) < 5 * sd, sampled
        # every sampled client's reply was received and counted, none failed, rejected or dropped
        assert int(row["num_received"]) == sampled, row
        assert (row["num_failed"], row["num_rejected"], row["num_dropped"]) == ("0", "0", "0"), row
