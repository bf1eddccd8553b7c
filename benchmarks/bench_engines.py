#!/usr/bin/env python
"""Seconds per round: the batched engine against the Flower engine, FMNIST shapes.

n = 3000 clients, r = 600, logistic regression 784 x 10 (+10), 20 examples per
client, E = 20, DP-NormFedAvg at epsilon = 5. The data are generated (random
pixels in the original IDX format, 6000 per class), since this machine cannot
download Fashion-MNIST; the cost does not depend on the pixel values.

The per-round time is the median of ``elapsed_s`` differences over rounds
where the server does not evaluate.

    python benchmarks/bench_engines.py [--clients 3000] [--rounds 8] [--skip-flower]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
import time
from pathlib import Path

from dpfedavg.config import RunConfig
from dpfedavg.engines.batched import run_batched
from dpfedavg.experiments.scale import make_fmnist_like


def per_round(run_dir: Path, first: int = 1) -> float:
    """Median seconds of rounds ``first``.. without a server-side evaluation, from ``metrics.csv``'s ``elapsed_s``."""
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    elapsed = [float(r["elapsed_s"]) for r in rows]
    plain = [b - a for k, (a, b) in enumerate(zip(elapsed, elapsed[1:], strict=False), start=1)
             if k >= first and rows[k]["test_accuracy"] == ""]  # fmt: skip
    return statistics.median(plain)


def fmnist_workload(tmp: Path, n: int, k: int) -> dict:
    """The FMNIST-shaped run_config the engine benchmarks share (generated data under ``tmp``; q = 0.2, E = 20).

    Fashion-MNIST's 60,000 training images, or 20 per client where n > 3,000 (the shard split needs at least 5
    per client; 20 keeps every n at n = 3,000's 20 examples a client)."""
    num_train = max(60000, 20 * n)
    data_dir = make_fmnist_like(tmp / ("data" if num_train == 60000 else f"data-{num_train}"), num_train=num_train)
    return {"task": "fmnist", "num-clients": n, "clients-per-round": 0.2 * n, "num-rounds": k, "eval-every": k,
            "epsilon": 5.0, "delta": 1e-5, "local-lr": 0.01, "clip": 62.5, "data-dir": str(data_dir),
            "cache-dir": str(data_dir / "cache"), "output-dir": str(tmp / "out")}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--skip-flower", action="store_true")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    n, k = args.clients, args.rounds
    values = fmnist_workload(tmp, n, k)
    print("| engine | n | r | s per round (median) | ms per sampled client | wall (s) |")
    print("|---|---|---|---|---|---|")
    t0 = time.monotonic()
    out = run_batched(RunConfig.from_run_config({**values, "run-name": "batched"})).directory
    wall = time.monotonic() - t0
    s = per_round(out)
    print(f"| batched | {n} | {0.2 * n:g} | {s:.3f} | {1000 * s / (0.2 * n):.2f} | {wall:.1f} |", flush=True)
    if not args.skip_flower:  # Flower only here: bench_torch.py imports this module on machines without flwr
        from dpfedavg.engines.flower import run_flower
        from dpfedavg.engines.local_superlink import LocalSuperLink

        with LocalSuperLink(tmp / "superlink") as link:
            t0 = time.monotonic()
            out = run_flower(RunConfig.from_run_config({**values, "run-name": "flower"}), link, timeout=3600)
            wall = time.monotonic() - t0
        s = per_round(out)
        print(f"| flower | {n} | {0.2 * n:g} | {s:.3f} | {1000 * s / (0.2 * n):.2f} | {wall:.1f} |", flush=True)


if __name__ == "__main__":
    main()
