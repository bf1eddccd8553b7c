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
* the same with ``torch-compile = true`` (``torch-user-linear-compiled``): the compiled local steps over chunks of
  clients and the float32 device pipeline;
* ``mlp-fmnist``: the MLP 784-100-10 on torch (79,510 parameters), the generic path.

The per-round time is the median of ``elapsed_s`` differences over rounds where the server does
not evaluate. ``--device cuda`` runs the torch tasks on the GPU.

``--gpu-table`` prints issue 37's table instead: a user's ``nn.Linear(784, 10)`` and the MLP (each eager and with
``torch-compile``) and ``cnn-fmnist`` on the task's device (``--device``) at each n of ``--sizes`` (all but
``nn.Linear`` at n <= 15,000; 20 examples per client at every n), with the
time per round, the time per sampled client (it must fall or stay flat as n grows) and the peak device memory
(``torch.cuda.max_memory_allocated``; on the CPU the process's peak resident memory). It imports no Flower
(the device machines have none), so one command measures a GPU::

    python benchmarks/bench_torch.py --gpu-table --device cuda --rounds 12 --sizes 1000 3000 15000 50000

    python benchmarks/bench_torch.py [--clients 3000] [--rounds 12] [--device auto|cpu|cuda] [--dtype float32]
        [--torch-threads N] [--only numpy torch-logistic torch-logistic-vmap torch-user-linear
        torch-user-linear-compiled torch-mlp]
        [--work-dir DIR] [--gpu-table [--sizes N ...]]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
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
    task.device = task.torch_task.device  # the batched engine's device pipeline (engines/batched.py)
    task.device_block_update = lambda ids, server_round=0: task.torch_task.device_block_update(ids, server_round)
    return task


def user_linear(cfg: RunConfig):  # -> TorchTask
    """The same model as a user would write it: ``nn.Sequential(nn.Linear(784, 10))`` on the FMNIST shards."""
    from dpfedavg.tasks.torch_examples import _on_shards, mlp

    return _on_shards(cfg, "fmnist", mlp((784, 10)))


def _peak_memory(device: str) -> tuple[Callable[[], str], Callable[[], None]]:
    """A reader of the cell's peak memory and its reset (CUDA: the device's; CPU: the process's peak RSS)."""
    if device.startswith("cuda"):
        import torch

        read = lambda: f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB (device)"  # noqa: E731
        return read, torch.cuda.reset_peak_memory_stats
    import resource

    return (lambda: f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB (host RSS)"), lambda: None


def gpu_table(args: argparse.Namespace, tmp: Path) -> None:
    """Issue 37's table: s per round, ms per sampled client and peak memory per (model, n)."""
    import torch

    torch_keys = {"device": args.device, "torch-dtype": args.dtype}
    linear = f"{Path(__file__).resolve()}:user_linear"
    models = {"`nn.Linear(784, 10)`": ("user-linear", linear, {}),
              "`nn.Linear(784, 10)`, `torch-compile`": ("user-linear-compiled", linear, {"torch-compile": True}),
              "MLP 784-100-10": ("mlp", "mlp-fmnist", {}),
              "MLP 784-100-10, `torch-compile`": ("mlp-compiled", "mlp-fmnist", {"torch-compile": True}),
              "CNN (`cnn-fmnist`)": ("cnn", "cnn-fmnist", {})}  # fmt: skip
    peak, reset = _peak_memory(args.device)
    print(f"torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else "")
          + f", {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (1 min)", flush=True)  # fmt: skip
    print("| model | n | r | s per round (median) | ms per sampled client | peak memory | wall (s) |")
    print("|---|---|---|---|---|---|---|")
    for n in args.sizes:
        base = {**fmnist_workload(tmp, n, args.rounds), "output-dir": tempfile.mkdtemp(prefix="out-", dir=tmp)}
        for label, (slug, task, extra) in models.items():
            if (n > 15000 and not slug.startswith("user-linear")) or (args.only and slug not in args.only):
                continue
            cfg = RunConfig.from_run_config({**base, **torch_keys, **extra, "task": task, "run-name": f"{slug}-{n}"})
            reset()
            t0 = time.monotonic()
            out = run_batched(cfg).directory
            wall = time.monotonic() - t0
            s = per_round(out)
            print(f"| {label} | {n} | {0.2 * n:g} | {s:.3f} | {1000 * s / (0.2 * n):.3f} | {peak()} | {wall:.1f} |",
                  flush=True)  # fmt: skip
    print(f"load average after: {os.getloadavg()[0]:.2f} (1 min)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--device", default="cpu", help="device of the torch tasks (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--torch-threads", type=int, default=0, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--only", nargs="*", default=None, help="cells to run (default: all; --gpu-table: "
                        "user-linear user-linear-compiled mlp mlp-compiled cnn)")  # fmt: skip
    parser.add_argument("--work-dir", default=None, help="generated data and caches (default: a fresh temp dir)")
    parser.add_argument("--gpu-table", action="store_true", help="issue 37's table over --sizes (see above)")
    parser.add_argument("--sizes", nargs="*", type=int, default=[1000, 3000, 15000, 50000], help="n for --gpu-table")
    args = parser.parse_args()
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    tmp = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="bench-torch-"))
    tmp.mkdir(parents=True, exist_ok=True)
    if args.gpu_table:
        gpu_table(args, tmp)
        return
    n, k = args.clients, args.rounds
    base = {**fmnist_workload(tmp, n, k), "output-dir": tempfile.mkdtemp(prefix="out-", dir=tmp)}  # cells set the task
    torch_keys = {"device": args.device, "torch-dtype": args.dtype}
    cells = {
        "numpy": {"task": "fmnist"},
        "torch-logistic": {"task": "fmnist", "backend": "torch", **torch_keys},
        "torch-logistic-vmap": {"task": f"{Path(__file__).resolve()}:generic_logistic", **torch_keys},
        "torch-user-linear": {"task": f"{Path(__file__).resolve()}:user_linear", **torch_keys},
        "torch-user-linear-compiled": {
            "task": f"{Path(__file__).resolve()}:user_linear",
            "torch-compile": True,
            **torch_keys,
        },  # fmt: skip
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
        names = {"torch-logistic-vmap": "fmnist (logistic, ours)", "torch-user-linear": "fmnist (`nn.Linear(784, 10)`)",
                 "torch-user-linear-compiled": "fmnist (`nn.Linear(784, 10)`, `torch-compile`)"}  # fmt: skip
        name = names.get(label, "fmnist" if label.startswith(("numpy", "torch-logistic")) else cfg.task)
        print(f"| {name} | {where} | {s:.3f} | {1000 * s / (0.2 * n):.2f} | {wall:.1f} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f} (1 min)", flush=True)


if __name__ == "__main__":
    main()
