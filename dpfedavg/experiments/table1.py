"""Paper §5, Table 1: clipping vs normalization vs FedAvg on real data, tuned over C and eta_0.

Protocol (paper §5 and its "Experimental Details"): n clients (FMNIST 3000,
CIFAR 5000; digits 100 here), r = 0.2 n, E = 20, eta_k = 0.99^k eta_0,
beta_k = eta_k, server momentum 0.8, delta = 1e-5, C in {500, 250, 125, 62.5,
31.25, 15.625}, eta_0 in {1e-3, ..., 6.4e-2}, 3 seeds. For each (dataset,
epsilon, algorithm) the best (C, eta_0) is the one with the highest test
accuracy averaged over the last 5 rounds and over seeds; FedAvg (no DP) is
tuned over eta_0. The paper does not state K: it is ``--rounds`` (default
`DEFAULT_ROUNDS`, see the documentation's Table 1 page for why).

Beyond the paper, the grid has ``adaptive-clip`` rows (Andrew et al. 2021): ``C`` is the initial
``C_0``, ``sigma_b`` as `dpfedavg.experiments.adaptive.adaptive_values()` chooses it. After the
grid, the best setting of each (algorithm, epsilon) is rerun with an evaluation every 10 rounds
(``<out>/curves``) for ``curves.png``: test accuracy and C_k over the rounds.
"""

from __future__ import annotations

import csv
import json
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpfedavg.core.dp import get_bound
from dpfedavg.experiments import PAPER_ALGORITHMS
from dpfedavg.experiments.adaptive import ADAPTIVE, adaptive_values, clip_curves
from dpfedavg.experiments.sweep import Cell, make_cell, run_cells, split_run_options
from dpfedavg.io.atomic import write_csv, write_text

__all__ = ["CLIPS", "DEFAULT_ROUNDS", "LEARNING_RATES", "PAPER_TABLE1", "Table1Grid", "run_table1", "table1_cells"]

logger = logging.getLogger(__name__)

CLIPS = (500.0, 250.0, 125.0, 62.5, 31.25, 15.625)
LEARNING_RATES = (1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2, 6.4e-2)
EPSILONS = (5.0, 1.5)
#: K: with eta_k = 0.99^k eta_0, 200 rounds use 1 - 0.99^200 = 87% of the total step size sum_k eta_k.
DEFAULT_ROUNDS = 200
NUM_CLIENTS = {"fmnist": 3000, "cifar10": 5000, "cifar100": 5000, "digits": 100}
#: The paper's Table 1: test accuracy (%), mean of the last 5 rounds, best over C and eta_0.
PAPER_TABLE1 = {
    "fmnist": {("clip", 5.0): 75.59, ("clip", 1.5): 56.90, ("norm", 5.0): 77.72, ("norm", 1.5): 57.80, "none": 83.43},
    "cifar10": {("clip", 5.0): 82.63, ("clip", 1.5): 81.53, ("norm", 5.0): 84.21, ("norm", 1.5): 82.42, "none": 85.64},
    "cifar100": {
        ("clip", 5.0): 56.53,
        ("clip", 1.5): 41.33,
        ("norm", 5.0): 59.36,
        ("norm", 1.5): 42.76,
        "none": 64.61,
    },
}
TABLE1_COLUMNS = (
    "dataset",
    "algorithm",
    "epsilon",
    "C",
    "eta0",
    "seed",
    "last5_test_accuracy",
    "epsilon_spent",
    "noise_multiplier",
    "final_clip",
)
#: The private algorithms of the grid by default: the paper's two (FedAvg without DP is always added;
#: ``--algorithms ... adaptive-clip`` adds C_0 rows).
ALGORITHMS = PAPER_ALGORITHMS
#: The best settings' rerun (``curves.png``) evaluates every this many rounds.
CURVE_EVAL_EVERY = 10


@dataclass(frozen=True)
class Table1Grid:
    """One dataset's grid (paper §5): `table1_cells()` and `run_table1()` take these fields as keywords.

    ``seeds`` runs of every (algorithm, epsilon, C, eta_0) of K = ``rounds`` rounds, plus FedAvg without DP
    over eta_0; ``data_dir`` and ``cache_dir`` are the runs' ``data-dir`` and ``cache-dir``.
    """

    epsilons: Sequence[float] = EPSILONS
    clips: Sequence[float] = CLIPS
    lrs: Sequence[float] = LEARNING_RATES
    seeds: int = 3
    rounds: int = DEFAULT_ROUNDS
    data_dir: str = ""
    cache_dir: str = ""
    algorithms: Sequence[str] = ALGORITHMS


def table1_cells(out: Path, dataset: str, **grid: Any) -> list[Cell]:
    """Every run of the grid (``grid``: `Table1Grid`'s fields), plus the FedAvg baseline over eta_0.

    Validated before anything runs: a key that is no `Table1Grid` field raises TypeError, a bad value ConfigError.
    """
    g = Table1Grid(**grid)
    n, rounds, clips, lrs, seeds = NUM_CLIENTS[dataset], g.rounds, g.clips, g.lrs, g.seeds
    base = {
        "task": dataset,
        "num-clients": n,
        "clients-per-round": 0.2 * n,
        "local-steps": 20,
        "lr-decay": 0.99,
        "server-lr": "eta",
        "server-momentum": 0.8,
        "delta": 1e-5,
        "num-rounds": rounds,
        "eval-every": rounds,  # round 0 and the last 5 rounds: all the table needs
        "data-dir": g.data_dir,
        "cache-dir": g.cache_dir,
    }
    cells = []
    for alg in g.algorithms:
        for eps in g.epsilons:
            for c in clips:
                for lr in lrs:
                    for seed in range(seeds):
                        key = f"{dataset}-{alg}-eps{eps:g}-C{c:g}-lr{lr:g}-seed{seed}"
                        values = {**base, "algorithm": alg, "epsilon": eps, "clip": c, "local-lr": lr, "seed": seed}
                        if alg == ADAPTIVE:
                            values = adaptive_values(values)
                        cells.append(make_cell(out, key, values))
    for lr in lrs:
        for seed in range(seeds):
            key = f"{dataset}-none-lr{lr:g}-seed{seed}"
            values = {**base, "algorithm": "none", "epsilon": 0.0, "clip": max(clips), "local-lr": lr, "seed": seed}
            cells.append(make_cell(out, key, values))
    return cells


def collect(cells: Sequence[Cell], dataset: str, path: Path) -> list[dict]:
    """``table1.csv``: one row per run."""
    rows = []
    for cell in cells:
        saved = json.loads((cell.directory / "config.json").read_text())
        with (cell.directory / "metrics.csv").open() as fh:
            last = list(csv.DictReader(fh))[-1]
        cfg = cell.cfg
        rows.append(
            {
                "dataset": dataset,
                "algorithm": cfg.algorithm,
                "epsilon": cfg.epsilon if get_bound(cfg.algorithm).private else float("inf"),
                "C": cfg.clip if get_bound(cfg.algorithm).private else float("nan"),
                "eta0": cfg.local_lr,
                "seed": cfg.seed,
                "last5_test_accuracy": saved["final"]["last5_test_accuracy"],
                "epsilon_spent": saved["final"]["epsilon"],
                "noise_multiplier": saved["privacy"]["noise_multiplier"],
                "final_clip": float(last["clip"]) if last.get("clip") else float("nan"),  # C_K (adaptive-clip)
            }
        )
    write_csv(path, TABLE1_COLUMNS, rows)
    return rows


def best_settings(rows: list[dict]) -> dict:
    """(algorithm, epsilon) -> (mean acc, std acc, C, eta0, seeds) of the best setting (mean over seeds)."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r["algorithm"], r["epsilon"], r["C"], r["eta0"])].append(r["last5_test_accuracy"])
    best: dict = {}
    for (alg, eps, c, lr), accs in groups.items():
        mean = float(np.mean(accs))
        key = (alg, eps)
        if key not in best or mean > best[key][0]:
            best[key] = (mean, float(np.std(accs)), c, lr, len(accs))
    return best


def markdown(dataset: str, best: dict, epsilons: Sequence[float], rounds: int) -> str:
    """``table1.md``: the paper's layout, ours beside the paper's numbers."""
    paper = PAPER_TABLE1.get(dataset, {})

    def fmt(entry) -> str:
        if entry is None:
            return "-"
        mean, std, c, lr, k = entry
        setting = f"eta0 = {lr:g}" if np.isnan(c) else f"C = {c:g}, eta0 = {lr:g}"
        return f"{100 * mean:.2f}% ± {100 * std:.2f} ({setting})"

    def paper_value(key) -> str:
        return f"{paper[key]:.2f}%" if key in paper else "-"

    header = "| Algo. | " + " | ".join(f"({e:g}, 1e-5)-DP: ours | paper" for e in epsilons) + " |"
    sep = "|---|" + "---|---|" * len(epsilons)
    lines = [f"**{dataset}** (K = {rounds}; mean ± std over seeds of the last-5-round test accuracy)", "", header, sep]
    names = [("clip", "Clipping"), ("norm", "Normalization")]
    if any((ADAPTIVE, e) in best for e in epsilons):
        names.append((ADAPTIVE, "Adaptive clipping (C = C_0)"))
    for alg, name in names:
        cells = [f"{fmt(best.get((alg, e)))} | {paper_value((alg, e))}" for e in epsilons]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    fedavg = best.get(("none", float("inf")))
    lines.append(f"| FedAvg (w/o privacy) | {fmt(fedavg)} | {paper_value('none')} |" + " |" * (2 * (len(epsilons) - 1)))
    return "\n".join(lines) + "\n"


def run_table1(out: Path, dataset: str, **settings: Any) -> dict[str, Path]:
    """Run (or resume) the grid for ``dataset`` (on a Ray cluster with ``ray_address``); write the CSV and table.

    ``settings``: `Table1Grid`'s fields (the grid) and the `dpfedavg.experiments.sweep.RunOptions` (how its
    cells run: ``engine``, ``jobs``, ``progress``, ``ray_address``, ``max_batch_memory``); any other key
    raises TypeError before anything runs. The cells run as batches (`dpfedavg.engines.batched_runs`) of at
    most ``max_batch_memory`` bytes.

    On a cluster every node prepares the data for itself, from its own ``data_dir``
    and ``cache_dir`` (the same paths on every node; see the Ray cluster how-to).
    """
    from dpfedavg.config import RunConfig
    from dpfedavg.tasks import build_task

    options, grid_values = split_run_options(settings, allowed=tuple(Table1Grid.__dataclass_fields__))
    grid = Table1Grid(**grid_values)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cells = table1_cells(out, dataset, **grid_values)
    # Prepare the data (download, features, shard split) once, before the workers start.
    prep = RunConfig.from_run_config(
        {"task": dataset, "num-clients": NUM_CLIENTS[dataset], "clients-per-round": 0.2 * NUM_CLIENTS[dataset],
         "data-dir": grid.data_dir, "cache-dir": grid.cache_dir}
    )  # fmt: skip
    for seed in range(grid.seeds):
        _ = build_task(prep.replace(seed=seed)).partition
    run_cells(cells, desc=f"table1 {dataset}", **options)
    rows = collect(cells, dataset, out / "table1.csv")
    best = best_settings(rows)
    write_text(out / "table1.md", markdown(dataset, best, grid.epsilons, grid.rounds))
    outputs = {"csv": out / "table1.csv", "table": out / "table1.md"}
    curves = curve_cells(out, cells, best, grid.seeds)
    if curves:
        run_cells(curves, desc=f"curves {dataset}", **options)
        outputs["curves"] = plot_curves(curves, best, out / "curves.png", dataset)
    return outputs


def curve_cells(out: Path, cells: Sequence[Cell], best: dict, seeds: int) -> list[Cell]:
    """The best (C, eta_0) of each private (algorithm, epsilon), every seed, evaluated every 10 rounds."""
    by_key = {(c.cfg.algorithm, c.cfg.epsilon, c.cfg.clip, c.cfg.local_lr, c.cfg.seed): c for c in cells}
    curves = []
    for (alg, eps), (_, _, c, lr, _) in sorted(best.items()):
        if not get_bound(alg).private:
            continue
        for seed in range(seeds):
            cell = by_key[(alg, eps, c, lr, seed)]
            values = {**cell.cfg.to_run_config(), "eval-every": CURVE_EVAL_EVERY}
            curves.append(make_cell(out / "curves", cell.key, values))
    return curves


def plot_curves(curves: Sequence[Cell], best: dict, path: Path, dataset: str) -> Path:
    """``curves.png``: per epsilon, test accuracy over the rounds (mean over seeds) and C_k, best settings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dpfedavg.io.log_axis import plain_log_labels

    epsilons = sorted({c.cfg.epsilon for c in curves}, reverse=True)
    accuracy: dict = defaultdict(list)
    for cell in curves:
        with (cell.directory / "metrics.csv").open() as fh:
            points = [(int(r["round"]), float(r["test_accuracy"])) for r in csv.DictReader(fh) if r["test_accuracy"]]
        accuracy[(cell.cfg.algorithm, cell.cfg.epsilon)].append(points)
    c_k = clip_curves([((c.cfg.algorithm, c.cfg.epsilon), c.directory) for c in curves])
    styles = {"clip": ("--", "tab:orange", "Clipping"), "norm": ("-", "tab:blue", "Normalization"),
              ADAPTIVE: (":", "tab:green", "Adaptive clipping")}  # fmt: skip
    fig, axes = plt.subplots(2, len(epsilons), figsize=(5.0 * len(epsilons), 6.4), squeeze=False)
    for j, eps in enumerate(epsilons):
        for alg, (style, color, name) in styles.items():
            if (alg, eps) not in accuracy:
                continue
            _, _, c, lr, _ = best[(alg, eps)]
            runs = accuracy[(alg, eps)]
            rounds = [k for k, _ in runs[0]]
            mean = np.mean([[a for _, a in run] for run in runs], axis=0)
            label = f"{name} (C{'_0' if alg == ADAPTIVE else ''} = {c:g}, eta0 = {lr:g})"
            axes[0][j].plot(rounds, 100 * mean, style, color=color, label=label, lw=1.4, marker=".")
            y = c_k[(alg, eps)]
            axes[1][j].plot(np.arange(1, len(y) + 1), y, style, color=color, label=name, lw=1.4)
        axes[0][j].set_title(f"{dataset}, ({eps:g}, 1e-5)-DP: best setting per algorithm", fontsize=10)
        axes[0][j].set_ylabel("test accuracy (%)")
        axes[1][j].set_ylabel("C_k")
        axes[1][j].set_yscale("log")
        plain_log_labels(axes[1][j])
        for ax in axes[:, j]:
            ax.set_xlabel("round k")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"{dataset}: accuracy and clipping threshold over the rounds (mean over seeds)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
