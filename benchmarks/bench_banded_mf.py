#!/usr/bin/env python
"""Cost per round of banded-MF noise against independent noise, in the batched engine.

Two measurements at d = 7850 (the digits/FMNIST logistic model) and d = 1e6:

* the server's noise alone, per round: independent ``gaussian_noise(d, sigma)`` against the banded stream's
  ``(C^{-1} Z)_k`` for b = 1, 4, 16 (O(b d) time and memory);
* whole rounds of the batched engine (n = 100 clients, r = 25: independent Poisson q = 0.25, with the default
  client-calibrated placement (every client draws d normals) and with server noise, against banded b = 4 cyclic
  groups; DP-NormFedAvg at epsilon = 5, E = 1 on a task whose gradient is ``w - t_i``, so the round is
  the engine's and the mechanism's work, not a model's), median seconds per round over K rounds after the first.

    python benchmarks/bench_banded_mf.py [--rounds 12] [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

from dpfedavg.config import RunConfig
from dpfedavg.core.banded_mf import BandedNoiseStream, sqrt_prefix_coefficients
from dpfedavg.core.dp import gaussian_noise
from dpfedavg.engines.batched import run_batched


class Targets:
    """``f_i(w) = ||w - t_i||^2 / 2`` with ``t_i`` drawn from the client's id: the cheapest task of dimension d."""

    name = "targets"
    metric_names = ("distance",)
    headline_metric = "distance"

    def __init__(self, cfg: RunConfig, dim: int) -> None:
        self.num_clients, self.dim = cfg.num_clients, dim

    def initial_weights(self) -> np.ndarray:
        return np.zeros(self.dim)

    def client_grad_fn(self, client_id: int):
        target = np.random.default_rng(client_id).standard_normal(self.dim)
        return lambda w: w - target

    def evaluate(self, w: np.ndarray) -> dict[str, float]:
        return {"distance": float(np.linalg.norm(w))}


def noise_only(dim: int, repeats: int) -> dict[str, float]:
    """Median ms per round of the server's noise: independent vs the banded stream."""
    rng = np.random.default_rng(0)
    out = {}
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        gaussian_noise(dim, 1.0, rng)
        times.append(time.perf_counter() - t)
    out["independent"] = 1e3 * statistics.median(times)
    for bands in (1, 4, 16):
        stream = BandedNoiseStream(sqrt_prefix_coefficients(bands), dim, 1.0)
        times = []
        for k in range(repeats + bands):
            t = time.perf_counter()
            stream.next(k, rng)
            times.append(time.perf_counter() - t)
        out[f"banded b={bands}"] = 1e3 * statistics.median(times[bands:])  # after the buffer filled
    return out


def whole_rounds(dim: int, rounds: int, mechanism: str) -> float:
    """Median seconds per round of the batched engine (after the first round)."""
    values = {"num-clients": 100, "clients-per-round": 25.0, "num-rounds": rounds, "local-steps": 1,
              "algorithm": "norm", "clip": 1.0, "epsilon": 5.0, "checkpoint-every": 0,
              "eval-every": rounds}  # fmt: skip
    if mechanism == "banded-mf":
        values.update({"noise-mechanism": "banded-mf", "noise-placement": "server"})
    elif mechanism == "independent-server":
        values["noise-placement"] = "server"
    stamps: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = RunConfig.from_run_config({**values, "output-dir": tmp, "run-name": mechanism})
        run_batched(cfg, task=lambda c: Targets(c, dim), on_round=lambda k, w: stamps.append(time.perf_counter()),
                    threads=1)  # fmt: skip
    per_round = [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]
    return statistics.median(per_round)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    for dim in (7850, 1_000_000):
        noise = noise_only(dim, args.repeats)
        print(f"d = {dim}: server noise per round (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in noise.items()))
        for mechanism in ("independent", "independent-server", "banded-mf"):
            s = whole_rounds(dim, args.rounds, mechanism)
            print(f"d = {dim}: batched engine, {mechanism}: {1e3 * s:.1f} ms per round")


if __name__ == "__main__":
    main()
