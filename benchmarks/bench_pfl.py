"""pfl-research against dpfedavg's general torch path: the same workload, measured back to back.

The workload (issue 32's FMNIST shapes): n = 3000 clients of 20 examples (784 pixels, 10 classes), a cohort
of r = 600 per round (q = 0.2), E = 20 full-batch local SGD steps at eta = 0.01, logistic regression
784 x 10 (+10, d = 7850), clipping at C = 62.5, server momentum, Gaussian noise calibrated to
(5, 1e-5) with PLD accounting. Data are generated (this machine cannot download Fashion-MNIST); the cost
of a round does not depend on the pixel values.

* **dpfedavg**: the batched engine with the generic ``torch.func`` path (what any ``nn.Module`` gets), float32,
  in this process, on pfl's model ``nn.Linear(784, 10)`` (``bench_torch.py:user_linear``) and on the logistic
  task's model (``bench_torch.py:generic_logistic``).
* **pfl**: Apple's ``pfl`` 0.6.0 (``FederatedAveraging``, ``SimulatedBackend``, ``PyTorchModel``, a central
  ``GaussianMechanism`` from its ``PLDPrivacyAccountant``, ``WeightByUser``), in one process and with
  ``--pfl-workers`` processes under ``torchrun`` (pfl's own way to use several cores). pfl samples a
  fixed cohort of r users per round; dpfedavg Poisson-samples (r on average): the same arithmetic.

pfl 0.6.0 pins ``dp-accounting < 0.6`` and this project needs 0.6, so pfl lives in its own environment
(never a test dependency)::

    python3 -m venv /tmp/pfl-venv
    /tmp/pfl-venv/bin/pip install torch==2.13.0 "pfl[pytorch]==0.6.0"
    python benchmarks/bench_pfl.py --pfl-python /tmp/pfl-venv/bin/python [--compile]

``--compile`` adds dpfedavg's ``nn.Linear`` with ``torch-compile = true`` (the compiled local steps over chunks of
clients and the float32 device pipeline; its first round holds the compilation).

Each side reports the median seconds per round over rounds 2..K (round 1 holds one-off start-up); the table
gives pfl's time over dpfedavg's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

N_CLIENTS, PER_CLIENT, COHORT_FRACTION, LOCAL_STEPS, LOCAL_LR, CLIP = 3000, 20, 0.2, 20, 0.01, 62.5


# ---------------------------------------------------------------------------------------------- the pfl side
def pfl_worker(clients: int, rounds: int, out: Path) -> None:
    """Run the workload in pfl (this process is one pfl worker); rank 0 writes the round times to ``out``."""
    import numpy as np
    import torch
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByUser
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal.ops.selector import get_framework_module
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel
    from pfl.privacy import CentrallyAppliedPrivacyMechanism, GaussianMechanism, PLDPrivacyAccountant

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    x = rng.random((clients * PER_CLIENT, 784), dtype=np.float32)
    y = rng.integers(0, 10, clients * PER_CLIENT)
    slices = {u: [x[u * PER_CLIENT : (u + 1) * PER_CLIENT], y[u * PER_CLIENT : (u + 1) * PER_CLIENT]]
              for u in range(clients)}  # fmt: skip
    federated = FederatedDataset.from_slices(slices, get_user_sampler("random", list(range(clients))))

    class Logistic(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(784, 10)

        def forward(self, inputs):
            return self.linear(inputs)

        def loss(self, inputs, labels, is_eval=False):
            return torch.nn.functional.cross_entropy(self(inputs), labels.long())

        def metrics(self, inputs, labels):
            with torch.no_grad():
                value = torch.nn.functional.cross_entropy(self(inputs), labels.long(), reduction="sum")
            return {"loss": Weighted(value, len(labels))}

    net = Logistic()
    model = PyTorchModel(
        model=net,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0, momentum=0.8),
    )
    cohort = int(COHORT_FRACTION * clients)
    accountant = PLDPrivacyAccountant(
        num_compositions=rounds, sampling_probability=cohort / clients, mechanism="gaussian", epsilon=5.0, delta=1e-5
    )
    mechanism = GaussianMechanism.from_privacy_accountant(accountant=accountant, clipping_bound=CLIP)
    backend = SimulatedBackend(
        training_data=federated,
        val_data=None,
        postprocessors=[WeightByUser(), CentrallyAppliedPrivacyMechanism(mechanism)],
    )
    stamps = [time.perf_counter()]

    class Stopwatch(TrainingProcessCallback):
        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            stamps.append(time.perf_counter())
            return False, Metrics()

    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=rounds,
            evaluation_frequency=rounds + 1,
            train_cohort_size=cohort,
            val_cohort_size=None,
        ),  # fmt: skip
        backend=backend,
        model=model,
        model_train_params=NNTrainHyperParams(
            local_learning_rate=LOCAL_LR, local_num_epochs=LOCAL_STEPS, local_batch_size=None
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=None),
        callbacks=[Stopwatch()],
    )
    if get_framework_module().distributed.global_rank == 0:
        out.write_text(json.dumps({"stamps": stamps, "noise_stddev": float(mechanism.relative_noise_stddev)}))


def run_pfl(python: str, clients: int, rounds: int, workers: int, tmp: Path) -> dict:
    """Launch `pfl_worker()` under ``python`` (``torchrun`` for more than one worker); its round times."""
    out = tmp / f"pfl-{workers}.json"
    worker = [str(Path(__file__).resolve()), "--pfl-worker", "--clients", str(clients), "--rounds", str(rounds),
              "--out", str(out)]  # fmt: skip
    if workers == 1:
        command = [python, *worker]
    else:
        command = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}", *worker]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // workers))}
    t0 = time.monotonic()
    with (tmp / f"pfl-{workers}.log").open("w") as log:  # pfl prints every round's metrics
        subprocess.run(command, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    stamps = json.loads(out.read_text())["stamps"]
    return {
        "per_round": statistics.median(b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)),
        "wall": time.monotonic() - t0,
    }


# ---------------------------------------------------------------------------------------- the dpfedavg side
def run_dpfedavg(clients: int, rounds: int, tmp: Path, factory: str, extra: dict | None = None) -> dict:
    """The same workload on dpfedavg's generic torch path (the batched engine), in this process.

    ``factory``: ``user_linear`` (``nn.Linear(784, 10)``, pfl's model) or ``generic_logistic`` (the logistic
    task's model), both from ``bench_torch.py``; ``extra``: more run-config keys (``torch-compile``).
    """
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_engines import fmnist_workload, per_round

    from dpfedavg.config import RunConfig
    from dpfedavg.engines.batched import run_batched

    task = f"{Path(__file__).resolve().parent / 'bench_torch.py'}:{factory}"
    extra = extra or {}
    name = factory + ("-compiled" if extra.get("torch-compile") else "")
    values = {**fmnist_workload(tmp, clients, rounds), "task": task, "torch-dtype": "float32",
              "server-momentum": 0.8, "run-name": name, **extra}  # fmt: skip
    same = (values["clip"], values["local-lr"], values["clients-per-round"]) == (
        CLIP,
        LOCAL_LR,
        COHORT_FRACTION * clients,
    )
    assert same, "bench_engines.fmnist_workload no longer matches the pfl side's constants"
    t0 = time.monotonic()
    directory = run_batched(RunConfig.from_run_config(values)).directory
    return {"per_round": per_round(directory, first=2), "wall": time.monotonic() - t0}  # as pfl's: rounds 2..K


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pfl-python", help="the python of an environment with pfl[pytorch]==0.6.0 (see above)")
    parser.add_argument("--pfl-workers", type=int, nargs="*", default=[1, 2], help="pfl process counts (default 1 2)")
    parser.add_argument("--clients", type=int, default=N_CLIENTS)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--compile", action="store_true", help="also run dpfedavg's nn.Linear with "
                        "torch-compile = true (the compiled local steps and the float32 device pipeline)")  # fmt: skip
    parser.add_argument("--pfl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pfl_worker:
        pfl_worker(args.clients, args.rounds, args.out)
        return
    if not args.pfl_python:
        parser.error("--pfl-python is required: the python of an environment with pfl[pytorch]==0.6.0")
    tmp = Path(tempfile.mkdtemp(prefix="bench-pfl-"))
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min)", flush=True)
    ours_name = "dpfedavg, `nn.Linear(784, 10)` (pfl's model), generic torch.func path"
    compiled_name = "dpfedavg, `nn.Linear(784, 10)`, `torch-compile = true`"
    results = {
        ours_name: run_dpfedavg(args.clients, args.rounds, tmp, "user_linear"),
        **(
            {compiled_name: run_dpfedavg(args.clients, args.rounds, tmp, "user_linear", {"torch-compile": True})}
            if args.compile
            else {}
        ),  # fmt: skip
        "dpfedavg, the logistic task's model, generic torch.func path": run_dpfedavg(
            args.clients, args.rounds, tmp, "generic_logistic"
        ),
    }
    for workers in args.pfl_workers:
        results[f"pfl 0.6.0, {workers} process(es)"] = run_pfl(args.pfl_python, args.clients, args.rounds, workers, tmp)
    ours = results[ours_name]["per_round"]
    print(f"load average after: {os.getloadavg()[0]:.2f} (1 min)")
    print("| path | s per round (median) | wall (s) | s per round / dpfedavg's |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['per_round']:.3f} | {r['wall']:.1f} | {r['per_round'] / ours:.2f} |")
    if args.compile:
        fast = results[compiled_name]["per_round"]
        for workers in args.pfl_workers:
            ratio = results[f"pfl 0.6.0, {workers} process(es)"]["per_round"] / fast
            print(f"pfl 0.6.0, {workers} process(es) / dpfedavg with torch-compile: {ratio:.2f}x")


if __name__ == "__main__":
    main()
