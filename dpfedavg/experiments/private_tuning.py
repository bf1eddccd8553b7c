"""Private hyperparameter selection for Table 1 (Papernot & Steinke 2022).

The paper's Table 1 reports, per (dataset, epsilon, algorithm), the best of 42
``(C, eta_0)`` settings x 3 seeds while stating the epsilon of a *single* run:
the choice of the best setting is itself a release about the clients' data,
and a grid search paid for by composition costs far more than one run.
Papernot & Steinke 2022 ("Hyperparameter tuning with Renyi differential
privacy", ICLR 2022) make the selection cheap: run a *random* number ``T`` of
trials and release only the best one. If one trial is ``(lambda,
eps(lambda))``-RDP for every order ``lambda``, the whole procedure is

* ``T`` truncated negative binomial (shape ``eta >= 0``, ``gamma`` in (0, 1);
  ``eta = 1`` geometric, ``eta = 0`` logarithmic), their Theorem 2::

      eps'(lambda) = eps(lambda) + (1 + eta)(1 - 1/lambda^) eps(lambda^)
                     + (1 + eta) log(1/gamma) / lambda^ + log(E[T]) / (lambda - 1)

  for any ``lambda^ >= 1``;
* ``T ~ Poisson(mu)``, their Theorem 6: ``eps'(lambda) = eps(lambda) + mu delta^
  + log(mu) / (lambda - 1)`` with the trial ``(eps^, delta^)``-DP at ``eps^ =
  log(1 + 1/(lambda - 1))``.

dp-accounting composes this as ``RepeatAndSelectDpEvent(event, mean, shape)``
(``shape = inf`` is Poisson), in its RDP accountant only (its PLD accountant
rejects the event), so the calibration here is RDP throughout.

Protocol (``run_sim.py table1 --private-tuning``), per end-to-end epsilon,
algorithm and repetition:

1. draw ``T`` from the trial-count distribution (``T = 0`` is possible only
   for Poisson: then nothing is released);
2. for each trial draw ``(C, eta_0)`` uniformly from the same grid as
   :func:`dpfedavg.experiments.table1.table1_cells` (random search) and run one
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

import csv
import json
import logging
import math
import warnings
import zlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import dp_accounting
import numpy as np
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from dpfedavg.config import ConfigError
from dpfedavg.experiments.adaptive import ADAPTIVE, sweep_count_stddev
from dpfedavg.privacy.accounting import (
    RoundEvent,
    calibrate_noise_multiplier,
    epsilon_for,
    smallest_noise_multiplier,
)
from dpfedavg.sweep import Cell, make_cell, run_cells

__all__ = [
    "PRIVATE_TUNING_COLUMNS",
    "TRIAL_DISTRIBUTIONS",
    "Trial",
    "TrialCount",
    "calibrate_tuning_noise",
    "plan_trials",
    "run_private_tuning",
    "trial_epsilon",
    "tuning_dir",
    "tuning_epsilon",
]

logger = logging.getLogger(__name__)

#: The trial-count distributions (Papernot & Steinke 2022, §3).
TRIAL_DISTRIBUTIONS = ("negative-binomial", "poisson")
#: Defaults of ``run_sim.py table1 --private-tuning``.
DEFAULT_DISTRIBUTION = "negative-binomial"
DEFAULT_MEAN = 10.0
DEFAULT_SHAPE = 1.0  # geometric
DEFAULT_REPETITIONS = 10
#: The algorithms tuned unless told otherwise (``adaptive-clip`` on request: ``algorithms=``, ``--algorithms``).
TUNED_ALGORITHMS = ("clip", "norm")

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
_NAMES = {"clip": "Clipping", "norm": "Normalization"}


# --------------------------------------------------------------------------- T
@dataclass(frozen=True)
class TrialCount:
    """The distribution of the number of trials ``T`` (Papernot & Steinke 2022, §3).

    ``negative-binomial``: the truncated negative binomial ``D_{eta, gamma}``,
    ``P[T = k] = (1 - gamma)^k / (gamma^-eta - 1) prod_{l<k} (l + eta)/(l + 1)``
    for ``k >= 1`` (``eta = shape > 0``; ``eta = 0`` is the logarithmic
    distribution ``P[T = k] = (1 - gamma)^k / (k log(1/gamma))``), ``gamma``
    set by the ``mean``. ``poisson``: ``T ~ Poisson(mean)`` (``shape`` unused).
    """

    distribution: str = DEFAULT_DISTRIBUTION
    mean: float = DEFAULT_MEAN
    shape: float = DEFAULT_SHAPE

    def __post_init__(self) -> None:
        errors = []
        if self.distribution not in TRIAL_DISTRIBUTIONS:
            errors.append(
                f"'trials-distribution' = {self.distribution!r}: expected one of {', '.join(TRIAL_DISTRIBUTIONS)}"
            )
        elif self.distribution == "negative-binomial":
            if not (math.isfinite(self.mean) and self.mean > 1):
                errors.append(
                    f"'trials-mean' = {self.mean!r}: expected a number > 1 for the truncated negative binomial "
                    "(T >= 1 always; mean 1 is a single run)"
                )
            if not (math.isfinite(self.shape) and self.shape >= 0):
                errors.append(
                    f"'trials-shape' = {self.shape!r}: expected a finite number >= 0 "
                    "(0 = logarithmic, 1 = geometric; for shape -> infinity use --trials-distribution poisson)"
                )
        elif not (math.isfinite(self.mean) and self.mean >= 1):
            errors.append(f"'trials-mean' = {self.mean!r}: expected a number >= 1 for the Poisson distribution")
        if errors:
            raise ConfigError("invalid private tuning: " + "; ".join(errors))

    @property
    def accounting_shape(self) -> float:
        """The ``shape`` of dp-accounting's ``RepeatAndSelectDpEvent`` (``inf`` = Poisson)."""
        return math.inf if self.distribution == "poisson" else float(self.shape)

    @property
    def gamma(self) -> float:
        """``gamma`` of the truncated negative binomial with this mean (bisection; its mean <= ``mean``).

        Rounding ``gamma`` up makes the sampled ``T`` no larger on average than
        the accounted one and ``log(1/gamma)`` no larger than the accounted
        one, so the accounted bound (Theorem 2) holds for what is sampled.
        """
        if self.distribution != "negative-binomial":
            raise ValueError("gamma is a parameter of the truncated negative binomial only")
        return _tnb_gamma(float(self.shape), float(self.mean))

    def pmf(self, k: int) -> float:
        """``P[T = k]``."""
        if k < 0:
            return 0.0
        if self.distribution == "poisson":
            return math.exp(-self.mean + k * math.log(self.mean) - math.lgamma(k + 1))
        if k == 0:
            return 0.0
        gamma, eta = self.gamma, float(self.shape)
        if eta == 0:
            return math.exp(k * math.log1p(-gamma)) / (k * math.log(1.0 / gamma))
        log_binom = math.lgamma(k + eta) - math.lgamma(eta) - math.lgamma(k + 1)
        return math.exp(log_binom + k * math.log1p(-gamma)) / math.expm1(-eta * math.log(gamma))

    def sample(self, rng: np.random.Generator) -> int:
        """One draw of ``T``: Poisson, or a negative binomial conditioned on ``T >= 1`` (rejection)."""
        if self.distribution == "poisson":
            return int(rng.poisson(self.mean))
        gamma, eta = self.gamma, float(self.shape)
        if eta == 0:
            return int(rng.logseries(1.0 - gamma))
        while True:  # NB(eta, gamma) = failures before eta successes; P[0] = gamma^eta
            t = int(rng.negative_binomial(eta, gamma))
            if t >= 1:
                return t

    @property
    def slug(self) -> str:
        """A folder name for this distribution: ``negative-binomial-mean10-shape1``, ``poisson-mean10``."""
        if self.distribution == "poisson":
            return f"poisson-mean{self.mean:g}"
        return f"negative-binomial-mean{self.mean:g}-shape{self.shape:g}"

    def describe(self) -> str:
        if self.distribution == "poisson":
            return f"T ~ Poisson(mean {self.mean:g})"
        kind = {0.0: "logarithmic", 1.0: "geometric"}.get(float(self.shape), "")
        return (
            f"T ~ truncated negative binomial (shape {self.shape:g}{', ' + kind if kind else ''}; "
            f"mean {self.mean:g}, gamma = {self.gamma:.4g})"
        )


def _tnb_mean(gamma: float, eta: float) -> float:
    """``E[T]`` of the truncated negative binomial: ``eta (1 - gamma) / (gamma (1 - gamma^eta))``."""
    if eta == 0:
        return (1.0 - gamma) / (gamma * math.log(1.0 / gamma))
    return eta * (1.0 - gamma) / (gamma * -math.expm1(eta * math.log(gamma)))


@lru_cache(maxsize=64)
def _tnb_gamma(eta: float, mean: float) -> float:
    if eta == 1.0:
        return 1.0 / mean  # geometric
    lo, hi = 0.0, 1.0  # the mean decreases from inf (gamma -> 0) to 1 (gamma -> 1)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if _tnb_mean(mid, eta) > mean:
            lo = mid
        else:
            hi = mid
    return hi  # mean(hi) <= mean


# ------------------------------------------------------------------ accounting
def trial_event(q: float, z: float, rounds: int) -> dp_accounting.DpEvent:
    """One trial: ``K`` rounds of ``PoissonSampled(q, Gaussian(z))`` (the per-run event of the accountant)."""
    return dp_event.SelfComposedDpEvent(RoundEvent(q, z).dp_event(), rounds)


def tuning_event(q: float, z: float, rounds: int, count: TrialCount) -> dp_accounting.DpEvent:
    """Run ``T`` trials, release the best: dp-accounting's ``RepeatAndSelectDpEvent``."""
    return dp_event.RepeatAndSelectDpEvent(trial_event(q, z, rounds), count.mean, count.accounting_shape)


def _rdp_epsilon(event: dp_accounting.DpEvent, delta: float) -> float:
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))


@lru_cache(maxsize=256)
def tuning_epsilon(z: float, q: float, rounds: int, delta: float, count: TrialCount) -> float:
    """End-to-end epsilon of releasing the best of ``T`` trials, each with noise multiplier ``z`` (RDP)."""
    return _rdp_epsilon(tuning_event(q, z, rounds, count), delta)


@lru_cache(maxsize=256)
def trial_epsilon(z: float, q: float, rounds: int, delta: float) -> float:
    """Epsilon of one trial alone, with the same (RDP) accountant."""
    return _rdp_epsilon(trial_event(q, z, rounds), delta)


@lru_cache(maxsize=64)
def calibrate_tuning_noise(
    epsilon: float, delta: float, q: float, rounds: int, count: TrialCount, rel_tol: float = 1e-3
) -> float:
    """The smallest ``z`` (to ``rel_tol`` relative) whose tuning procedure is ``(epsilon, delta)``-DP end to end.

    Bisection on :func:`tuning_epsilon` (:func:`~dpfedavg.privacy.accounting.smallest_noise_multiplier`):
    the returned ``z`` satisfies the target.
    """
    if not epsilon > 0:
        raise ConfigError(f"invalid private tuning: 'epsilon' = {epsilon!r}: expected a number > 0")
    try:
        return smallest_noise_multiplier(
            lambda z: tuning_epsilon(z, q, rounds, delta, count), epsilon, rel_tol, f" (delta = {delta:g})"
        )
    except ValueError as err:
        raise ConfigError(f"invalid private tuning: {err} for {count.describe()}") from None


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

    ``grid_kwargs`` are :func:`~dpfedavg.experiments.table1.table1_cells`'s
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
            "accountant": "rdp",
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
                    if alg == ADAPTIVE:  # the count's noise follows the trial's z (experiments.adaptive)
                        values["clip-count-stddev"] = sweep_count_stddev(z, cfg.clients_per_round)
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
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=PRIVATE_TUNING_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return rows


def summarize(
    rows: Sequence[dict],
    table1_rows: Sequence[dict],
    calibration: dict[float, dict],
    repetitions: int,
    algorithms: Sequence[str],
) -> list[dict]:
    """Per (epsilon, algorithm): the per-run table's best next to the privately tuned release."""
    from dpfedavg.experiments.table1 import best_settings

    per_run = best_settings(list(table1_rows))
    runs_per_group: dict[tuple, int] = defaultdict(int)
    z_per_run: dict[tuple, float] = {}
    for r in table1_rows:
        runs_per_group[(r["algorithm"], r["epsilon"])] += 1
        z_per_run[(r["algorithm"], r["epsilon"])] = float(r["noise_multiplier"])
    untuned = defaultdict(list)  # one run at a grid point picked blindly: no selection, epsilon of one run
    for r in table1_rows:
        untuned[(r["algorithm"], r["epsilon"])].append(r["last5_test_accuracy"])
    released = defaultdict(list)
    for r in rows:
        if r["released"]:
            released[(r["algorithm"], r["epsilon"])].append(r)
    out = []
    for eps, cal in calibration.items():
        for alg in algorithms:
            rel = sorted(released.get((alg, eps), []), key=lambda r: r["repetition"])
            accs = [r["last5_test_accuracy"] for r in rel]
            counts = {}
            for r in rows:
                if r["algorithm"] == alg and r["epsilon"] == eps:
                    counts[r["repetition"]] = r["num_trials"]
            ts = [counts.get(rep, 0) for rep in range(repetitions)]
            settings: dict[tuple, int] = defaultdict(int)
            for r in rel:
                settings[(r["C"], r["eta0"])] += 1
            mode = max(settings.items(), key=lambda kv: kv[1]) if settings else None
            n_runs = runs_per_group.get((alg, eps), 0)
            z_run = z_per_run.get((alg, eps))
            grid_eps = (
                epsilon_for(z_run, cal["q"], cal["rounds"] * n_runs, cal["delta"], "pld")
                if z_run is not None and n_runs
                else None
            )
            grid_z = (
                calibrate_noise_multiplier(eps, cal["delta"], cal["q"], cal["rounds"] * n_runs, "pld")
                if n_runs
                else None
            )
            pr = per_run.get((alg, eps))
            out.append(
                {
                    "algorithm": alg,
                    "epsilon": eps,
                    "per_run_accuracy": pr[0] if pr else None,
                    "per_run_std": pr[1] if pr else None,
                    "per_run_C": pr[2] if pr else None,
                    "per_run_eta0": pr[3] if pr else None,
                    "per_run_seeds": pr[4] if pr else None,
                    "per_run_noise_multiplier": z_run,
                    "untuned_accuracy": float(np.mean(untuned[(alg, eps)])) if untuned.get((alg, eps)) else None,
                    "untuned_std": float(np.std(untuned[(alg, eps)])) if untuned.get((alg, eps)) else None,
                    "grid_runs": n_runs,
                    "grid_end_to_end_epsilon": grid_eps,
                    "grid_noise_multiplier_at_end_to_end_epsilon": grid_z,
                    "tuned_accuracy": float(np.mean(accs)) if accs else None,
                    "tuned_std": float(np.std(accs)) if accs else None,
                    "tuned_min": float(np.min(accs)) if accs else None,
                    "tuned_max": float(np.max(accs)) if accs else None,
                    "tuned_released": len(accs),
                    "tuned_nothing_released": sum(1 for t in ts if t == 0),
                    "tuned_noise_multiplier": cal["noise_multiplier"],
                    "tuned_trial_epsilon": cal["trial_epsilon"],
                    "tuned_end_to_end_epsilon": cal["end_to_end_epsilon"],
                    "trials_mean": float(np.mean(ts)),
                    "trials_min": int(min(ts)),
                    "trials_max": int(max(ts)),
                    "trials_total": int(sum(ts)),
                    "tuned_most_released_setting": list(mode[0]) if mode else None,
                    "tuned_most_released_count": mode[1] if mode else 0,
                }
            )
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def markdown(dataset: str, summary: Sequence[dict], count: TrialCount, repetitions: int, tuning_seed: int) -> str:
    """``private_tuning.md``: the per-run table and private tuning side by side."""
    lines = [
        f"**{dataset}**: the paper's per-run table next to private hyperparameter tuning (Papernot & Steinke 2022).",
        f"{count.describe()}; random search over the same (C, eta0) grid; {repetitions} repetitions of the whole "
        f"tuning procedure (tuning seed {tuning_seed}); selection and report by the last-5-round test accuracy.",
        "",
        "| Algo. | epsilon | per-run table: best of grid (mean ± std over seeds) | z per run "
        "| epsilon of the whole grid search (all runs composed, PLD) | one untuned run: random grid point "
        "(mean ± std over the grid's runs) | private tuning: released trial "
        "(mean ± std over repetitions; min-max) | z per trial | epsilon per trial (RDP) | T drawn: mean (min-max) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        name = _NAMES.get(s["algorithm"], s["algorithm"])
        if s["per_run_accuracy"] is None:
            per_run = "-"
        else:
            per_run = (
                f"{_pct(s['per_run_accuracy'])} ± {100 * s['per_run_std']:.2f} "
                f"(C = {s['per_run_C']:g}, eta0 = {s['per_run_eta0']:g})"
            )
        z_run = "-" if s["per_run_noise_multiplier"] is None else f"{s['per_run_noise_multiplier']:.3f}"
        grid_eps = (
            "-"
            if s["grid_end_to_end_epsilon"] is None
            else f"{s['grid_end_to_end_epsilon']:.1f} ({s['grid_runs']} run{'s' if s['grid_runs'] != 1 else ''})"
        )
        if s["tuned_accuracy"] is None:
            tuned = "-"
        else:
            tuned = (
                f"{_pct(s['tuned_accuracy'])} ± {100 * s['tuned_std']:.2f}; "
                f"{_pct(s['tuned_min'])}-{_pct(s['tuned_max'])}"
            )
            if s["tuned_nothing_released"]:
                tuned += f" ({s['tuned_nothing_released']} repetitions drew T = 0: nothing released)"
        untuned = (
            "-" if s["untuned_accuracy"] is None else f"{_pct(s['untuned_accuracy'])} ± {100 * s['untuned_std']:.2f}"
        )
        lines.append(
            f"| {name} | {s['epsilon']:g} | {per_run} | {z_run} | {grid_eps} | {untuned} | {tuned} "
            f"| {s['tuned_noise_multiplier']:.3f} | {s['tuned_trial_epsilon']:.2f} "
            f"| {s['trials_mean']:.1f} ({s['trials_min']}-{s['trials_max']}) |"
        )
    lines.append("")
    seen = set()
    for s in summary:
        if s["epsilon"] in seen or s["grid_noise_multiplier_at_end_to_end_epsilon"] is None:
            continue
        seen.add(s["epsilon"])
        lines.append(
            f"* epsilon = {s['epsilon']:g} end to end: one run needs z = {s['per_run_noise_multiplier']:.3f} (PLD), "
            f"private tuning z = {s['tuned_noise_multiplier']:.3f} per trial (RDP, RepeatAndSelectDpEvent), "
            f"the whole grid search paid by composition ({s['grid_runs']} run{'s' if s['grid_runs'] != 1 else ''}) "
            f"z = {s['grid_noise_multiplier_at_end_to_end_epsilon']:.3f} per run (PLD)."
        )
    return "\n".join(lines) + "\n"


def plot(summary: Sequence[dict], rows: Sequence[dict], path: Path, dataset: str) -> Path | None:
    """``private_tuning.png``: per epsilon and algorithm, the per-run best and the released trials."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no %s", path.name)
        return None
    epsilons = sorted({s["epsilon"] for s in summary}, reverse=True)
    algorithms = list(dict.fromkeys(s["algorithm"] for s in summary))
    fig, axes = plt.subplots(1, len(epsilons), figsize=(4.5 * len(epsilons), 4), squeeze=False, sharey=True)
    jitter = np.random.default_rng(0)
    for ax, eps in zip(axes[0], epsilons, strict=True):
        for i, alg in enumerate(algorithms):
            s = next(x for x in summary if x["epsilon"] == eps and x["algorithm"] == alg)
            if s["per_run_accuracy"] is not None:
                ax.errorbar(
                    i - 0.18, 100 * s["per_run_accuracy"], yerr=100 * s["per_run_std"], fmt="s", color="tab:gray",
                    capsize=4, label="per-run table (epsilon per run)" if i == 0 else None,
                )  # fmt: skip
            accs = [100 * r["last5_test_accuracy"] for r in rows if r["released"] and r["algorithm"] == alg
                    and r["epsilon"] == eps]  # fmt: skip
            if accs:
                ax.scatter(i + 0.18 + jitter.uniform(-0.06, 0.06, len(accs)), accs, s=12, color="tab:blue", alpha=0.5)
                ax.errorbar(
                    i + 0.18, np.mean(accs), yerr=np.std(accs), fmt="o", color="tab:blue", capsize=4,
                    label="private tuning (epsilon end to end)" if i == 0 else None,
                )  # fmt: skip
        ax.set_xticks(range(len(algorithms)), [_NAMES.get(a, a) for a in algorithms])
        ax.set_title(f"{dataset}, epsilon = {eps:g}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("last-5-round test accuracy (%)")
    axes[0][0].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_private_tuning(
    out: Path,
    dataset: str,
    *,
    epsilons: Sequence[float],
    clips: Sequence[float],
    lrs: Sequence[float],
    seeds: int = 3,
    rounds: int,
    count: TrialCount = TrialCount(),
    repetitions: int = DEFAULT_REPETITIONS,
    tuning_seed: int = 0,
    engine: str = "batched",
    jobs: int = 1,
    data_dir: str = "",
    cache_dir: str = "",
    progress: bool = True,
    ray_address: str | None = None,
    algorithms: Sequence[str] = TUNED_ALGORITHMS,
    max_batch_memory: int | None = None,
) -> dict[str, Path]:
    """The per-run table (:func:`~dpfedavg.experiments.table1.run_table1`), then the tuning trials; both tables.

    Every trial is a sweep cell under ``<tuning dir>/runs/`` (:func:`tuning_dir`; resumable
    like the grid). Outputs: ``table1.csv`` / ``table1.md`` in ``out`` as
    ``run_table1`` writes them; in the tuning dir ``private_tuning.csv`` (every
    trial, the released one marked), ``private_tuning.json`` (the calibration
    and the summary), ``private_tuning.md`` and ``private_tuning.png``.
    """
    from dpfedavg.config import RunConfig
    from dpfedavg.experiments.table1 import NUM_CLIENTS, run_table1
    from dpfedavg.tasks import build_task

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
    outputs = run_table1(
        out, dataset, epsilons=epsilons, seeds=seeds, engine=engine, jobs=jobs, progress=progress,
        ray_address=ray_address, max_batch_memory=max_batch_memory, **grid_kwargs,
    )  # fmt: skip
    # The federations of the repetitions (data-seed = repetition): split once, before the workers start.
    prep = RunConfig.from_run_config(
        {"task": dataset, "num-clients": NUM_CLIENTS[dataset], "clients-per-round": 0.2 * NUM_CLIENTS[dataset],
         "data-dir": data_dir, "cache-dir": cache_dir}
    )  # fmt: skip
    for rep in range(repetitions):
        _ = build_task(prep.replace(data_seed=rep)).partition
    run_cells(
        [t.cell for t in trials], engine=engine, jobs=jobs, progress=progress,
        desc=f"private tuning {dataset} ({len(trials)} trials)", ray_address=ray_address,
        max_batch_memory=max_batch_memory,
    )  # fmt: skip
    where = tuning_dir(out, count)
    rows = _collect(trials, dataset, calibration, where / "private_tuning.csv")
    with (out / "table1.csv").open() as fh:
        table1_rows = [
            {**r, "epsilon": float(r["epsilon"]), "C": float(r["C"]), "eta0": float(r["eta0"]),
             "last5_test_accuracy": float(r["last5_test_accuracy"])}
            for r in csv.DictReader(fh)
        ]  # fmt: skip
    algorithms = list(dict.fromkeys(t.algorithm for t in trials))
    summary = summarize(rows, table1_rows, calibration, repetitions, algorithms)
    report = {
        "dataset": dataset,
        "trial_count": {"distribution": count.distribution, "mean": count.mean, "shape": count.shape},
        "repetitions": repetitions,
        "tuning_seed": tuning_seed,
        "selection_metric": "last5_test_accuracy",
        "calibration": [calibration[e] for e in calibration],
        "summary": summary,
    }
    (where / "private_tuning.json").write_text(json.dumps(report, indent=2) + "\n")
    (where / "private_tuning.md").write_text(markdown(dataset, summary, count, repetitions, tuning_seed))
    result = {
        **outputs,
        "private_tuning_csv": where / "private_tuning.csv",
        "private_tuning_json": where / "private_tuning.json",
        "private_tuning_table": where / "private_tuning.md",
    }
    png = plot(summary, rows, where / "private_tuning.png", dataset)
    if png is not None:
        result["private_tuning_plot"] = png
    return result
