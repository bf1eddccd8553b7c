#!/usr/bin/env python
"""Time and peak memory of the privacy plan at the corners of the allowed ranges, and of the refusals (issue 29).

Each case builds the run's privacy plan (``PrivacySetup.resolve(cfg).plan``: calibration or the nominal epsilon)
in a fresh process and reports the wall seconds and the process's peak RSS; a case outside what the code can
honour must end in one ConfigError (the outcome column says which). The allowed ranges are the ``RunConfig``
fields' (num-rounds <= 1e5, epsilon 0 or [0.01, 100], delta [1e-12, 0.1], q = r/n >= 1e-6, z <= 1e6).

    python benchmarks/bench_calibration_bounds.py [--accountant pld] [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

_CHILD = """
import json, resource, sys, time
from dpfedavg.config import ConfigError, RunConfig
from dpfedavg.privacy.setup import PrivacySetup
values = json.loads(sys.argv[1])
t0 = time.perf_counter()
try:
    plan = PrivacySetup.resolve(RunConfig.from_run_config(values)).plan
    outcome = f"z = {plan.noise_multiplier:.4g}, epsilon = {plan.nominal_epsilon:.4g}"
except ConfigError as err:
    outcome = "ConfigError: " + str(err)[:90]
seconds = time.perf_counter() - t0
print(json.dumps({"outcome": outcome, "seconds": seconds,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

#: (label, run_config values); n = 100 unless the case sets it.
CORNERS = [
    ("K=1e5, q=1, eps=100", {"num-rounds": 100_000, "epsilon": 100.0}),
    ("K=1e5, q=1, eps=0.01, delta=1e-12", {"num-rounds": 100_000, "epsilon": 0.01, "delta": 1e-12}),
    ("K=1e5, q=1e-6, eps=5", {"num-rounds": 100_000, "num-clients": 10**6, "clients-per-round": 1.0}),
    ("K=1e5, q=0.01, eps=100", {"num-rounds": 100_000, "clients-per-round": 1.0, "epsilon": 100.0}),
    ("K=1e5, q=0.01, eps=1", {"num-rounds": 100_000, "clients-per-round": 1.0, "epsilon": 1.0}),
    ("K=1e5, q=0.5, eps=0.01 (infeasible)", {"num-rounds": 100_000, "clients-per-round": 50.0, "epsilon": 0.01}),
    (
        "K=1, q=1e-6, eps=100, delta=1e-12",
        {"num-rounds": 1, "num-clients": 10**6, "clients-per-round": 1.0, "epsilon": 100.0, "delta": 1e-12},
    ),
    ("K=1, q=1, eps=0.01, delta=0.1", {"num-rounds": 1, "epsilon": 0.01, "delta": 0.1}),
    ("K=200, q=0.2, eps=5 (FMNIST-like)", {"num-rounds": 200, "clients-per-round": 20.0, "delta": 1e-5}),
    ("K=1e5, q=1, z=1e6", {"num-rounds": 100_000, "epsilon": 0.0, "noise-multiplier": 1e6}),
    ("K=1e5, q=1, z=0.5 (PLD refuses)", {"num-rounds": 100_000, "epsilon": 0.0, "noise-multiplier": 0.5}),
]
#: The configurations of issue 29 that hung, exhausted memory or ended in a traceback.
ISSUE = [
    ("num-rounds=1000000", {"num-rounds": 1_000_000}),
    ("epsilon=1e6", {"epsilon": 1e6}),
    ("clients-per-round=1e-9", {"clients-per-round": 1e-9}),
    ("epsilon=1e-6", {"epsilon": 1e-6}),
    ("noise-multiplier=1e300", {"epsilon": 0.0, "noise-multiplier": 1e300}),
    ("delta=1e-300", {"delta": 1e-300}),
]


def _measure(values: dict) -> dict:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(values)], capture_output=True, text=True, timeout=600, check=False
    )
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1][:90]
        return {"outcome": f"exit {proc.returncode}: {last}", "seconds": float("nan"),
                "rss_mb": float("nan"), "process_s": time.monotonic() - t0}  # fmt: skip
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_s"] = time.monotonic() - t0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accountant", default="pld", choices=("pld", "rdp"))
    parser.add_argument("--quick", action="store_true", help="only the issue's cases")
    args = parser.parse_args()
    print("| case | outcome | plan s | whole process s | peak RSS MB |")
    print("|---|---|---|---|---|")
    for label, values in ISSUE + ([] if args.quick else CORNERS):
        m = _measure({**values, "accountant": args.accountant})
        print(
            f"| {label} | {m['outcome']} | {m['seconds']:.2f} | {m['process_s']:.1f} | {m['rss_mb']:.0f} |", flush=True
        )


if __name__ == "__main__":
    main()
