#!/usr/bin/env python
"""The canary audit against the accountant at epsilon 1, 2, 5, 10: the paper's §4.4 quadratic and digits, seeded runs.

Every run: DP-NormFedAvg, delta = 1e-6, PLD accountant, the batched engine, ``canary-clients = 200`` (about 100
inserted, 100 null). Regimes:

* quadratic, ``q = 1``: d = 2000, n = 10 clients, every client and canary in each of K = 10 rounds. The final
  model then carries the whole canary game (K identical Gaussian releases: the accountant is tight), so Andrew et
  al.'s final-model estimate and the all-iterates likelihood ratio (here the sum of the rounds' standardised
  projections) are expected within their bands of the accountant's epsilon; the largest one-round cosine (Andrew
  et al.'s all-iterates statistic) tests one round at a time and is expected below it. d = 2000:
  the estimate cannot exceed about the mu-GDP epsilon of ``sqrt(d / inserted)`` (each inserted canary's cosine
  with the sum of about 100 canaries is at most about ``1 / sqrt(100)``, the null's std ``1 / sqrt(d)``), about 12.6
  at d = 500 and 31 at d = 2000 (delta = 1e-6): at d = 500 epsilon 10 is out of the measurement's reach.
* quadratic, ``q = 0.1``: d = 500, n = 100, r = 10, K = 50. A canary takes part in about 5 rounds; the accountant
  counts the amplification by sampling over all 50 rounds; every estimate is expected at or below it. The column
  "ideal" is where the all-iterates estimate is expected: the Gaussian fit of the likelihood ratio on the release
  exactly as the accountant models it, i.e. the central limit theorem's ``mu = q sqrt(K (e^{1/z^2} - 1))`` (Dong,
  Roth, Su 2022; ``sqrt(K) / z`` at ``q = 1``), which is below the accountant's epsilon when ``q < 1``.
* digits (scikit-learn's 8x8 digits, logistic regression, d = 650), ``q = 1``: n = r = 100, K = 50; as the
  quadratic at ``q = 1``, with a real model's movement in the cosines.
* broken (test-only): the quadratic at ``q = 1`` (d = 2000) with a placement whose clients add std ``zC / |S_k|`` where
  ``zC / sqrt(|S_k|)`` was meant, the server nothing; the accountant still reports the target epsilon.

For each row and estimate, over the seeds: ``mu`` (the shift of the canary scores over the null's std) is averaged,
its standard error pooled (``gaussian_fit_mu``), and the mu-GDP epsilon of the mean with its 95% band is printed;
the verdict compares the band with the accountant's epsilon ("in band", "below", "ABOVE"). The one-run lower
bound column is the largest over the seeds (each at 95% confidence). A second table: digits' test accuracy (mean of
the last 5 evaluated rounds) with 20 and 200 canaries against the same run without them, same epsilon and seeds.

    python benchmarks/bench_canary_audit.py [--seeds 3] [--epsilons 1 2 5 10]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dpfedavg import RunConfig, run
from dpfedavg.core import mechanism
from dpfedavg.privacy.canary import gaussian_fit_mu, gdp_epsilon

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the broken placement is test-only code
from legacy_placement import StdForVariance  # noqa: E402

KEYS = ("all_iterates", "final", "max_cosine")

CANARIES = 200
REGIMES: dict[str, dict] = {
    "quadratic, q = 1": dict(task="quadratic", dim=2000, num_clients=10, clients_per_round=10.0, num_rounds=10),
    "quadratic, q = 0.1": dict(task="quadratic", dim=500, num_clients=100, clients_per_round=10.0, num_rounds=50),
    "digits, q = 1": dict(task="digits", num_clients=100, clients_per_round=100.0, num_rounds=50, eval_every=2),
    "broken, quadratic, q = 1": dict(task="quadratic", dim=2000, num_clients=10, clients_per_round=10.0, num_rounds=10),
}
Z95 = 1.959963984540054


def pooled(runs: list[dict], key: str, delta: float) -> tuple[float, float, float]:
    """The mu-GDP epsilon of the seeds' mean ``mu`` and its 95% band (the seeds' standard errors pooled)."""
    mus, ses = zip(*(gaussian_fit_mu(r[key][r["inserted"]], r[key][~r["inserted"]]) for r in runs), strict=True)
    mu = statistics.mean(mus)
    se = math.sqrt(sum(s * s for s in ses)) / len(ses)
    return gdp_epsilon(mu, delta), gdp_epsilon(mu - Z95 * se, delta), gdp_epsilon(mu + Z95 * se, delta)


def verdict(accountant: float, lo: float, hi: float) -> str:
    return "ABOVE" if lo > accountant else ("below" if hi < accountant else "in band")


def one_run(name: str, regime: dict, eps: float, seed: int, canaries: int, out: str) -> dict:
    regime = dict(regime)
    cfg = RunConfig(
        algorithm="norm",
        epsilon=eps,
        canary_clients=canaries,
        seed=seed,
        output_dir=out,
        run_name=f"{name.replace(', ', '-').replace(' = ', '')}-{eps:g}-{seed}-{canaries}",
        checkpoint_every=0,
        eval_every=regime.pop("eval_every", 1000),
        **regime,
    )
    broken = name.startswith("broken")
    base = mechanism.PLACEMENTS["client-calibrated"]
    if broken:
        mechanism.PLACEMENTS["client-calibrated"] = StdForVariance(base)
    try:
        result = run(cfg, progress=False)
    finally:
        mechanism.PLACEMENTS["client-calibrated"] = base
    final = json.loads((result.directory / "config.json").read_text())["final"]
    z = json.loads((result.directory / "config.json").read_text())["privacy"]["noise_multiplier"]
    q, rounds = cfg.sampling_rate, cfg.num_rounds
    ideal_mu = math.sqrt(rounds) / z if q == 1 else q * math.sqrt(rounds * math.expm1(z**-2))
    record = {
        "epsilon": result.epsilon,
        "accuracy": final.get("last5_test_accuracy"),
        "audit": result.audit,
        "ideal": gdp_epsilon(ideal_mu, cfg.delta),
    }
    if canaries:
        scores = np.load(result.directory / "audit.npz")
        record.update({key: scores[key] for key in (*KEYS, "inserted")})
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 5.0, 10.0])
    parser.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    parser.add_argument("--dim", type=int, default=None, help="the quadratic's d (default: each regime's)")
    args = parser.parse_args()
    if args.dim is not None:
        for regime in REGIMES.values():
            if regime["task"] == "quadratic":
                regime["dim"] = args.dim
    logging.basicConfig(level=logging.WARNING)
    out = tempfile.mkdtemp(prefix="bench-canary-")
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.1f}")
    print(
        "| regime | epsilon (accountant) | ideal | all-iterates estimate [95% band] | | final-model estimate "
        "[95% band] | | largest one-round cosine [95% band] | | one-run lower bound (max) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    t0 = time.monotonic()
    utility: list[str] = []
    for name in args.regimes:
        for eps in args.epsilons:
            runs = [one_run(name, REGIMES[name], eps, seed, CANARIES, out) for seed in range(args.seeds)]
            accountant = runs[0]["epsilon"]
            delta = runs[0]["audit"]["delta"]
            cells = []
            for key in KEYS:
                est, lo, hi = pooled(runs, key, delta)
                cells += [f"{est:.2f} [{lo:.2f}, {hi:.2f}]", verdict(accountant, lo, hi)]
            bound = max(r["audit"]["epsilon_lower_bound"] for r in runs)
            ideal = runs[0]["ideal"]
            print(f"| {name} | {accountant:.3g} | {ideal:.2f} | {' | '.join(cells)} | {bound:.2f} |", flush=True)
            if name.startswith("digits"):  # the same runs without canaries and with a tenth of them
                acc = {CANARIES: [r["accuracy"] for r in runs]}
                for k in (0, CANARIES // 10):
                    acc[k] = [one_run(name, REGIMES[name], eps, s, k, out)["accuracy"] for s in range(args.seeds)]
                cells = [f"{100 * statistics.mean(acc[0]):.1f}%"]
                for k in (CANARIES // 10, CANARIES):
                    diff = [100 * (a - b) for a, b in zip(acc[k], acc[0], strict=True)]
                    sd = statistics.stdev(diff) if len(diff) > 1 else 0.0
                    cells.append(f"{100 * statistics.mean(acc[k]):.1f}% ({statistics.mean(diff):+.1f} ± {sd:.1f})")
                utility.append(f"| {accountant:.3g} | {' | '.join(cells)} |")
    if utility:
        print(
            f"\n| epsilon | digits accuracy, no canaries | {CANARIES // 10} canaries (difference, points) "
            f"| {CANARIES} canaries (difference, points) |"
        )
        print("|---|---|---|---|")
        print("\n".join(utility))
    print(
        f"\n{args.seeds} seeds per row (0..{args.seeds - 1}); {time.monotonic() - t0:.0f} s in all; "
        f"load average {os.getloadavg()[0]:.1f} at the end; runs in {Path(out)}"
    )


if __name__ == "__main__":
    main()
