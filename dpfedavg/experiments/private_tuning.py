"""Private hyperparameter selection for Table 1 (Papernot & Steinke 2022).

The paper's Table 1 reports, per (dataset, epsilon, algorithm), the best of 42
``(C, eta_0)`` settings x 3 seeds while stating the epsilon of a *single* run:
the choice of the best setting is itself a release about the clients' data,
and a grid search paid for by composition costs far more than one run.
Papernot & Steinke 2022 ("Hyperparameter tuning with Renyi differential
privacy", ICLR 2022) make the selection cheap: run a *random* number ``T`` of
trials and release only the best one; its accounting (the law of ``T``, the
end-to-end epsilon, the calibration of ``z``) is `dpfedavg.privacy.selection`.
This module plans the trials and runs them; `tuning_report` writes the tables.

Protocol (``run_sim.py table1 --private-tuning``), per end-to-end epsilon,
algorithm and repetition:

1. draw ``T`` from the trial-count distribution (``T = 0`` is possible only
   for Poisson: then nothing is released);
2. for each trial draw ``(C, eta_0)`` uniformly from the same grid as
   `dpfedavg.experiments.table1.table1_cells()` (random search) and run one
   DP-FedAvg / DP-NormFedAvg run with noise multiplier ``z_tuned`` and its own
   ``seed`` (sampling, noise) on the repetition's federation (``data-seed`` =
   repetition: every trial of a repetition trains on the same clients);
3. release the trial with the highest last-5-round test accuracy (the first on
   a tie), with its ``(C, eta_0)``.

``z_tuned`` is the smallest ``z`` for which the RDP accountant puts
``RepeatAndSelectDpEvent(SelfComposed(PoissonSampled(q, Gaussian(z)), K),
mean, shape)`` at or below the target ``(epsilon, delta)``: the released
trial is ``(epsilon, delta)``-DP end to end, the choice of ``(C, eta_0)``
included.

**Selection score.** The last-5-round test accuracy, the metric of the
paper's table, so that the two tables differ only in what privacy pays for the
selection. It is computed on the server's held-out test set, not on client
data, so it is post-processing of each trial's (DP) sequence of models, as the
theorem requires. (A score computed from client data, e.g. ``train_loss``,
would be a release the accountant does not cover: never select on it.)
Selecting and reporting on the same test set favours both tables alike.

**Randomness.** ``T``, the grid points and the trial seeds are drawn from a
generator seeded with ``tuning_seed`` (reproducible research runs); the draws
of one (epsilon, repetition) are shared by the algorithms (common random
numbers: same ``T``, grid points and seeds for clip and norm, which makes
their comparison less noisy; each algorithm's procedure alone is an ordinary
draw). The guarantee needs ``T`` and the losing trials to stay secret: a real
deployment must draw them from a secret source (as ``secure-noise`` does for
the noise) and release only the winning trial. The results folder of a
simulation keeps every trial, which a deployment must not publish.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Unpack

import numpy as np

from dpfedavg.config import ConfigError
from dpfedavg.experiments import PAPER_ALGORITHMS
from dpfedavg.experiments.adaptive import ADAPTIVE, adaptive_values
from dpfedavg.experiments.sweep import Cell, RunOptions, make_cell, run_cells, split_run_options
from dpfedavg.experiments.tuning_report import write_report
from dpfedavg.io.atomic import write_csv
from dpfedavg.privacy.accountants import RdpAccountant
from dpfedavg.privacy.selection import TrialCount, calibrate_tuning_noise, trial_epsilon, tuning_epsilon

__all__ = [
    "PRIVATE_TUNING_COLUMNS",
    "Trial",
    "plan_trials",
    "run_private_tuning",
    "tuning_dir",
]

logger = logging.getLogger(__name__)

DEFAULT_REPETITIONS = 10
#: The algorithms tuned unless told otherwise (``adaptive-clip`` on request: ``algorithms=``, ``--algorithms``).
TUNED_ALGORITHMS = PAPER_ALGORITHMS

PRIVATE_TUNING_COLUMNS = (
    "dataset",
    "algorithm",
    "epsilon",
    "delta",
    "repetition",
    "num_trials",
    "trial",
    "C",
    "eta0",
    "seed",
    "data_seed",
    "noise_multiplier",
    "trial_epsilon",
    "last5_test_accuracy",
    "released",
)


# ----------------------------------------------------------------------- trials
def tuning_dir(out: Path, count: TrialCount) -> Path:
    """Where one trial-count setting keeps its trials and tables: ``<out>/private-tuning-<slug>/``.

    Settings side by side share the per-run grid in ``<out>/runs/``.
    """
    return Path(out) / f"private-tuning-{count.slug}"


@dataclass(frozen=True)
class Trial:
    """One trial of one repetition of the tuning of ``algorithm`` at end-to-end ``epsilon``."""

    algorithm: str
    epsilon: float
    repetition: int
    num_trials: int  # T of this repetition
    index: int
    clip: float
    lr: float
    seed: int
    noise_multiplier: float
    cell: Cell


def _stream(tuning_seed: int, epsilon: float, repetition: int) -> np.random.Generator:
    """The draws of one (epsilon, repetition): independent of the algorithms and of the other epsilons."""
    key = zlib.crc32(f"{epsilon:g}".encode())
    return np.random.default_rng(np.random.SeedSequence([int(tuning_seed), key, int(repetition)]))


def _grids(dataset: str, grid_kwargs: dict, epsilon: float) -> dict[str, list[Cell]]:
    """Per private algorithm of the table1 sweep: its cells at ``epsilon`` (one seed), in grid order."""
    from dpfedavg.experiments.table1 import table1_cells

    cells = table1_cells(Path("."), dataset, epsilons=[epsilon], seeds=1, **grid_kwargs)
    grids: dict[str, list[Cell]] = {}
    for cell in cells:
        if cell.cfg.epsilon > 0:  # the private algorithms (FedAvg without DP has nothing to tune privately)
            grids.setdefault(cell.cfg.algorithm, []).append(cell)
    return grids


def plan_trials(
    out: Path,
    dataset: str,
    *,
    epsilons: Sequence[float],
    count: TrialCount,
    repetitions: int,
    tuning_seed: int = 0,
    **grid_kwargs,
) -> tuple[list[Trial], dict[float, dict]]:
    """Draw ``T``, the grid points and the seeds, calibrate ``z``; validate every trial's config.

    ``grid_kwargs`` are `table1_cells()`'s
    ``clips``, ``lrs``, ``rounds``, ``data_dir``, ``cache_dir``. Returns the
    trials and, per epsilon, the calibration (``z``, epsilon per trial, ``q``,
    ``K``, ``delta``). Nothing runs; a bad option raises ConfigError.
    """
    grid_kwargs = {"algorithms": TUNED_ALGORITHMS, **grid_kwargs}
    if not (isinstance(repetitions, int) and repetitions >= 1):
        raise ConfigError(f"invalid private tuning: 'repetitions' = {repetitions!r}: expected an integer >= 1")
    if not (isinstance(tuning_seed, int) and tuning_seed >= 0):
        raise ConfigError(f"invalid private tuning: 'tuning-seed' = {tuning_seed!r}: expected an integer >= 0")
    trials: list[Trial] = []
    calibration: dict[float, dict] = {}
    out = Path(out)
    for eps in epsilons:
        grids = _grids(dataset, grid_kwargs, eps)
        if not grids:
            raise ConfigError("invalid private tuning: the table1 sweep has no private algorithm to tune")
        first = next(iter(grids.values()))[0].cfg
        q, rounds, delta = first.sampling_rate, first.num_rounds, first.delta
        z = calibrate_tuning_noise(float(eps), delta, q, rounds, count)
        calibration[float(eps)] = {
            "epsilon": float(eps),
            "delta": delta,
            "q": q,
            "rounds": rounds,
            "noise_multiplier": z,
            "trial_epsilon": trial_epsilon(z, q, rounds, delta),
            "end_to_end_epsilon": tuning_epsilon(z, q, rounds, delta, count),
            "accountant": RdpAccountant.name,
        }
        for rep in range(repetitions):
            rng = _stream(tuning_seed, float(eps), rep)
            t = count.sample(rng)
            points = rng.random(t)  # grid point j = floor(u_j * grid size), the same u_j for every algorithm
            seeds = rng.integers(0, 2**31 - 1, size=t)
            for alg, grid in grids.items():
                for j in range(t):
                    cfg = grid[int(points[j] * len(grid))].cfg
                    values = cfg.to_run_config()
                    del values["output-dir"], values["run-name"]
                    values.update({"epsilon": 0.0, "noise-multiplier": z, "seed": int(seeds[j]), "data-seed": rep})
                    if alg == ADAPTIVE:  # the count's noise follows the trial's z ("auto")
                        values = adaptive_values(values)
                    key = f"{dataset}-{alg}-e2e-eps{eps:g}-rep{rep}-trial{j}-C{cfg.clip:g}-lr{cfg.local_lr:g}"
                    cell = make_cell(out, key, values)
                    trials.append(Trial(alg, float(eps), rep, t, j, cfg.clip, cfg.local_lr, int(seeds[j]), z, cell))
    return trials, calibration


# --------------------------------------------------------------------- results
def _collect(trials: Sequence[Trial], dataset: str, calibration: dict[float, dict], path: Path) -> list[dict]:
    """``private_tuning.csv``: one row per trial, the released one marked."""
    rows = []
    for trial in trials:
        saved = json.loads((trial.cell.directory / "config.json").read_text())
        rows.append(
            {
                "dataset": dataset,
                "algorithm": trial.algorithm,
                "epsilon": trial.epsilon,
                "delta": calibration[trial.epsilon]["delta"],
                "repetition": trial.repetition,
                "num_trials": trial.num_trials,
                "trial": trial.index,
                "C": trial.clip,
                "eta0": trial.lr,
                "seed": trial.seed,
                "data_seed": trial.repetition,
                "noise_multiplier": trial.noise_multiplier,
                "trial_epsilon": calibration[trial.epsilon]["trial_epsilon"],
                "last5_test_accuracy": saved["final"]["last5_test_accuracy"],
                "released": 0,
            }
        )
    best: dict[tuple, dict] = {}
    for row in rows:  # the first trial with the highest score wins
        key = (row["algorithm"], row["epsilon"], row["repetition"])
        if key not in best or row["last5_test_accuracy"] > best[key]["last5_test_accuracy"]:
            best[key] = row
    for row in best.values():
        row["released"] = 1
    write_csv(path, PRIVATE_TUNING_COLUMNS, rows)
    return rows


def _split_federations(dataset: str, repetitions: int, data_dir: str, cache_dir: str) -> None:
    """The federations of the repetitions (``data-seed`` = repetition): split once, before the workers start."""
    from dpfedavg.config import RunConfig
    from dpfedavg.experiments.table1 import NUM_CLIENTS
    from dpfedavg.tasks import build_task

    prep = RunConfig.from_run_config(
        {"task": dataset, "num-clients": NUM_CLIENTS[dataset], "clients-per-round": 0.2 * NUM_CLIENTS[dataset],
         "data-dir": data_dir, "cache-dir": cache_dir}
    )  # fmt: skip
    for rep in range(repetitions):
        _ = build_task(prep.replace(data_seed=rep)).partition


def run_private_tuning(
    out: Path,
    dataset: str,
    *,
    epsilons: Sequence[float],
    clips: Sequence[float],
    lrs: Sequence[float],
    seeds: int = 3,
    rounds: int,
    count: TrialCount | None = None,
    repetitions: int = DEFAULT_REPETITIONS,
    tuning_seed: int = 0,
    data_dir: str = "",
    cache_dir: str = "",
    algorithms: Sequence[str] = TUNED_ALGORITHMS,
    **options: Unpack[RunOptions],
) -> dict[str, Path]:
    """The per-run table (`run_table1()`), then the tuning trials; both tables.

    ``options`` (`dpfedavg.experiments.sweep.RunOptions`) say how the grid's runs and the trials run.

    Every trial is a sweep cell under ``<tuning dir>/runs/`` (`tuning_dir()`; resumable
    like the grid). Outputs: ``table1.csv`` / ``table1.md`` in ``out`` as
    ``run_table1`` writes them; in the tuning dir ``private_tuning.csv`` (every
    trial, the released one marked), ``private_tuning.json`` (the calibration
    and the summary), ``private_tuning.md`` and ``private_tuning.png``.
    """
    from dpfedavg.experiments.table1 import run_table1

    split_run_options(options)  # a key that is no run option fails here, before anything runs
    count = count if count is not None else TrialCount()
    out = Path(out)
    grid_kwargs = {"clips": clips, "lrs": lrs, "rounds": rounds, "data_dir": data_dir, "cache_dir": cache_dir,
                   "algorithms": tuple(algorithms)}  # fmt: skip
    # Everything is drawn, calibrated and validated before the first run starts.
    trials, calibration = plan_trials(
        tuning_dir(out, count), dataset, epsilons=epsilons, count=count, repetitions=repetitions,
        tuning_seed=tuning_seed, **grid_kwargs,
    )  # fmt: skip
    for eps, cal in calibration.items():
        logger.info(
            "private tuning at (%g, %g): z = %.4g per trial (epsilon %.3g per trial), %s",
            eps, cal["delta"], cal["noise_multiplier"], cal["trial_epsilon"], count.describe(),
        )  # fmt: skip
    outputs = run_table1(out, dataset, epsilons=epsilons, seeds=seeds, **grid_kwargs, **options)
    _split_federations(dataset, repetitions, data_dir, cache_dir)
    run_cells([t.cell for t in trials], desc=f"private tuning {dataset} ({len(trials)} trials)", **options)
    where = tuning_dir(out, count)
    rows = _collect(trials, dataset, calibration, where / "private_tuning.csv")
    settings = {"count": count, "repetitions": repetitions, "tuning_seed": tuning_seed}
    return {**outputs, **write_report(where, out / "table1.csv", dataset, rows, calibration, **settings)}
