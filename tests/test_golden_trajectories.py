"""Golden trajectories: seeded runs of every engine give, bit for bit, the results they gave at 72654f0.

These hashes pin behaviour across the issue-45 redesign ("behaviour does not change"): the test must pass,
UNCHANGED, before and after the refactoring. Each case is a small seeded run (the quadratic, d = 12, n = 10,
5 rounds) through a public entry point only, read back from what a user sees (the run's files, or Flower's
``Result`` and ``evaluate_fn``), never from internals:

* the batched engine (`dpfedavg.run`): clip, norm (calibrated z, momentum), adaptive-clip, banded MF
  (server noise), canary clients; a sweep's batch (`dpfedavg.experiments.sweep.run_cells`, three runs at once;
  regenerated once on purpose when the run axis began to sum its clients' noise as ``s sum_i z_i``: the
  adaptive run's float64 metrics from round 2 changed in the last bits, every ``w_k`` and model stayed);
* the Flower simulation in process (`dpfedavg.flower.server_app.main` with `dpfedavg.flower.client_app.app` on
  an `InProcessGrid`), plain, with SecAgg+ and with canary clients;
* `dp_mod` in a Flower-quickstart-shaped app (a user's ClientApp train function, the public `DPFedAvg`), plain and
  inside ``checked_secaggplus_mod`` (Flower's ``secaggplus_mod`` behind the node's stage checks);
* resumes (``resume=true``) reproduce the uninterrupted runs' constants: the Flower run killed in round 4 (its grid
  raises), the batched run killed in round 4 (its task's evaluation raises), and a batched run stopped after
  3 rounds and continued to 5.

What is pinned per case: for every round k = 0..K the SHA-256 (first 16 hex) of ``w_k``
(``trajectory.npy``, which the engines write as float32; the dp_mod case: the user's float64 arrays as
``evaluate_fn`` sees them) and of the round's ``metrics.csv`` row (every column but ``elapsed_s``: the float64
objective, distance and update norm of w_k, epsilon, counts, C_k; these catch what float32 rounds away: noise
scaled by 1 + 1e-12 changes round 1's row); the hash of the final float64 model (``model.npz``: w_K, the random
iterate and its round); the hash of ``config.json``'s final summary (without its time stamp; with canaries, the
audit); and the final epsilon (to 1e-9 relative).

A deliberate behaviour change regenerates the constants with::

    DPFEDAVG_REGENERATE_GOLDEN=1 PYTHONPATH=. python tests/test_golden_trajectories.py

(from the repository root) which prints the new `GOLDEN` to paste here (say why in the commit); it also checks
that each resume reproduces its uninterrupted run. Under pytest (``-s``) the same variable makes each case print
its record instead of comparing. The normal run only compares.

Determinism: each case gave the same hashes twice in a row, in reverse order, and with 1, 4 or 8 BLAS threads and
the engine's default threads at 1 or 8 CPUs (at these sizes a round is one block of clients); SecAgg+'s masks
are random, but they cancel exactly in the sum.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from dpfedavg import DPFedAvg, InProcessGrid, RunConfig, dp_mod, run

REGENERATE = bool(os.environ.get("DPFEDAVG_REGENERATE_GOLDEN"))

#: Every case's run: the paper's quadratic, small.
BASE: dict[str, Any] = {
    "task": "quadratic",
    "dim": 12,
    "num-clients": 10,
    "clients-per-round": 5.0,
    "num-rounds": 5,
    "local-steps": 10,
    "epsilon": 0.0,
    "noise-multiplier": 1.0,
    "delta": 1e-5,
    "algorithm": "clip",
    "clip": 1.0,
    "seed": 3,
    "save-trajectory": True,
    "checkpoint-every": 0,
    "eval-every": 1,
    "run-name": "run",
}


def _cfg(out: Path, **overrides: Any) -> RunConfig:
    return RunConfig.from_run_config({**BASE, "output-dir": str(out), **overrides})


def _h(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------- adapters
# The only places that name an entry point: if the redesign renames one, edit it here (and nothing else).
def _run_batched(cfg: RunConfig, task: Callable[[RunConfig], Any] | None = None) -> Path:
    """The batched engine through the Python API (``task``: a factory of the run's task)."""
    return run(cfg, task=task, progress=False).directory


def _build_task(cfg: RunConfig) -> Any:
    """The task ``cfg`` names, as the engines build it."""
    from dpfedavg.tasks import build_task

    return build_task(cfg)


def _run_sweep_batch(out: Path, cells: dict[str, dict[str, Any]]) -> list[Path]:
    """A sweep's cells (run as one batch: same federation, keys a run axis holds), in this process."""
    from dpfedavg.experiments.sweep import make_cell, run_cells

    return run_cells([make_cell(out, key, values) for key, values in cells.items()], jobs=1, progress=False)


def _run_flower(cfg: RunConfig, grid_cls: type[InProcessGrid] = InProcessGrid, **grid_kwargs: Any) -> Path:
    """The project's ServerApp main on an in-process grid of the project's ClientApp; the run's folder."""
    from dpfedavg.flower import server_app
    from dpfedavg.flower.client_app import app as client_app

    run_config = cfg.to_run_config()
    grid = grid_cls(client_app, cfg.num_clients, run_config, **grid_kwargs)
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=run_config)
    server_app.main(grid=grid, context=context)
    directory = Path(cfg.output_dir) / cfg.run_name
    assert (directory / "model.npz").is_file(), f"the Flower run wrote no model.npz in {directory} (see its log)"
    return directory


# ----------------------------------------------------------------------------------------------- the records
def _run_record(directory: Path) -> dict[str, Any]:
    """What a finished run's folder pins: per-round w_k and metrics rows, the final model, summary and epsilon."""
    trajectory = np.load(directory / "trajectory.npy")
    with (directory / "metrics.csv").open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    with np.load(directory / "model.npz") as model:
        final_model = b"".join(
            np.ascontiguousarray(model[key], dtype="<f8").tobytes()
            for key in ("w_final", "w_random_iterate", "random_iterate_round")
        )
    final = json.loads((directory / "config.json").read_text())["final"]
    summary = {k: v for k, v in final.items() if k != "finished_utc"}
    return {
        "w": [_h(np.ascontiguousarray(w, dtype="<f4").tobytes()) for w in trajectory],
        "metrics": [_h(",".join(f"{k}={row[k]}" for k in sorted(row) if k != "elapsed_s").encode()) for row in rows],
        "final": _h(final_model),
        "summary": _h(json.dumps(summary, sort_keys=True).encode()),
        "epsilon": float(final["epsilon"]),
    }


# --------------------------------------------------------------------------------------------------- the cases
def case_batched_clip(out: Path) -> dict[str, Any]:
    """DP-FedAvg (Alg. 1), fixed z, client-calibrated noise."""
    return _run_record(_run_batched(_cfg(out)))


def case_batched_norm(out: Path) -> dict[str, Any]:
    """DP-NormFedAvg (Alg. 2), z calibrated to epsilon = 4, server momentum."""
    cfg = _cfg(out, algorithm="norm", clip=0.5, epsilon=4.0, **{"noise-multiplier": "auto", "server-momentum": 0.5})
    return _run_record(_run_batched(cfg))


def case_batched_adaptive_clip(out: Path) -> dict[str, Any]:
    """Adaptive clipping (Andrew et al. 2021): C_k follows the privately counted quantile."""
    cfg = _cfg(out, algorithm="adaptive-clip", **{"clip-count-stddev": 2.0, "clip-lr": 0.5})
    return _run_record(_run_batched(cfg))


def case_batched_banded_mf(out: Path) -> dict[str, Any]:
    """Banded matrix-factorization noise added by the server (cyclic participation, b = n / r = 2)."""
    cfg = _cfg(out, **{"noise-mechanism": "banded-mf", "noise-placement": "server"})
    return _run_record(_run_batched(cfg))


def case_batched_canaries(out: Path) -> dict[str, Any]:
    """A run audited with 4 canary clients (the summary pins the audit's numbers)."""
    return _run_record(_run_batched(_cfg(out, **{"canary-clients": 4})))


SWEEP_CELLS: dict[str, dict[str, Any]] = {
    "clip": {**BASE, "algorithm": "clip", "clip": 1.0},
    "norm": {**BASE, "algorithm": "norm", "clip": 0.5, "server-momentum": 0.5},
    "adaptive": {**BASE, "algorithm": "adaptive-clip", "clip-count-stddev": 2.0, "noise-multiplier": 1.5},
}


def case_sweep_batch(out: Path) -> dict[str, Any]:
    """Three cells of a sweep (clip, norm, adaptive-clip) run as one batch; each cell's record."""
    cells = {key: {k: v for k, v in values.items() if k not in ("run-name",)} for key, values in SWEEP_CELLS.items()}
    directories = _run_sweep_batch(out, cells)
    return {key: _run_record(d) for key, d in zip(cells, directories, strict=True)}


FLOWER = {"algorithm": "norm", "clip": 0.5, "server-momentum": 0.3, "checkpoint-every": 2}


def case_flower(out: Path) -> dict[str, Any]:
    """The Flower simulation: the project's ServerApp and ClientApp, DP-NormFedAvg, checkpoints every 2 rounds."""
    return _run_record(_run_flower(_cfg(out, **FLOWER)))


def case_flower_secagg(out: Path) -> dict[str, Any]:
    """The Flower simulation with SecAgg+ (the clients add the noise; the server sees the masked sum only)."""
    cfg = _cfg(out, **{"secure-aggregation": True, "num-rounds": 4})
    return _run_record(_run_flower(cfg))


def case_flower_canaries(out: Path) -> dict[str, Any]:
    """The Flower simulation audited with 4 canary clients (the server computes them beside the real replies)."""
    return _run_record(_run_flower(_cfg(out, **{"canary-clients": 4})))


class _Crash(BaseException):
    """Stands in for the server process dying (not an Exception: nothing may catch it)."""


class _DiesInRound4(InProcessGrid):
    """A grid whose SuperLink goes away while round 4's train messages are out (after round 2's checkpoint)."""

    def _check(self, messages: list[Message]) -> list[Message]:
        for msg in messages:
            if msg.metadata.message_type.startswith("train") and int(msg.content["config"]["server-round"]) >= 4:
                raise _Crash
        return messages

    def send_and_receive(self, messages, *, timeout=None):
        return super().send_and_receive(self._check(list(messages)), timeout=timeout)

    def push_messages(self, messages):
        return super().push_messages(self._check(list(messages)))


def case_flower_resumed(out: Path) -> dict[str, Any]:
    """`case_flower`'s run killed in round 4 and resumed (resume=true, on a new grid): its record must be the
    uninterrupted run's (compared with GOLDEN["flower"])."""
    cfg = _cfg(out, **FLOWER)
    with pytest.raises(_Crash):
        _run_flower(cfg, grid_cls=_DiesInRound4)
    assert (out / "run" / "checkpoint.npz").exists() and not (out / "run" / "model.npz").exists()  # died mid-run
    return _run_record(_run_flower(cfg.replace(resume=True), seed=9))


class _DiesEvaluatingRound4:
    """The quadratic, whose server-side evaluation kills the process in round 4 (after round 2's checkpoint)."""

    def __init__(self, cfg: RunConfig) -> None:
        self._task, self._evaluations = _build_task(cfg), 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def evaluate(self, w: np.ndarray) -> dict[str, float]:
        self._evaluations += 1  # rounds 0, 1, 2, ... (eval-every = 1)
        if self._evaluations == 5:
            raise _Crash
        return self._task.evaluate(w)


def case_batched_crashed(out: Path) -> dict[str, Any]:
    """`case_batched_clip`'s run (checkpoints every 2 rounds) killed in round 4 and resumed: its record must be the
    uninterrupted run's (compared with GOLDEN["batched-clip"])."""
    cfg = _cfg(out, **{"checkpoint-every": 2})
    with pytest.raises(_Crash):
        _run_batched(cfg, task=_DiesEvaluatingRound4)
    assert (out / "run" / "checkpoint.npz").exists() and not (out / "run" / "model.npz").exists()  # died mid-run
    return _run_record(_run_batched(cfg.replace(resume=True)))


def case_batched_resumed(out: Path) -> dict[str, Any]:
    """`case_batched_clip`'s run stopped after round 3 (its last checkpoint) and continued with resume=true to
    round 5: every round's w_k and metrics row must be the uninterrupted run's (compared with
    GOLDEN["batched-clip"]; the random iterate is drawn over the rounds the last process ran)."""
    first = _run_batched(_cfg(out, **{"num-rounds": 3, "checkpoint-every": 1}))
    assert len(np.load(first / "trajectory.npy")) == 4
    return _run_record(_run_batched(_cfg(out, resume=True, **{"checkpoint-every": 1})))


# ---- dp_mod in a user's Flower app (Flower's quickstart shape: a train function, mods=[dp_mod], a strategy)
W_STAR = np.random.default_rng(7).normal(size=7)


def _user_arrays(w: np.ndarray) -> ArrayRecord:
    """The user's model: a 2x3 weight and a bias, float64 (so evaluate_fn sees the exact w_k)."""
    return ArrayRecord({"layer.weight": Array(w[:6].reshape(2, 3).copy()), "layer.bias": Array(w[6:].copy())})


def _user_train(msg: Message, context: Context) -> Message:
    """A numpy client: 5 least-squares gradient steps on its own data; its new weights and its own metric."""
    pid = int(context.node_config["partition-id"])
    arrays = msg.content["arrays"]
    w = np.concatenate([arrays["layer.weight"].numpy().ravel(), arrays["layer.bias"].numpy()]).astype(np.float64)
    x = np.random.default_rng(100 + pid).normal(size=(30, w.size))
    y = x @ W_STAR
    for _ in range(5):
        w = w - float(msg.content["config"]["lr"]) * x.T @ (x @ w - y) / len(y)
    metrics = MetricRecord({"train_loss": float(np.mean((x @ w - y) ** 2)), "num-examples": 30})
    return Message(RecordDict({"arrays": _user_arrays(w), "metrics": metrics}), reply_to=msg)


def _dp_mod_app(out: Path, secure_aggregation: bool = False) -> dict[str, Any]:
    """`dp_mod` around a user's train function (inside ``checked_secaggplus_mod`` with secure aggregation), the
    public `DPFedAvg` (keywords) in the user's server code; evaluate_fn sees every round's float64 arrays."""
    from dpfedavg import checked_secaggplus_mod

    client = ClientApp()
    client.train(mods=[checked_secaggplus_mod, dp_mod] if secure_aggregation else [dp_mod])(_user_train)
    strategy = DPFedAvg(algorithm="clip", clip=0.3, epsilon=4.0, delta=1e-5, clients_per_round=6.0, num_clients=10,
                        seed=3, secure_aggregation=secure_aggregation)  # fmt: skip
    seen: dict[int, bytes] = {}

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        seen[server_round] = b"".join(np.ascontiguousarray(a.numpy(), dtype="<f8").tobytes() for a in arrays.values())
        return MetricRecord({})

    rounds = 5
    result = strategy.start(
        grid=InProcessGrid(client, 10, {}),
        initial_arrays=_user_arrays(np.zeros(7)),
        num_rounds=rounds,
        train_config=ConfigRecord({"lr": 0.05}),
        evaluate_fn=evaluate,
    )
    train = result.train_metrics_clientapp
    assert sorted(seen) == list(range(rounds + 1))
    return {
        "w": [_h(seen[k]) for k in sorted(seen)],
        "metrics": [_h(json.dumps(dict(train[k]), sort_keys=True).encode()) for k in sorted(train)],
        "final": _h(seen[rounds]),
        "epsilon": float(train[rounds]["epsilon"]),
    }


def case_dp_mod(out: Path) -> dict[str, Any]:
    """`dp_mod` in a user's app (client-calibrated noise, the user's float64 arrays)."""
    return _dp_mod_app(out)


def case_dp_mod_secagg(out: Path) -> dict[str, Any]:
    """`dp_mod` inside ``secaggplus_mod``: the server gets the SecAgg+ sum of the clients' encoded updates only."""
    return _dp_mod_app(out, secure_aggregation=True)


CASES: dict[str, Callable[[Path], dict[str, Any]]] = {
    "batched-clip": case_batched_clip,
    "batched-norm": case_batched_norm,
    "batched-adaptive-clip": case_batched_adaptive_clip,
    "batched-banded-mf": case_batched_banded_mf,
    "batched-canaries": case_batched_canaries,
    "sweep-batch": case_sweep_batch,
    "flower": case_flower,
    "flower-secagg": case_flower_secagg,
    "flower-canaries": case_flower_canaries,
    "dp-mod": case_dp_mod,
    "dp-mod-secagg": case_dp_mod_secagg,
}
#: Resumes: case -> the uninterrupted run whose constants it must reproduce, and which of them.
RESUMES: dict[str, tuple[Callable[[Path], dict[str, Any]], str, tuple[str, ...]]] = {
    # the model continues bit for bit; the privacy charge does not: a Flower server charges its redone rounds
    # (its nodes may draw their own noise, issue 46; tests/test_reliability.py checks the charge)
    "flower-resumed": (case_flower_resumed, "flower", ("w",)),
    "batched-crashed": (case_batched_crashed, "batched-clip", ("w", "metrics", "final", "summary", "epsilon")),
    "batched-resumed": (case_batched_resumed, "batched-clip", ("w", "metrics", "epsilon")),
}

# ------------------------------------------------------------------------------------------ the golden values
GOLDEN: dict[str, Any] = {
    "batched-clip": {
        "w": ["2aefe74eec6211b3", "233206a99c9cd71b", "1d31347327d93352", "0e257faf1e384c43",
            "aeba586e7085af38", "24c0d42519da7062"],
        "metrics": ["a632dbe1389e41e5", "da9a1cf35c3d2c80", "510e9ba5da2f7cd0", "2c208ea2ce7fdefe",
            "3d38daa153528762", "7ed9db16c96fe373"],
        "final": "5dc5ff6855331e5d",
        "summary": "85882c9c21e68cb3",
        "epsilon": 7.422291022120223,
    },
    "batched-norm": {
        "w": ["2aefe74eec6211b3", "43205eeb753bf53c", "c0d5b9cb338aaa58", "7dfbdf8d4d16aef3",
            "b7b0c1b18bea65c9", "77035a8e4f66c9a6"],
        "metrics": ["a632dbe1389e41e5", "aaacf74e033d0bfe", "31aaaf328a2e2e7c", "d44ca1175ff2e83c",
            "5ed07163d912e393", "7e87476f33c75419"],
        "final": "5c503d7494e6db3f",
        "summary": "3ab87a0fcc9cc8c6",
        "epsilon": 3.9997945996428044,
    },
    "batched-adaptive-clip": {
        "w": ["2aefe74eec6211b3", "2b13096fbf3cda4a", "3b905c91e0869b20", "cdfa5494d9e94c01",
            "d460fe999f8b3418", "9267ee97ec9bc45c"],
        "metrics": ["a632dbe1389e41e5", "0ee0696086e92d39", "72b1181823334091", "3063568b65e6275d",
            "14b17dbbc29ee88a", "401f37cbe238b5cc"],
        "final": "2cf63040cda73584",
        "summary": "e094b0edb23d50d4",
        "epsilon": 7.422291022120223,
    },
    "batched-banded-mf": {
        "w": ["2aefe74eec6211b3", "735625efabaa42f9", "446d232adf737bcd", "00058849de946662",
            "511b090e0772e6fd", "299d95c9097d26cb"],
        "metrics": ["a632dbe1389e41e5", "b843f4d351b0771f", "884a24533c9612dc", "9c5cf84bbc10eb87",
            "a4ecaf82f4570ac0", "e8a25e7bcf66a664"],
        "final": "cf411c4100d73b8b",
        "summary": "a566f504252ca232",
        "epsilon": 9.210734081505665,
    },
    "batched-canaries": {
        "w": ["2aefe74eec6211b3", "9e0450908fcf3061", "454d6c07d454a54b", "a18a69fa1ba59b13",
            "d819503369040af4", "364c402b742f8bd2"],
        "metrics": ["a632dbe1389e41e5", "ffd6e0ca75ea62e5", "b3b5c796be89f4e9", "23ab8ea44571a75f",
            "830834dfcf66fed1", "0ee14c219686c203"],
        "final": "c5b91d1f62c2f0ee",
        "summary": "527c6dcf2da284c8",
        "epsilon": 7.422291022120223,
    },
    "sweep-batch": {
        "clip": {
            "w": ["2aefe74eec6211b3", "233206a99c9cd71b", "1d31347327d93352", "0e257faf1e384c43",
                "aeba586e7085af38", "24c0d42519da7062"],
            "metrics": ["a632dbe1389e41e5", "7a044f09e1f04dcf", "510e9ba5da2f7cd0", "d0959f0bb7b702ba",
                "cf5c5beb66c1b7a4", "f42fe47ab371d4d6"],
            "final": "5dc5ff6855331e5d",
            "summary": "11e437f8da93a23b",
            "epsilon": 7.422291022120223,
        },
        "norm": {
            "w": ["2aefe74eec6211b3", "d272af6794321f0d", "cbfec02753d0c6c7", "9952111b306b45b1",
                "f08502f742eced05", "4cd453a0e8df9a55"],
            "metrics": ["a632dbe1389e41e5", "269af704bbffaeb7", "0d812b33ac4a1fe4", "9bc1afaef711f00c",
                "0339cb2a26b12b2e", "2ff7f9c6264d034c"],
            "final": "d3e157600e6aadfb",
            "summary": "6fe7c19b25daa229",
            "epsilon": 7.422291022120223,
        },
        "adaptive": {
            "w": ["2aefe74eec6211b3", "b31dd6abdeb5d76e", "aedeed69003fe5ba", "c4269863565ee494",
                "b66b998eab81cbbf", "fc3d8bf2945dbca0"],
            "metrics": ["a632dbe1389e41e5", "2b01f39b943a8793", "9780115c146e7c10", "88dedd96ea0715ff",
                "004e4d8ea59a3672", "3c1b9ed0a5f41e62"],
            "final": "8ce78019cc8ba0cd",
            "summary": "83c1d679fcefc4d6",
            "epsilon": 4.152349702957114,
        },
    },
    "flower": {
        "w": ["2aefe74eec6211b3", "d272af6794321f0d", "b9d407aca066a0c1", "68d2cad7dfa73989",
            "0c451d479cc9dc41", "62a27db550f4b4ec"],
        "metrics": ["a632dbe1389e41e5", "ec69ded5a7234354", "4f9d8708e8321831", "5139cd04c074434f",
            "3e846c47467c306c", "e09b40e5b301d2ec"],
        "final": "813eaf5eb098dfe9",
        "summary": "ee352295c30664bb",
        "epsilon": 7.422291022120223,
    },
    "flower-secagg": {
        "w": ["2aefe74eec6211b3", "69b37272f6fb32a6", "89419c99d5173f5d", "e0cd9228274a7099",
            "06debcdbdd8c1200"],
        "metrics": ["a632dbe1389e41e5", "3a73a6ece60de5d6", "4cd03d27765c69be", "9d7f8f4543f25e4f",
            "d8711d444765c822"],
        "final": "3d23a970823c8ba6",
        "summary": "3cfffe5d0806828c",
        "epsilon": 6.676961876150524,
    },
    "flower-canaries": {
        "w": ["2aefe74eec6211b3", "9e0450908fcf3061", "454d6c07d454a54b", "a18a69fa1ba59b13",
            "d819503369040af4", "364c402b742f8bd2"],
        "metrics": ["a632dbe1389e41e5", "1eb419b6adf67164", "6df61eaa30918167", "4103e6188e94322c",
            "2b398e2976e79327", "395afbcbc8503d30"],
        "final": "790b60f19b70faf1",
        "summary": "26d7e9cb7a67472e",
        "epsilon": 7.422291022120223,
    },
    "dp-mod": {
        "w": ["d4817aa5497628e7", "23c0574267fdb8ae", "1aad311bdb95c6ac", "ff67bc69337d1204",
            "a471976bdc80e23c", "edf733224004bbab"],
        "metrics": ["84d366105d0358c2", "d75b903945b88225", "8d6c283bf9cb9e82", "e6227b4438eb7c69",
            "3bab3446a8d6310e"],
        "final": "edf733224004bbab",
        "epsilon": 3.9971414696945997,
    },
    "dp-mod-secagg": {
        "w": ["d4817aa5497628e7", "29535b90406b40d5", "9d1a1a9bab04cb68", "5775d7fceac78f13",
            "e88485f8064d98a0", "3ef6432748e05616"],
        "metrics": ["e85a69cccddfd951", "95089c95c17b5c0b", "84d9164a1b0a3334", "e215b688c18098cd",
            "562091117c57b8c7"],
        "final": "3ef6432748e05616",
        "epsilon": 3.9971414696945997,
    },
}


# -------------------------------------------------------------------------------------------------- the tests
def _compare(name: str, got: dict[str, Any], want: dict[str, Any], keys: tuple[str, ...] | None = None) -> None:
    if "epsilon" not in want:  # a sweep: one record per cell
        assert sorted(got) == sorted(want), name
        for cell in want:
            _compare(f"{name}/{cell}", got[cell], want[cell], keys)
        return
    for key in keys or tuple(want):
        if key == "epsilon":
            assert math.isclose(got[key], want[key], rel_tol=1e-9), f"{name}: epsilon {got[key]!r} != {want[key]!r}"
        elif isinstance(want[key], list):
            first = next((k for k, (a, b) in enumerate(zip(got[key], want[key])) if a != b), None)
            assert got[key] == want[key], (
                f"{name}: {key} differs" + (f" first in round {first}" if first is not None else " in length")
                + f": {got[key]} != {want[key]}"
            )  # fmt: skip
        else:
            assert got[key] == want[key], f"{name}: {key} {got[key]} != {want[key]}"


def _literal(value: Any, level: int = 0) -> str:
    """``value`` (dicts of hash lists and floats) as Python source in this file's layout, lines under 120."""
    pad = "    " * (level + 1)
    if isinstance(value, dict):
        items = "".join(f"{pad}{json.dumps(key)}: {_literal(item, level + 1)},\n" for key, item in value.items())
        return "{\n" + items + "    " * level + "}"
    if isinstance(value, list):
        lines = [", ".join(json.dumps(v) for v in value[i : i + 4]) for i in range(0, len(value), 4)]
        return "[" + f",\n{pad}".join(lines) + "]"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _regenerated(name: str, record: dict[str, Any]) -> None:
    print(f"\n    {name!r}: {_literal(record, 1)},")  # noqa: T201 - the new constants


@pytest.mark.parametrize("name", list(CASES))
def test_a_seeded_run_gives_its_golden_trajectory(name: str, tmp_path: Path) -> None:
    record = CASES[name](tmp_path)
    if REGENERATE:
        _regenerated(name, record)
        return
    _compare(name, record, GOLDEN[name])


@pytest.mark.parametrize("name", list(RESUMES))
def test_a_resumed_run_continues_the_uninterrupted_runs_trajectory(name: str, tmp_path: Path) -> None:
    case, original, keys = RESUMES[name]
    record = case(tmp_path)
    if REGENERATE:
        _regenerated(name, record)
        return
    _compare(f"{name} (against {original})", record, GOLDEN[original], keys)


def _regenerate_all() -> None:
    """Run every case in temporary folders and print `GOLDEN` as a literal to paste above."""
    from dpfedavg.flower.testing import ensure_task_identity

    ensure_task_identity()
    with tempfile.TemporaryDirectory(prefix="dpfedavg-golden-") as tmp:
        os.environ["FLWR_HOME"] = str(Path(tmp) / "flwr-home")  # the nodes' ledgers (none without a policy)
        records = {name: case(Path(tmp) / name) for name, case in CASES.items()}
        for name, (case, original, keys) in RESUMES.items():
            resumed = case(Path(tmp) / name)
            _compare(name, resumed, records[original], keys)  # a resume that does not continue is a bug, not gold
    print(f"GOLDEN: dict[str, Any] = {_literal(records)}")  # noqa: T201


if __name__ == "__main__":
    if not REGENERATE:
        sys.exit("set DPFEDAVG_REGENERATE_GOLDEN=1 to print new golden constants")
    _regenerate_all()
