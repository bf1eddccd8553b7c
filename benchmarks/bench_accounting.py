#!/usr/bin/env python
"""Cost and accuracy of the per-round privacy accountant.

For each setting, composes K rounds one at a time (as a run does, reporting
epsilon after each) and reports ms per round and the final epsilon, for RDP and
for PLD at two discretization intervals; also the time to calibrate z.

    python benchmarks/bench_accounting.py [--rounds 200] [--markdown]
"""

from __future__ import annotations

import argparse
import os
import time
from unittest import mock

os.environ.setdefault("DPFEDAVG_PRIVACY_CACHE", "off")  # time the computations, not the cache

from dpfedavg.privacy import accountants
from dpfedavg.privacy.accountants import ACCOUNTANTS, RoundEvent, create_accountant
from dpfedavg.privacy.calibration import calibrate_noise_multiplier

SETTINGS = [
    ("quadratic default (q=1, z=13.87, delta=1e-6)", 1.0, 13.867, 1e-6),
    ("FMNIST-like (q=0.2, z=2.01, delta=1e-5)", 0.2, 2.008, 1e-5),
    ("q=0.2, z varies per round (client placement)", 0.2, None, 1e-5),
]


def _events(q: float, z: float | None, rounds: int) -> list[RoundEvent]:
    if z is not None:
        return [RoundEvent(q, z)] * rounds
    return [RoundEvent(q, 2.008 * (0.9 + 0.2 * ((k * 7919) % 11) / 10)) for k in range(rounds)]


def _time_run(kind: str, interval: float, events: list[RoundEvent], delta: float) -> tuple[float, float]:
    accountants._event_pld.cache_clear()
    with mock.patch.object(accountants, "PLD_DISCRETIZATION", interval):
        acc = create_accountant(kind, delta)
        t0 = time.perf_counter()
        for event in events:
            acc.step(event)
            _ = acc.epsilon  # reported after every round, as a run does
        return (time.perf_counter() - t0) / len(events) * 1000, acc.epsilon


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    print(f"| setting | accountant | ms per round | epsilon after {args.rounds} rounds |")
    print("|---|---|---|---|")
    for name, q, z, delta in SETTINGS:
        events = _events(q, z, args.rounds)
        for kind, interval in (("rdp", 0.0), ("pld", 1e-3), ("pld", 1e-4)):
            ms, eps = _time_run(kind, interval, events, delta)
            label = kind if kind == "rdp" else f"pld (interval {interval:g})"
            print(f"| {name} | {label} | {ms:.1f} | {eps:.4f} |", flush=True)
    for kind in ACCOUNTANTS:
        calibrate_noise_multiplier.cache_clear()
        t0 = time.perf_counter()
        z = calibrate_noise_multiplier(5.0, 1e-5, 0.2, 100, kind)
        print(f"calibration {kind} (eps=5, delta=1e-5, q=0.2, K=100): z={z:.4f} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
