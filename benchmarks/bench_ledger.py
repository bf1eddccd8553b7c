#!/usr/bin/env python
"""Cost of one release in the node's privacy ledger (``dpfedavg.privacy.ledger``) with a long history.

Writes a ledger of ``--plans`` runs (two answered rounds each, q = 0.01, z = 3, 20 rounds: a node's years of
runs), composes it once from the file alone (what converting a format-1 ledger, or losing its state, costs),
then times ``--releases`` releases the way a ClientApp makes them (a new ``NodeLedger``, no process-level PLD
cache): half open a new run (one more plan composed into the running PLD), half answer a further round of a run
already charged (nothing composed). Each is the whole ``NodeLedger.charge``: lock, state, composition, the
epsilon check against ``max-epsilon``, the fsynced append.

    python benchmarks/bench_ledger.py [--plans 10000] [--releases 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from dpfedavg.privacy import accountants
from dpfedavg.privacy.ledger import NodeLedger, Release
from dpfedavg.privacy.policy import NodePolicy

Q, Z, K = 0.01, 3.0, 20


def _release(run_id: int, k: int) -> Release:
    return Release(run_id, k, "train", "poisson-sampled-gaussian", Z, Q, K, 1e-6, 1.0, "client-calibrated",
                   Z / 2, "2026-11-28T00:00:00+00:00")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=10_000)
    parser.add_argument("--releases", type=int, default=20)
    args = parser.parse_args()
    policy = NodePolicy(max_epsilon=1e6)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ledger.json"
        ledger = NodeLedger(path)
        ledger.write([_release(run_id, k) for run_id in range(args.plans) for k in (1, 2)])
        start = time.perf_counter()
        spent = ledger.spent(policy)
        rebuild = time.perf_counter() - start
        print(f"{args.plans} plans ({2 * args.plans} entries, {path.stat().st_size / 1e6:.1f} MB): epsilon {spent:.3f} "
              f"at delta 1e-6; composed from the file alone in {rebuild:.1f} s")  # fmt: skip
        times: dict[str, list[float]] = {"new run": [], "further round": []}
        for i in range(args.releases):
            run_id, k = (args.plans + i, 1) if i % 2 == 0 else (args.plans + i - 1, 2)
            accountants._event_pld.cache_clear()  # a fresh ClientApp process
            start = time.perf_counter()
            NodeLedger(path).charge(_release(run_id, k), policy)
            times["new run" if k == 1 else "further round"].append(time.perf_counter() - start)
        for kind, values in times.items():
            print(f"  release, {kind}: median {1e3 * statistics.median(values):.1f} ms, "
                  f"max {1e3 * max(values):.1f} ms ({len(values)} releases)")  # fmt: skip
        fsyncs = []  # the part no ledger can skip: one appended line flushed to disk, the same folder
        with open(Path(tmp) / "scratch", "ab") as f:
            for _ in range(args.releases):
                start = time.perf_counter()
                f.write(b"x" * 300 + b"\n")
                f.flush()
                os.fsync(f.fileno())
                fsyncs.append(time.perf_counter() - start)
        print(f"  of which a 300-byte append and fsync alone: median {1e3 * statistics.median(fsyncs):.1f} ms")
        all_times = [t for values in times.values() for t in values]
        final = NodeLedger(path).spent(policy)
        print(f"  every release: mean {1e3 * statistics.mean(all_times):.1f} ms; final epsilon {final:.3f}; "
              f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")  # fmt: skip


if __name__ == "__main__":
    main()
