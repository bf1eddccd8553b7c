#!/usr/bin/env python
"""Seconds per round of the batched engine on torch tasks against the numpy closed form, FMNIST shapes.

n = 3000 clients, r = 600 (q = 0.2), 20 examples per client, E = 20, DP-NormFedAvg at
epsilon = 5 (PLD), on generated images in the original IDX format (this machine cannot download
Fashion-MNIST; the cost does not depend on the pixel values):

* ``fmnist`` logistic regression 784 x 10 (+10), ``backend = numpy``: the exact closed form of
  the E steps (``LogisticTask.client_batch_update_fn``), the reference;
* the same with ``backend = torch``: the same closed form in torch (``LogisticTask._torch_closed_form``);
* the same objective through the generic `TorchTask` path (``torch.func``
  autograd steps, vmapped over each block of clients; what any ``nn.Module`` gets), loaded as
  ``task = "<this file>:generic_logistic"`` (a user's ``module:factory``);
* the same model as a user writes it, ``nn.Sequential(nn.Linear(784, 10))`` through ``TorchTask``
  (``task = "<this file>:user_linear"``): PyTorch's ``(out, in)`` weight layout, the generic path;
* ``mlp-fmnist``: the MLP 784-100-10 on torch (79,510 parameters), the generic path.

The per-round time is the median of ``elapsed_s`` differences over rounds where the server does
not evaluate. ``--device cuda`` runs the torch tasks on the GPU.

    python benchmarks/bench_torch.py [--clients 3000] [--rounds 12] [--device auto|cpu|cuda] [--dtype float32]
        [--torch-threads N] [--only numpy torch-logistic torch-logistic-vmap torch-mlp]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from bench_engines import fmnist_workload, per_round  # noqa: I001 - a sibling script

from dpfedavg.config import RunConfig
from dpfedavg.engines.batched import run_batched


def generic_logistic(cfg: RunConfig):  # -> LogisticTask
    """FMNIST logistic regression whose batched updates come from the generic vmapped autograd steps."""
    from dpfedavg.tasks.logistic import LogisticTask

    task = LogisticTask(cfg.replace(task="fmnist", backend="torch"))
    task.client_batch_update_fn = lambda ids, server_round=0: task.torch_task.client_batch_update_fn(ids, server_round)
    # a sweep's batch takes the same generic steps, over runs x clients (engines/batched_runs.py)
    task.client_runs_update_fn = lambda ids, server_round=0: task.torch_task.client_runs_update_fn(ids, server_round)
    task.supports_run_axis = True
    return task


def user_linear(cfg: RunConfig):  # -> TorchTask
    """The same model as a user would write it: ``nn.Sequential(nn.Linear(784, 10))`` on the FMNIST shards."""
    from dpfedavg.tasks.torch_examples import _on_shards, mlp

    return _on_shards(cfg, "fmnist", mlp((784, 10)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--device", default="cpu", help="device of the torch tasks (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--torch-threads", type=int, default=0, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--only", nargs="*", default=None, help="cells to run (default: all)")
    args = parser.parse_args()
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench-torch-"))
    n, k = args.clients, args.rounds
    base = fmnist_workload(tmp, n, k)  # each cell sets its task
    torch_keys = {"device": args.device, "torch-dtype": args.dtype}
    cells = {
        "numpy": {"task": "fmnist"},
        "torch-logistic": {"task": "fmnist", "backend": "torch", **torch_keys},
        "torch-logistic-vmap": {"task": f"{Path(__file__).resolve()}:generic_logistic", **torch_keys},
        "torch-user-linear": {"task": f"{Path(__file__).resolve()}:user_linear", **torch_keys},
        "torch-mlp": {"task": "mlp-fmnist", **torch_keys},
    }
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min)", flush=True)
    print("| task | backend / device | s per round (median) | ms per sampled client | wall (s) |")
    print("|---|---|---|---|---|")
    for label, values in cells.items():
        if args.only and label not in args.only:
            continue
        cfg = RunConfig.from_run_config({**base, **values, "run-name": label})
        t0 = time.monotonic()
        out = run_batched(cfg).directory
        wall = time.monotonic() - t0
        s = per_round(out)
        where = {"numpy": "numpy closed form", "torch-logistic": "torch closed form"}.get(label, "torch.func vmap")
        if label != "numpy":
            where += f", {args.dtype}, {args.device}, {args.torch_threads or 'default'} torch threads"
        names = {"torch-logistic-vmap": "fmnist (logistic, ours)", "torch-user-linear": "fmnist (`nn.Linear(784, 10)`)"}
        name = names.get(label, "fmnist" if label.startswith(("numpy", "torch-logistic")) else cfg.task)
        print(f"| {name} | {where} | {s:.3f} | {1000 * s / (0.2 * n):.2f} | {wall:.1f} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f} (1 min)", flush=True)


if __name__ == "__main__":
    main()
