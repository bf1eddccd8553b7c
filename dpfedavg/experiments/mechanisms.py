"""Issue 31's comparison: independent noise (Poisson sampling) against banded-MF noise, at equal (epsilon, delta).

Grid: task setting x noise mechanism x algorithm (clip, norm) x epsilon x seed, batched engine. Every cell of a
setting has the same hyperparameters (not tuned per mechanism); only the noise mechanism and epsilon change:

``synthetic``
    The paper's §4.4 quadratic (d = 200, E = 20, eta = beta = 0.003, C = 50, delta = 1e-6) with n = 100 and an
    expected cohort r = 25 (independent: q = 0.25; banded: b = 4 cyclic groups of 25). Metric: suboptimality.
``digits``
    Table 1's digits protocol (n = 100, r = 20, E = 20, eta_k = 0.99^k eta_0, beta_k = eta_k, momentum 0.8,
    delta = 1e-5) at C = 15.625, eta_0 = 0.008 (Table 1's best clip setting at epsilon 5). Metric: test accuracy.
``fmnist-shape``
    The FMNIST shape n = 3000, r = 600 (b = 5 groups of 600) on the quadratic task (the machine has no
    FMNIST; a generated image set has random labels, so its accuracy says nothing): suboptimality.

Mechanisms (the ``--mechanisms`` axis): ``independent`` (Poisson sampling with q = r/n, client-calibrated
independent noise, the project's default), ``banded-mf`` (cyclic groups, b = floor(n/r), the default
square-root coefficients, server noise) and ``banded-mf-poisson`` (cyclic Poisson: b = floor(n / 2r) groups,
each client of the round's group with p = r b / n, the amplified analysis of Choquette-Choo et al. 2023).

Outputs in ``out``: ``mechanisms.csv`` (one row per run), ``mechanisms.md`` (mean ± std over seeds) and
``mechanisms.png`` (the metric against epsilon, one panel per setting).
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dpfedavg.experiments import PAPER_ALGORITHMS
from dpfedavg.experiments.sweep import Cell, make_cell, run_cells
from dpfedavg.io.atomic import write_csv, write_text

__all__ = ["EPSILONS", "MECHANISM_VARIANTS", "SETTINGS", "mechanism_cells", "run_mechanisms"]

logger = logging.getLogger(__name__)

EPSILONS = (1.0, 2.0, 5.0, 10.0)
#: Task settings: run_config values shared by every cell, and the metric (and whether higher is better).
SETTINGS: dict[str, tuple[dict, str, bool]] = {
    "synthetic": (
        {"task": "quadratic", "num-clients": 100, "clients-per-round": 25.0, "dim": 200, "local-steps": 20,
         "local-lr": 0.003, "server-lr": "eta", "clip": 50.0, "delta": 1e-6},
        "suboptimality", False,
    ),
    "digits": (
        {"task": "digits", "num-clients": 100, "clients-per-round": 20.0, "local-steps": 20, "local-lr": 0.008,
         "lr-decay": 0.99, "server-lr": "eta", "server-momentum": 0.8, "clip": 15.625, "delta": 1e-5},
        "test_accuracy", True,
    ),
    "fmnist-shape": (
        {"task": "quadratic", "num-clients": 3000, "clients-per-round": 600.0, "dim": 200, "local-steps": 20,
         "local-lr": 0.003, "server-lr": "eta", "clip": 50.0, "delta": 1e-5},
        "suboptimality", False,
    ),
}  # fmt: skip


def _variant(name: str, base: dict) -> dict:
    """The run_config values of a mechanism variant for a setting."""
    n, r = base["num-clients"], base["clients-per-round"]
    if name == "independent":
        return {}
    banded = {"noise-mechanism": "banded-mf", "noise-placement": "server"}
    if name == "banded-mf":
        return banded
    if name == "banded-mf-poisson":
        return {**banded, "participation": "cyclic-poisson", "bands": max(1, math.floor(n / (2 * r)))}
    raise ValueError(f"unknown mechanism variant {name!r}; allowed: {', '.join(MECHANISM_VARIANTS)}")


#: The ``--mechanisms`` axis.
MECHANISM_VARIANTS = ("independent", "banded-mf", "banded-mf-poisson")


def mechanism_cells(
    out: Path,
    *,
    settings: Sequence[str] = tuple(SETTINGS),
    mechanisms: Sequence[str] = MECHANISM_VARIANTS,
    algorithms: Sequence[str] = PAPER_ALGORITHMS,
    epsilons: Sequence[float] = EPSILONS,
    seeds: int = 3,
    rounds: int = 200,
) -> list[Cell]:
    """Every run of the comparison (validated: a bad value raises ConfigError before anything runs)."""
    cells = []
    for setting in settings:
        base = SETTINGS[setting][0]
        for mech in mechanisms:
            for alg in algorithms:
                for eps in epsilons:
                    for seed in range(seeds):
                        values = {**base, **_variant(mech, base), "algorithm": alg, "epsilon": float(eps),
                                  "seed": seed, "num-rounds": rounds, "eval-every": rounds,
                                  "checkpoint-every": 0}  # fmt: skip
                        key = f"{setting}-{mech}-{alg}-eps{eps:g}-seed{seed}"
                        cells.append(make_cell(out, key, values))
    return cells


def _row(cell: Cell) -> dict:
    saved = json.loads((cell.directory / "config.json").read_text())
    cfg = cell.cfg
    setting = next(name for name, (base, _, _) in SETTINGS.items() if _matches(cfg, base))
    metric = SETTINGS[setting][1]
    record = saved["privacy"].get("banded_mf") or {}
    mech = "independent"
    if cfg.noise_mechanism == "banded-mf":
        mech = "banded-mf-poisson" if cfg.participation == "cyclic-poisson" else "banded-mf"
    return {
        "setting": setting,
        "mechanism": mech,
        "algorithm": cfg.algorithm,
        "epsilon": cfg.epsilon,
        "seed": cfg.seed,
        "metric": metric,
        "last5": saved["final"][f"last5_{metric}"],
        "epsilon_spent": saved["final"]["epsilon"],
        "noise_multiplier": saved["privacy"]["noise_multiplier"],
        "bands": record.get("bands", ""),
        "sigma_of_average": saved["privacy"]["sigma"],
    }


def _matches(cfg, base: dict) -> bool:
    return cfg.task == base["task"] and cfg.num_clients == base["num-clients"]


def collect(cells: Sequence[Cell], out: Path) -> list[dict]:
    """``mechanisms.csv``: one row per run."""
    rows = [_row(cell) for cell in cells]
    write_csv(out / "mechanisms.csv", list(rows[0]), rows)
    return rows


def _summary(rows: list[dict]) -> dict[tuple, tuple[float, float, int]]:
    groups: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        groups[(r["setting"], r["mechanism"], r["algorithm"], r["epsilon"])].append(float(r["last5"]))
    return {k: (float(np.mean(v)), float(np.std(v)), len(v)) for k, v in groups.items()}


def markdown(rows: list[dict]) -> str:
    """One table per setting: mechanism x algorithm rows, epsilon columns (mean ± std over seeds)."""
    stats = _summary(rows)
    lines = []
    for setting in dict.fromkeys(r["setting"] for r in rows):
        _, metric, higher = SETTINGS[setting]
        eps = sorted({r["epsilon"] for r in rows if r["setting"] == setting})
        fmt = (lambda m, s: f"{100 * m:.2f}% ± {100 * s:.2f}") if higher else (lambda m, s: f"{m:.4g} ± {s:.2g}")
        better = "higher" if higher else "lower"
        lines += [f"**{setting}** ({metric}, last 5 rounds, {better} is better; mean ± std over seeds)", ""]
        lines.append("| mechanism | algorithm | " + " | ".join(f"epsilon = {e:g}" for e in eps) + " |")
        lines.append("|---|---|" + "---|" * len(eps))
        keys = sorted({(r["mechanism"], r["algorithm"]) for r in rows if r["setting"] == setting},
                      key=lambda k: (MECHANISM_VARIANTS.index(k[0]), k[1]))  # fmt: skip
        for mech, alg in keys:
            best = []
            for e in eps:
                m, s, _ = stats[(setting, mech, alg, e)]
                rivals = [stats[(setting, other, alg, e)][0] for other, a in keys if a == alg]
                top = (max(rivals) if higher else min(rivals)) == m
                best.append(f"**{fmt(m, s)}**" if top else fmt(m, s))
            lines.append(f"| {mech} | {alg} | " + " | ".join(best) + " |")
        lines += ["", "Bold: the best mechanism for that algorithm and epsilon.", ""]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path:
    """The metric against epsilon, one panel per setting, one line per (mechanism, algorithm)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dpfedavg.io.log_axis import plain_log_labels

    stats = _summary(rows)
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    fig, axes = plt.subplots(1, len(settings), figsize=(5 * len(settings), 4), squeeze=False)
    styles = {"independent": "-", "banded-mf": "--", "banded-mf-poisson": ":"}
    for ax, setting in zip(axes[0], settings, strict=True):
        _, metric, higher = SETTINGS[setting]
        for mech in MECHANISM_VARIANTS:
            for alg, color in (("clip", "tab:blue"), ("norm", "tab:orange")):
                pts = sorted((e, stats[k][0], stats[k][1]) for k in stats if k[:3] == (setting, mech, alg)
                             for e in [k[3]])  # fmt: skip
                if not pts:
                    continue
                e, m, s = map(np.asarray, zip(*pts, strict=True))
                ax.errorbar(e, m, yerr=s, linestyle=styles[mech], color=color, marker="o", ms=3, capsize=2,
                            label=f"{mech}, {alg}")  # fmt: skip
        ax.set_xscale("log")
        ax.set_xticks(sorted({r["epsilon"] for r in rows}), [f"{e:g}" for e in sorted({r["epsilon"] for r in rows})])
        if not higher:
            ax.set_yscale("log")
            plain_log_labels(ax)
        ax.set_xlabel("epsilon")
        ax.set_ylabel(metric + (" (higher is better)" if higher else " (lower is better)"))
        ax.set_title(setting)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_mechanisms(out: Path, *, jobs: int = 1, progress: bool = True, **grid) -> dict[str, Path]:
    """Run (or resume) the comparison and write its table and plot; returns the output files."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cells = mechanism_cells(out, **grid)
    run_cells(cells, jobs=jobs, progress=progress, desc="mechanisms")
    rows = collect(cells, out)
    write_text(out / "mechanisms.md", markdown(rows))
    return {"csv": out / "mechanisms.csv", "table": out / "mechanisms.md", "plot": plot(rows, out / "mechanisms.png")}
