#!/usr/bin/env python
"""Extra seconds per round of adaptive clipping in the batched engine, FMNIST shapes.

n = 3000 clients, r = 600, logistic regression 784 x 10 (+10), 20 examples per client, E = 20,
epsilon = 5 (PLD), as ``bench_engines.py``; the same run with ``clip`` and with ``adaptive-clip``
(each client's extra count coordinate, the split noise, the server's C_k update). The per-round time is
the median of ``elapsed_s`` differences over rounds where the server does not evaluate; the runs
alternate ``--repeats`` times so that load changes hit both alike.

    python benchmarks/bench_adaptive_clip.py [--clients 3000] [--rounds 12] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench_engines import per_round

from dpfedavg.config import RunConfig
from dpfedavg.engines.batched import run_batched
from dpfedavg.experiments.adaptive import adaptive_values
from dpfedavg.experiments.scale import make_fmnist_like


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-adaptive-"))
    data_dir = make_fmnist_like(tmp / "data")
    n, k = args.clients, args.rounds
    base = {"task": "fmnist", "num-clients": n, "clients-per-round": 0.2 * n, "num-rounds": k, "eval-every": k,
            "epsilon": 5.0, "delta": 1e-5, "local-lr": 0.01, "clip": 62.5, "data-dir": str(data_dir),
            "cache-dir": str(tmp / "cache"), "output-dir": str(tmp / "out"), "checkpoint-every": 0}  # fmt: skip
    variants = {"clip": {**base, "algorithm": "clip"}, "adaptive-clip": adaptive_values({**base, "algorithm": "clip"})}
    times: dict[str, list[float]] = {name: [] for name in variants}
    print(f"load average before: {os.getloadavg()}", flush=True)
    for repeat in range(args.repeats):
        for name, values in variants.items():
            t0 = time.monotonic()
            out = run_batched(RunConfig.from_run_config({**values, "run-name": f"{name}-{repeat}"}), threads=1)
            times[name].append(per_round(out, k))
            print(f"  {name} repeat {repeat}: {times[name][-1]:.4f} s/round ({time.monotonic() - t0:.1f} s)")
    print(f"load average after: {os.getloadavg()}")
    print("| algorithm | n | r | s per round (median of runs' medians) | extra vs clip |")
    print("|---|---|---|---|---|")
    ref = statistics.median(times["clip"])
    for name, values in times.items():
        s = statistics.median(values)
        print(f"| {name} | {n} | {0.2 * n:g} | {s:.4f} | {100 * (s / ref - 1):+.1f}% |")


if __name__ == "__main__":
    main()
