#!/usr/bin/env python
"""DP for a Flower app: Flower's own wrapper and dpfedavg, side by side, on examples/quickstart-pytorch-dp.

The same app (the example's ``Net``, data, ``train`` with SGD and mini-batches, 20 SuperNodes, half of them
per round, 15 rounds, server-side evaluation) runs in this process (an in-process Grid, no Ray) with:

* dpfedavg, ``DPFedAvg(algorithm="clip", epsilon=target, noise_placement="server")``: central noise
  ``N(0, (zC)^2)`` on the sum, z calibrated for the target with Poisson amplification (q = 0.5);
* Flower's ``DifferentialPrivacyServerSideFixedClipping(FedAvg(fraction_train=0.5), z, C, 10)`` with its
  ``RdpAccountant`` (which must use ``NO_AMPLIFICATION``: the wrapper refuses Poisson sampling) at the
  **same z** (the same central noise per round; the ClientApp without ``dp_mod``: the server clips), and at
  the **same target epsilon** (its z found by bisection on Flower's own accountant: it takes no target);
* the example as shipped: DP-NormFedAvg, client-calibrated noise, the same target.

Each setting runs ``--repeats`` times (torch, numpy and random seeded per repeat; dpfedavg's seed too) and
reports epsilon, the final accuracy on the server's 1000 test images (mean and range) and seconds per round.
Also prints the accounting-only comparison of the issue (z = 1.51, n = 100, 10 per round, 200 rounds).

    python benchmarks/bench_flower_dp.py [--repeats 3] [--rounds 15] [--epsilon 8]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "quickstart-pytorch-dp"))

from flwr.app import ArrayRecord, ConfigRecord  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import GaussianPrivacyEvent, PrivacyConfig, RdpAccountant  # noqa: E402
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg  # noqa: E402
from flwr.supercore.privacy_accounting import NeighboringRelation, SamplingMethod  # noqa: E402
from pytorchexample import client_app as example_client  # noqa: E402
from pytorchexample.server_app import global_evaluate  # noqa: E402
from pytorchexample.task import Net  # noqa: E402

from dpfedavg import DPFedAvg, InProcessGrid, epsilon_for  # noqa: E402

NODES, FRACTION, CLIP, DELTA, LR = 20, 0.5, 0.3, 1e-5, 0.05
RUN_CONFIG = {"batch-size": 32, "local-epochs": 1}


def plain_client_app() -> ClientApp:
    """The example's train function without dp_mod (Flower's server-side wrapper clips on the server)."""
    app = ClientApp()
    app.train()(example_client.train)  # Flower's decorator returns the user's function unchanged
    return app


def flower_epsilon(z: float, rounds: int) -> float:
    """Epsilon from Flower's RdpAccountant as the wrapper composes it (no amplification)."""
    config = PrivacyConfig(
        target_delta=DELTA,
        population_size=NODES,
        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
        sampling_method=SamplingMethod.NO_AMPLIFICATION,
    )
    accountant = RdpAccountant(config)
    sample = int(NODES * FRACTION)
    for _ in range(rounds):
        accountant.compose(GaussianPrivacyEvent(noise_multiplier=z, sample_size=sample, population_size=NODES))
    return accountant.get_privacy_spent().epsilon


def flower_z_for(epsilon: float, rounds: int) -> float:
    """The smallest z (to 0.1%) at which Flower's accountant reports at most ``epsilon``."""
    low, high = 0.1, 200.0
    while high / low > 1.001:
        mid = (low * high) ** 0.5
        low, high = (mid, high) if flower_epsilon(mid, rounds) > epsilon else (low, mid)
    return high


class Clock:
    """``evaluate_fn`` with timestamps: Flower's start and dpfedavg's both call it before round 1 and after each
    round, so (t_K - t_0) / K is the seconds per round (training and evaluation), t_0 - start the set-up."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: dict[int, float] = {}

    def __call__(self, server_round: int, arrays: ArrayRecord):
        metrics = global_evaluate(server_round, arrays)
        self.times[server_round] = time.perf_counter()
        return metrics

    def summary(self, rounds: int) -> dict[str, float]:
        return {
            "setup_s": self.times[0] - self.start,
            "s_per_round": (self.times[rounds] - self.times[0]) / rounds,
        }


def _seed(repeat: int) -> None:
    torch.manual_seed(repeat)
    np.random.seed(repeat)
    random.seed(repeat)


def run_flower(z: float, rounds: int, repeat: int) -> dict:
    _seed(repeat)
    config = PrivacyConfig(
        target_delta=DELTA,
        population_size=NODES,
        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
        sampling_method=SamplingMethod.NO_AMPLIFICATION,
    )
    strategy = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(fraction_train=FRACTION, fraction_evaluate=0.0),
        noise_multiplier=z,
        clipping_norm=CLIP,
        num_sampled_clients=int(NODES * FRACTION),
        accountant=RdpAccountant(config),
    )
    grid = InProcessGrid(plain_client_app(), NODES, RUN_CONFIG, seed=repeat)
    clock = Clock()
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=rounds,
                            train_config=ConfigRecord({"lr": LR}), evaluate_fn=clock)  # fmt: skip
    accuracy = float(result.evaluate_metrics_serverapp[rounds]["accuracy"])
    return {"epsilon": strategy.privacy_spent().epsilon, "accuracy": accuracy, "z": z, **clock.summary(rounds)}


def run_dpfedavg(rounds: int, repeat: int, **settings) -> dict:
    _seed(repeat)
    strategy = DPFedAvg(fraction_train=FRACTION, delta=DELTA, seed=repeat, **settings)
    grid = InProcessGrid(example_client.app, NODES, RUN_CONFIG, seed=repeat)
    clock = Clock()
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=rounds,
                            train_config=ConfigRecord({"lr": LR}), evaluate_fn=clock)  # fmt: skip
    accuracy = float(result.evaluate_metrics_serverapp[rounds]["accuracy"])
    return {"epsilon": strategy.epsilon, "accuracy": accuracy, "z": strategy.plan.noise_multiplier,
            **clock.summary(rounds)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--epsilon", type=float, default=8.0)
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    logging.getLogger("dpfedavg").setLevel(logging.WARNING)
    DPFedAvg.settle_seconds = 0.05  # the in-process grid has every node from the start
    torch.set_num_threads(1)
    k = args.rounds

    print("Accounting only (no training): z = 1.51, n = 100, 10 sampled per round, 200 rounds, delta = 1e-5")
    print(f"  Flower RdpAccountant (no amplification): epsilon = {flower_epsilon_n(1.51, 200, 100, 10):.2f}")
    print(f"  dpfedavg PLD (Poisson, q = 0.1):          epsilon = {epsilon_for(1.51, 0.1, 200, 1e-5, 'pld'):.3f}")
    print()

    flower_z = flower_z_for(args.epsilon, k)
    run_flower(flower_z, 1, 99)  # warm-up (imports, torch, the accountants' caches): not measured
    run_dpfedavg(1, 99, algorithm="clip", clip=CLIP, epsilon=args.epsilon)
    rows: dict[str, list[dict]] = {
        "Flower wrapper, z = dpfedavg's": [],
        "dpfedavg clip, server noise, target epsilon": [],
        "Flower wrapper, target epsilon": [],
        "dpfedavg norm (the example), target epsilon": [],
    }
    names = list(rows)
    for repeat in range(args.repeats):
        target = run_dpfedavg(k, repeat, algorithm="clip", clip=CLIP, epsilon=args.epsilon, noise_placement="server")
        rows[names[1]].append(target)
        rows[names[0]].append(run_flower(target["z"], k, repeat))  # the same central noise per round
        rows[names[2]].append(run_flower(flower_z, k, repeat))
        rows[names[3]].append(run_dpfedavg(k, repeat, algorithm="norm", clip=CLIP, epsilon=args.epsilon))
        print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)

    print(f"Training: {NODES} SuperNodes, q = {FRACTION}, C = {CLIP}, K = {k}, delta = {DELTA}, "
          f"target epsilon = {args.epsilon:g}, {args.repeats} repeats")  # fmt: skip
    print("| run | z | epsilon reported | accuracy (mean, min-max) | s per round (median) | set-up s (median) |")
    print("|---|---|---|---|---|---|")
    for name, results in rows.items():
        acc = [r["accuracy"] for r in results]
        print(
            f"| {name} | {results[0]['z']:.4g} | {statistics.mean(r['epsilon'] for r in results):.3f} | "
            f"{statistics.mean(acc):.3f} ({min(acc):.3f}-{max(acc):.3f}) | "
            f"{statistics.median(r['s_per_round'] for r in results):.2f} | "
            f"{statistics.median(r['setup_s'] for r in results):.2f} |"
        )


def flower_epsilon_n(z: float, rounds: int, population: int, sample: int) -> float:
    config = PrivacyConfig(
        target_delta=1e-5,
        population_size=population,
        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
        sampling_method=SamplingMethod.NO_AMPLIFICATION,
    )
    accountant = RdpAccountant(config)
    for _ in range(rounds):
        accountant.compose(GaussianPrivacyEvent(noise_multiplier=z, sample_size=sample, population_size=population))
    return accountant.get_privacy_spent().epsilon


if __name__ == "__main__":
    main()
