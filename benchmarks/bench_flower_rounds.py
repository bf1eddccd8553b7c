#!/usr/bin/env python
"""Seconds per round of the Flower simulation engine on the quadratic task.

Starts a private local SuperLink (as the end-to-end tests do), runs
`flwr run` for each federation setting and reads the per-round wall time
from metrics.csv (``elapsed_s``): the median over the rounds after the first
five, the time to round 0 (from the ServerApp's start), and the whole
`flwr run` wall time.

    python benchmarks/bench_flower_rounds.py [--rounds 40] [--clients 100]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
import time
from pathlib import Path

from dpfedavg.engines.local_superlink import LocalSuperLink


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--clients", type=int, default=100)
    args = parser.parse_args()
    n = args.clients
    link = LocalSuperLink(Path(tempfile.mkdtemp(prefix="bench")))
    link.start()
    print("| federation | s per round (median) | ms per sampled client | round 0 after (s) | flwr run wall (s) |")
    print("|---|---|---|---|---|")
    try:
        for cpus in (1, 2):
            out = Path(tempfile.mkdtemp(prefix="benchout"))
            fed = f"num-supernodes={n} client-resources-num-cpus={cpus}"
            t0 = time.monotonic()
            link.flwr_run(
                f"num-rounds={args.rounds} num-clients={n} clients-per-round={float(n)} "
                f"output-dir='{out}' run-name='b'",
                fed,
            )
            wall = time.monotonic() - t0
            rows = list(csv.DictReader((out / "b" / "metrics.csv").open()))
            elapsed = [float(r["elapsed_s"]) for r in rows]
            per_round = statistics.median(b - a for a, b in zip(elapsed[5:], elapsed[6:], strict=False))
            print(
                f"| `{fed}` | {per_round:.3f} | {per_round / n * 1000:.1f} | {elapsed[0]:.1f} | {wall:.1f} |",
                flush=True,
            )
    finally:
        link.stop()


if __name__ == "__main__":
    main()
