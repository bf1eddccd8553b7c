#!/usr/bin/env python
"""Random check-ins against server-side Poisson sampling at the same epsilon: digits accuracy and round time.

Runs dpfedavg's ServerApp and ClientApp in process (`dpfedavg.flower.testing.InProcessGrid`: Flower's messages,
no network, the nodes one after the other) on scikit-learn's digits: ``n`` nodes with ``secure-noise = true`` and a
ledger each, the same run config (so the same calibrated z and epsilon) with ``sampling = poisson`` (the server
samples each node with q) and ``sampling = check-in`` (every node asked, each takes part with probability q by its
own coin and otherwise sends 0 + its noise share; every node trains either way). Reports, per mode, the mean and
standard deviation over the repetitions of the last-5-round test accuracy and the median seconds per round
(``elapsed_s`` of ``metrics.csv``), and the run's epsilon.

    python benchmarks/bench_check_in.py [--nodes 50] [--q 0.5] [--rounds 30] [--repeats 3] [--secagg]
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

from dpfedavg.config import RunConfig
from dpfedavg.flower import client_app, server_app
from dpfedavg.flower.testing import InProcessGrid


def one_run(cfg: RunConfig, work: Path, secagg: bool) -> tuple[float, float, float, float]:
    """``(last-5 accuracy, median s per round, epsilon, wall s)`` of one run."""
    nodes = {"secure-noise": True, **({"require-secure-aggregation": True} if secagg else {})}
    grid = InProcessGrid(client_app.app, cfg.num_clients, cfg.to_run_config(), node_config=nodes)
    for context in grid.contexts.values():
        context.node_config["privacy-ledger"] = str(work / f"ledger-{context.node_config['partition-id']}.jsonl")
    t0 = time.monotonic()
    out = server_app.run(grid, cfg).directory
    wall = time.monotonic() - t0
    rows = list(csv.DictReader((out / "metrics.csv").open()))[1:]
    accuracy = [float(r["test_accuracy"]) for r in rows if r.get("test_accuracy")][-5:]
    elapsed = [float(r["elapsed_s"]) for r in rows]
    per_round = statistics.median(b - a for a, b in zip(elapsed, elapsed[1:], strict=False))
    epsilon = json.loads((out / "config.json").read_text())["final"]["epsilon"]
    return statistics.mean(accuracy), per_round, float(epsilon), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--q", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epsilon", type=float, default=5.0)
    parser.add_argument("--secagg", action="store_true", help="through SecAgg+ (both modes)")
    args = parser.parse_args()
    logging.disable(logging.INFO)  # a line per node and round otherwise
    base = {"task": "digits", "algorithm": "norm", "clip": 15.625, "local-lr": 0.016, "num-clients": args.nodes,
            "clients-per-round": args.q * args.nodes, "num-rounds": args.rounds, "epsilon": args.epsilon,
            "delta": 1e-5, "secure-noise": True, "secure-aggregation": args.secagg, "checkpoint-every": 0,
            "eval-every": 1}  # fmt: skip
    print(f"digits, n = {args.nodes} nodes, q = {args.q}, K = {args.rounds}, epsilon target {args.epsilon}, "
          f"SecAgg+ {args.secagg}, {args.repeats} repetitions each", flush=True)  # fmt: skip
    print("| sampling | test accuracy (last 5 rounds, mean ± sd) | s per round (median) | epsilon | wall s |")
    print("|---|---|---|---|---|")
    results = {}
    for sampling in ("poisson", "check-in"):
        runs = []
        for rep in range(args.repeats):
            work = Path(tempfile.mkdtemp(prefix=f"bench-check-in-{sampling}-"))
            cfg = RunConfig.from_run_config({**base, "sampling": sampling, "seed": rep, "output-dir": str(work),
                                             "run-name": "r"})  # fmt: skip
            runs.append(one_run(cfg, work, args.secagg))
        acc = [r[0] for r in runs]
        results[sampling] = statistics.mean(acc)
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        print(f"| {sampling} | {100 * statistics.mean(acc):.2f}% ± {100 * sd:.2f} | "
              f"{statistics.median(r[1] for r in runs):.3f} | {runs[0][2]:.3f} | "
              f"{statistics.mean(r[3] for r in runs):.1f} |", flush=True)  # fmt: skip
    print(f"\ndifference (check-in - poisson): {100 * (results['check-in'] - results['poisson']):+.2f} points")


if __name__ == "__main__":
    main()
