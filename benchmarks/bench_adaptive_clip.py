#!/usr/bin/env python
"""Extra seconds per round of adaptive clipping in the batched engine, FMNIST shapes.

n = 3000 clients, r = 600, logistic regression 784 x 10 (+10), 20 examples per client, E = 20,
epsilon = 5 (PLD), as ``bench_engines.py``; the same run with ``clip`` and with ``adaptive-clip``
(each client's extra count coordinate, the split noise, the server's C_k update).

1. Whole runs: the per-round time is the median of ``elapsed_s`` differences over rounds where the
   server does not evaluate; the two runs alternate ``--repeats`` times (the first pair, which also
   prepares the data, is dropped) so that load changes hit both alike.
2. The part that differs, alone (median and min; the min is the least disturbed by other load):
   the client pipeline (``private_block_update`` on a block of r
   clients: clip, the count coordinate, the noise) and the server's close of the round
   (``DPServer.close_round``), interleaved ``--micro`` times; medians.

    python benchmarks/bench_adaptive_clip.py [--clients 3000] [--rounds 12] [--repeats 4] [--micro 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench_engines import fmnist_workload, per_round

from dpfedavg.config import RunConfig
from dpfedavg.engines.batched import run_batched
from dpfedavg.experiments.adaptive import adaptive_values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--micro", type=int, default=30)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-adaptive-"))
    n, k = args.clients, args.rounds
    base = {**fmnist_workload(tmp, n, k), "checkpoint-every": 0}
    variants = {"clip": {**base, "algorithm": "clip"}, "adaptive-clip": adaptive_values({**base, "algorithm": "clip"})}
    times: dict[str, list[float]] = {name: [] for name in variants}
    print(f"load average before: {os.getloadavg()}", flush=True)
    for repeat in range(args.repeats + 1):
        for name, values in variants.items():
            t0 = time.monotonic()
            out = run_batched(
                RunConfig.from_run_config({**values, "run-name": f"{name}-{repeat}"}), threads=1
            ).directory
            if repeat > 0:  # the first pair prepares the data
                times[name].append(per_round(out))
            print(f"  {name} repeat {repeat}: {per_round(out):.4f} s/round ({time.monotonic() - t0:.1f} s)")
    micro = _micro(variants, args.micro)
    print(f"load average after: {os.getloadavg()}")
    print("| algorithm | n | r | whole run: s per round (median of runs' medians) | client pipeline + server close, "
          "one round: median (min), ms |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, values in times.items():
        med, low = micro[name]
        print(f"| {name} | {n} | {0.2 * n:g} | {statistics.median(values):.4f} | {1000 * med:.1f} ({1000 * low:.1f}) |")


def _micro(variants: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """(median, min) seconds of one round's client pipeline (r clients) + the server's close, per algorithm."""
    import numpy as np

    from dpfedavg.core import noise_rng, private_block_update
    from dpfedavg.core.noise import round_noise_law
    from dpfedavg.core.types import ClientResult
    from dpfedavg.server.dp_server import DPServer
    from dpfedavg.server.round import RoundReplies

    dim = 785 * 10
    out: dict[str, list[float]] = {name: [] for name in variants}
    servers = {}
    for name, values in variants.items():
        cfg = RunConfig.from_run_config({**values, "num-rounds": repeats, "output-dir": "/tmp", "run-name": "m"})
        servers[name] = DPServer(cfg, dim, epsilon_each_round=False)
    r = int(next(iter(servers.values())).cfg.clients_per_round)
    u = np.random.default_rng(0).standard_normal((r + r // 4, dim)) * 40.0  # |S_k| ~ Binomial(n, q): all fit
    for k in range(1, repeats + 1):
        for name, server in servers.items():
            t0 = time.perf_counter()
            clients, ins, _ = server.begin_round(k, np.zeros(dim))
            m = min(len(clients), r)
            ups = private_block_update(u[:m], algorithm=ins.algorithm, clip=ins.clip, noise_std=ins.noise_std,
                                       rngs=[noise_rng(ins.noise_seed, int(c)) for c in clients[:m]],
                                       law=round_noise_law(ins), count_scale=ins.count_scale)  # fmt: skip
            res = [ClientResult(int(c), x.noisy, x.update_norm, None) for c, x in zip(clients[:m], ups, strict=True)]
            server.close_round(k, RoundReplies(tuple(res)))
            out[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(v), min(v)) for name, v in out.items()}


if __name__ == "__main__":
    main()
