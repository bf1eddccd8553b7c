"""Private tuning's report: the per-run table next to the privately tuned release (``private_tuning.md`` / ``.png``)."""

from __future__ import annotations

import csv
import json
import logging
import warnings
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dpfedavg.io.atomic import write_text
from dpfedavg.privacy.accountants import PldAccountant
from dpfedavg.privacy.calibration import calibrate_noise_multiplier, epsilon_for
from dpfedavg.privacy.selection import TrialCount

__all__ = ["markdown", "plot", "summarize", "write_report"]

logger = logging.getLogger(__name__)

#: How the tables name the paper's algorithms.
_NAMES = {"clip": "Clipping", "norm": "Normalization"}


def _per_run_columns(table1_rows: Sequence[dict], alg: str, eps: float, cal: dict) -> dict:
    """The per-run grid's side of a summary row: its best setting, one blind run, the grid paid by composition."""
    from dpfedavg.experiments.table1 import best_settings

    group = [r for r in table1_rows if (r["algorithm"], r["epsilon"]) == (alg, eps)]
    pr = best_settings(list(table1_rows)).get((alg, eps))
    n_runs = len(group)
    z_run = float(group[-1]["noise_multiplier"]) if group else None
    rounds = cal["rounds"] * n_runs  # every run of the grid search, composed
    accs = [r["last5_test_accuracy"] for r in group]  # one run at a grid point picked blindly: no selection
    return {
        "per_run_accuracy": pr[0] if pr else None,
        "per_run_std": pr[1] if pr else None,
        "per_run_C": pr[2] if pr else None,
        "per_run_eta0": pr[3] if pr else None,
        "per_run_seeds": pr[4] if pr else None,
        "per_run_noise_multiplier": z_run,
        "untuned_accuracy": float(np.mean(accs)) if accs else None,
        "untuned_std": float(np.std(accs)) if accs else None,
        "grid_runs": n_runs,
        "grid_end_to_end_epsilon": (
            epsilon_for(z_run, cal["q"], rounds, cal["delta"], PldAccountant.name) if z_run is not None else None
        ),
        "grid_noise_multiplier_at_end_to_end_epsilon": (
            calibrate_noise_multiplier(eps, cal["delta"], cal["q"], rounds, PldAccountant.name) if n_runs else None
        ),
    }


def _tuned_columns(rows: Sequence[dict], alg: str, eps: float, cal: dict, repetitions: int) -> dict:
    """Private tuning's side of a summary row: the released trials, the number of trials drawn, the noise."""
    mine = [r for r in rows if (r["algorithm"], r["epsilon"]) == (alg, eps)]
    released = sorted((r for r in mine if r["released"]), key=lambda r: r["repetition"])
    accs = [r["last5_test_accuracy"] for r in released]
    counts = {r["repetition"]: r["num_trials"] for r in mine}
    ts = [counts.get(rep, 0) for rep in range(repetitions)]
    settings: dict[tuple, int] = defaultdict(int)
    for r in released:
        settings[(r["C"], r["eta0"])] += 1
    mode = max(settings.items(), key=lambda kv: kv[1]) if settings else None
    return {
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


def summarize(
    rows: Sequence[dict],
    table1_rows: Sequence[dict],
    calibration: dict[float, dict],
    repetitions: int,
    algorithms: Sequence[str],
) -> list[dict]:
    """Per (epsilon, algorithm): the per-run table's best next to the privately tuned release."""
    return [
        {
            "algorithm": alg,
            "epsilon": eps,
            **_per_run_columns(table1_rows, alg, eps, cal),
            **_tuned_columns(rows, alg, eps, cal, repetitions),
        }
        for eps, cal in calibration.items()
        for alg in algorithms
    ]


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


def write_report(
    where: Path,
    table1_csv: Path,
    dataset: str,
    rows: Sequence[dict],
    calibration: dict[float, dict],
    *,
    count: TrialCount,
    repetitions: int,
    tuning_seed: int,
) -> dict[str, Path]:
    """``private_tuning.json`` (calibration and summary), ``.md`` and ``.png`` in ``where``; their paths.

    ``rows`` are ``private_tuning.csv``'s (every trial, the released one marked); ``table1_csv`` is the
    per-run grid the tuning is compared with.
    """
    with Path(table1_csv).open() as fh:
        table1_rows = [
            {**r, "epsilon": float(r["epsilon"]), "C": float(r["C"]), "eta0": float(r["eta0"]),
             "last5_test_accuracy": float(r["last5_test_accuracy"])}
            for r in csv.DictReader(fh)
        ]  # fmt: skip
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
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
    write_text(where / "private_tuning.json", json.dumps(report, indent=2) + "\n")
    write_text(where / "private_tuning.md", markdown(dataset, summary, count, repetitions, tuning_seed))
    result = {
        "private_tuning_csv": where / "private_tuning.csv",
        "private_tuning_json": where / "private_tuning.json",
        "private_tuning_table": where / "private_tuning.md",
    }
    png = plot(summary, rows, where / "private_tuning.png", dataset)
    if png is not None:
        result["private_tuning_plot"] = png
    return result
