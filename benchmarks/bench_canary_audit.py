#!/usr/bin/env python
"""The canary audit against the accountant: the quadratic (paper §4.4) at epsilon 1, 2, 5, 10, seeded runs.

Two regimes, each with ``canary-clients = 200`` (about 100 inserted, 100 null), d = 500, DP-NormFedAvg,
delta = 1e-6, PLD accountant, the batched engine:

* ``q = 1``: n = 10 clients, every client and canary in each of K = 10 rounds. The final model then carries the
  whole canary game (K identical Gaussian releases), so Andrew et al.'s final-model estimate should be near the
  accountant's epsilon (which is tight here).
* ``q = 0.1``: n = 100 clients, r = 10, K = 50 rounds. A canary takes part in about 5 rounds; the accountant
  counts the amplification by sampling over all 50; the all-iterates estimate sees each round, the
  final-model estimate only the sum.

Prints one row per (regime, epsilon): the accountant's epsilon and, over the seeds, the mean and standard
deviation of both estimates and the largest one-run lower bound (95% confidence).

    python benchmarks/bench_canary_audit.py [--seeds 3] [--epsilons 1 2 5 10]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

from dpfedavg import RunConfig, run

REGIMES = {
    "q = 1": dict(num_clients=10, clients_per_round=10.0, num_rounds=10),
    "q = 0.1": dict(num_clients=100, clients_per_round=10.0, num_rounds=50),
}


def _stat(audits: list[dict], key: str) -> str:
    values = [a[key] for a in audits if a[key] is not None]
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.2f} ± {sd:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 5.0, 10.0])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out = tempfile.mkdtemp(prefix="bench-canary-")
    print(
        "| regime | epsilon (accountant) | final-model estimate | all-iterates estimate | one-run lower bound (max) |"
    )
    print("|---|---|---|---|---|")
    t0 = time.monotonic()
    for name, regime in REGIMES.items():
        for eps in args.epsilons:
            audits = []
            for seed in range(args.seeds):
                cfg = RunConfig(
                    task="quadratic",
                    algorithm="norm",
                    dim=500,
                    epsilon=eps,
                    canary_clients=200,
                    seed=seed,
                    output_dir=out,
                    checkpoint_every=0,
                    eval_every=1000,
                    **regime,
                )
                audits.append(run(cfg, progress=False).audit)

            bound = max(a["epsilon_lower_bound"] for a in audits)
            accountant = audits[0]["epsilon_accountant"]
            final, iterates = _stat(audits, "epsilon_final"), _stat(audits, "epsilon_all_iterates")
            print(f"| {name} | {accountant:.3g} | {final} | {iterates} | {bound:.2f} |")
    print(f"\n{args.seeds} seeds per row (0..{args.seeds - 1}); {time.monotonic() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
