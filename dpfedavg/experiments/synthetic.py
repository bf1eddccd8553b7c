"""Paper §4.4: DP-FedAvg (clip) vs DP-NormFedAvg (norm) on the synthetic quadratic; Figures 1-3.

Grid: C x init x eta x seed x {clip, norm}, full participation (n = r = 100),
E = 20, eta_k = beta_k = eta, no momentum, K rounds, noise calibrated by the
accountant for (epsilon, delta) = (5, 1e-6) over K rounds. The clip and norm
runs of one seed use exactly the same noise vectors (same seed, same streams),
as the paper does. Every run keeps the SNR diagnostic (clients report their
clean ``g``; fine in simulation, never with real users).

Outputs in ``out``: ``synthetic.csv`` (``algorithm,C,init,eta,seed,round,
suboptimality,snr,C_k``), ``figure1.png`` (suboptimality), ``figure2.png`` (SNR),
``figure3.png`` (trajectories), ``adaptive.png`` (adaptive clipping beside clip and norm, with C_k)
and ``summary.md`` (the numbers behind the paper's claims).

The grid also has ``adaptive-clip`` rows (Andrew et al. 2021; not in the paper): ``C`` is the initial
``C_0``, ``sigma_b`` as `dpfedavg.experiments.adaptive.adaptive_values()` chooses it.

Figure 3's projection: the trajectories ``w_k - w*`` of the clip and the norm
run (seed 0) are projected on ``e1`` = the unit vector from ``w*`` to ``w_0``
and ``e2`` = the direction of largest variance of both trajectories orthogonal
to ``e1`` (first principal component of the residuals), then smoothed by a
centered moving average over 25 rounds; the optimum is the origin.
"""

from __future__ import annotations

import csv
import logging
import warnings
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Unpack

import numpy as np

from dpfedavg.experiments import PAPER_ALGORITHMS
from dpfedavg.experiments.adaptive import ADAPTIVE, adaptive_values
from dpfedavg.experiments.sweep import Cell, RunOptions, make_cell, run_cells, split_run_options
from dpfedavg.io.atomic import write_csv, write_text

__all__ = ["SYNTHETIC_COLUMNS", "synthetic_cells", "run_synthetic"]

logger = logging.getLogger(__name__)

SYNTHETIC_COLUMNS = ("algorithm", "C", "init", "eta", "seed", "round", "suboptimality", "snr", "C_k")
#: The algorithms of the grid by default: the paper's two (``--algorithms ... adaptive-clip`` adds C_0 rows).
ALGORITHMS = PAPER_ALGORITHMS
#: The two cases of the paper's Figure 3 (init, C, eta).
FIGURE3_CASES = (("I1", 50.0, 0.003), ("I1", 100.0, 0.001))


def _key(alg: str, c: float, init: str, eta: float, seed: int) -> str:
    return f"{alg}-C{c:g}-{init}-eta{eta:g}-seed{seed}"


def synthetic_cells(
    out: Path,
    *,
    clips: Sequence[float],
    inits: Sequence[str],
    etas: Sequence[float],
    seeds: int,
    rounds: int,
    epsilon: float = 5.0,
    delta: float = 1e-6,
    algorithms: Sequence[str] = ALGORITHMS,
) -> list[Cell]:
    """The grid's cells (validated: a bad value raises ConfigError before anything runs)."""
    cells = []
    for c in clips:
        for init in inits:
            for eta in etas:
                for seed in range(seeds):
                    for alg in algorithms:
                        values = {
                            "task": "quadratic",
                            "algorithm": alg,
                            "clip": float(c),
                            "init": init,
                            "local-lr": float(eta),
                            "server-lr": "eta",
                            "lr-decay": 1.0,
                            "server-momentum": 0.0,
                            "local-steps": 20,
                            "num-clients": 100,
                            "clients-per-round": 100.0,
                            "num-rounds": rounds,
                            "epsilon": epsilon,
                            "delta": delta,
                            "seed": seed,
                            "diagnostics": True,
                            "save-trajectory": seed == 0 and (init, float(c), float(eta)) in FIGURE3_CASES,
                        }
                        if alg == ADAPTIVE:
                            values = adaptive_values(values)
                        cells.append(make_cell(out, _key(alg, c, init, eta, seed), values))
    return cells


def collect(cells: Sequence[Cell], path: Path) -> list[dict]:
    """Write ``synthetic.csv`` from the cells' ``metrics.csv``; returns the rows."""
    rows = []
    nan = float("nan")
    for cell in cells:
        cfg = cell.cfg
        with (cell.directory / "metrics.csv").open() as fh:
            reader = csv.reader(fh)
            header = next(reader)
            at_round, at_sub, at_snr = header.index("round"), header.index("suboptimality"), header.index("snr")
            at_clip = header.index("clip") if "clip" in header else None
            run = {"algorithm": cfg.algorithm, "C": cfg.clip, "init": cfg.init, "eta": cfg.local_lr, "seed": cfg.seed}
            for r in reader:
                clip = r[at_clip] if at_clip is not None else ""
                rows.append({
                    **run,
                    "round": int(r[at_round]),
                    "suboptimality": float(r[at_sub]),
                    "snr": float(r[at_snr]) if r[at_snr] else nan,
                    "C_k": float(clip) if clip else nan,
                })  # fmt: skip
    write_csv(path, SYNTHETIC_COLUMNS, rows)
    return rows


def _curves(rows: list[dict], metric: str) -> dict[tuple, np.ndarray]:
    """(alg, C, init, eta) -> mean over seeds of ``metric`` per round."""
    by = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        by[(r["algorithm"], r["C"], r["init"], r["eta"])][r["seed"]][r["round"]] = r[metric]
    out = {}
    for key, seeds in by.items():
        rounds = sorted(next(iter(seeds.values())))
        values = np.array([[s[k] for k in rounds] for s in seeds.values()], dtype=float)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # SNR is undefined (NaN) at round 0
            out[key] = np.nanmean(values, axis=0)
    return out


def _smooth(x: np.ndarray, window: int = 25) -> np.ndarray:
    if len(x) < window:
        return x
    kernel = np.ones(window) / window
    padded = np.pad(x, (window // 2, window - 1 - window // 2), mode="edge")
    return np.convolve(padded, kernel, mode="valid")


def plot(rows: list[dict], cells: Sequence[Cell], out: Path, z: float, snr_eta: float) -> list[Path]:
    """Figures 1-3 as PNGs in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dpfedavg.io.log_axis import plain_log_labels

    clips = sorted({r["C"] for r in rows})
    inits = sorted({r["init"] for r in rows})
    etas = sorted({r["eta"] for r in rows})
    colors = dict(zip(etas, plt.cm.viridis(np.linspace(0.1, 0.85, len(etas))), strict=True))
    paths = []
    for number, metric, label in ((1, "suboptimality", "f(w_k) - f*"), (2, "snr", "SNR_k")):
        curves = _curves(rows, metric)
        fig, axes = plt.subplots(len(inits), len(clips), figsize=(4.2 * len(clips), 3.4 * len(inits)), squeeze=False)
        for i, init in enumerate(inits):
            for j, c in enumerate(clips):
                ax = axes[i][j]
                for eta in etas if metric == "suboptimality" else [snr_eta]:
                    for alg, style, name in (("clip", "--", "Clip"), ("norm", "-", "Norm")):
                        y = curves.get((alg, c, init, eta))
                        if y is None:
                            continue
                        color = (
                            colors[eta]
                            if metric == "suboptimality"
                            else ("tab:orange" if alg == "clip" else "tab:blue")
                        )
                        ax.plot(np.arange(len(y)), y, style, color=color, label=f"{name}({eta:g})", lw=1.3)
                ax.set_yscale("log")
                plain_log_labels(ax)
                ax.set_title(f"{init}: C = {c:g}  (z = {z:.2f})", fontsize=10)
                ax.set_xlabel("round k")
                ax.set_ylabel(label)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
        fig.suptitle(
            f"Figure {number}: {label}, mean over seeds; (5, 1e-6)-DP, noise multiplier z = {z:.3f}", fontsize=11
        )
        fig.tight_layout()
        path = out / f"figure{number}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    paths.append(_plot_trajectories(cells, out, z, plt))
    return [p for p in paths if p is not None]


def _plot_trajectories(cells: Sequence[Cell], out: Path, z: float, plt) -> Path | None:
    from dpfedavg.tasks import build_task

    cases = []
    for init, c, eta in FIGURE3_CASES:
        found = {
            cell.cfg.algorithm: cell
            for cell in cells
            if (cell.cfg.init, cell.cfg.clip, cell.cfg.local_lr, cell.cfg.seed) == (init, c, eta, 0)
            and (cell.directory / "trajectory.npy").exists()
        }
        if {"clip", "norm"} <= set(found):  # Figure 3 is the paper's: clip and norm
            cases.append((init, c, eta, {alg: found[alg] for alg in ("clip", "norm")}))
    if not cases:
        logger.info("Figure 3 skipped: the grid has none of its cases %s", FIGURE3_CASES)
        return None
    fig, axes = plt.subplots(1, len(cases), figsize=(5.5 * len(cases), 4.6), squeeze=False)
    for ax, (init, c, eta, found) in zip(axes[0], cases, strict=True):
        w_opt = build_task(found["norm"].cfg).optimum[0]
        trajs = {
            alg: np.load(cell.directory / "trajectory.npy").astype(np.float64) - w_opt for alg, cell in found.items()
        }
        e1 = trajs["norm"][0] / np.linalg.norm(trajs["norm"][0])
        stacked = np.concatenate(list(trajs.values()))
        residual = stacked - np.outer(stacked @ e1, e1)
        _, _, vt = np.linalg.svd(residual - residual.mean(axis=0), full_matrices=False)
        e2 = vt[0] - (vt[0] @ e1) * e1
        e2 /= np.linalg.norm(e2)
        for alg, style, name in (("clip", "--", "DP-FedAvg (clip)"), ("norm", "-", "DP-NormFedAvg")):
            xy = trajs[alg] @ np.stack([e1, e2]).T
            ax.plot(_smooth(xy[:, 0]), _smooth(xy[:, 1]), style, lw=1.5, label=name)
            ax.plot(xy[0, 0], xy[0, 1], "o", color="gray")
        ax.plot(0, 0, "*", ms=16, color="red", label="optimum w*")
        ax.set_title(f"{init}: C = {c:g}, eta = {eta:g} (z = {z:.2f}, seed 0)", fontsize=10)
        ax.set_xlabel("along w_0 - w*")
        ax.set_ylabel("largest orthogonal variation")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Figure 3: smoothed 2-D projection of the trajectories (25-round moving average)", fontsize=11)
    fig.tight_layout()
    path = out / "figure3.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summarize(rows: list[dict], z: float, tail: int = 50) -> str:
    """Markdown: final suboptimality (mean of the last ``tail`` rounds and seeds) and SNR comparison."""
    by = defaultdict(list)
    snr = defaultdict(lambda: defaultdict(dict))  # (C, init, eta) -> (seed, round) -> algorithm -> SNR_k
    last_round = max(r["round"] for r in rows)
    for r in rows:
        key = (r["C"], r["init"], r["eta"])
        if r["round"] > last_round - tail:
            by[(r["algorithm"], *key)].append(r["suboptimality"])
        if r["round"] > 0:
            snr[key][(r["seed"], r["round"])][r["algorithm"]] = r["snr"]
    lines = [
        f"Noise multiplier z = {z:.4f} (PLD, (5, 1e-6) over {last_round} rounds, q = 1).",
        "",
        "| init | C | eta | clip: f - f* | norm: f - f* | clip / norm | rounds with SNR_norm >= SNR_clip |",
        "|---|---|---|---|---|---|---|",
    ]
    for c, init, eta in sorted({k[1:] for k in by}):
        clip_v, norm_v = np.mean(by[("clip", c, init, eta)]), np.mean(by[("norm", c, init, eta)])
        pairs = [v for v in snr[(c, init, eta)].values() if {"clip", "norm"} <= set(v)]
        share = np.mean([v["norm"] >= v["clip"] * (1 - 1e-9) for v in pairs]) if pairs else float("nan")
        lines.append(
            f"| {init} | {c:g} | {eta:g} | {clip_v:.4g} | {norm_v:.4g} | {clip_v / norm_v:.3g} | {100 * share:.1f}% |"
        )
    lines.append("")
    lines.append(f"f - f*: mean over the last {tail} rounds and over seeds. SNR pairs: same seed, same round.")
    if any(k[0] == ADAPTIVE for k in by):
        lines += ["", *_adaptive_table(rows, by)]
    return "\n".join(lines) + "\n"


def _adaptive_table(rows: list[dict], by: dict) -> list[str]:
    """Adaptive clipping (C = C_0) beside clip and norm at the same C, and where C_k ended."""
    last_round = max(r["round"] for r in rows)
    final_c = defaultdict(list)
    for r in rows:
        if r["algorithm"] == ADAPTIVE and r["round"] == last_round:
            final_c[(r["C"], r["init"], r["eta"])].append(r["C_k"])
    lines = [
        "Adaptive clipping (Andrew et al. 2021; C is the initial C_0, target quantile 0.5, eta_C = 0.2):",
        "",
        "| init | C (C_0) | eta | clip: f - f* | norm: f - f* | adaptive: f - f* | adaptive / norm | final C_K |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c, init, eta in sorted({k[1:] for k in by if k[0] == ADAPTIVE}):
        v = {alg: np.mean(by[(alg, c, init, eta)]) if by.get((alg, c, init, eta)) else float("nan")
             for alg in (*PAPER_ALGORITHMS, ADAPTIVE)}  # fmt: skip
        lines.append(
            f"| {init} | {c:g} | {eta:g} | {v['clip']:.4g} | {v['norm']:.4g} | {v[ADAPTIVE]:.4g} | "
            f"{v[ADAPTIVE] / v['norm']:.3g} | {np.mean(final_c[(c, init, eta)]):.4g} |"
        )
    return lines


def plot_adaptive(rows: list[dict], out: Path, z: float, eta: float) -> Path | None:
    """``adaptive.png``: per init, f - f* of clip / norm / adaptive-clip at each C (= C_0), and C_k over rounds."""
    if not any(r["algorithm"] == ADAPTIVE for r in rows):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dpfedavg.io.log_axis import plain_log_labels

    clips = sorted({r["C"] for r in rows})
    inits = sorted({r["init"] for r in rows})
    curves, c_k = _curves(rows, "suboptimality"), _curves(rows, "C_k")
    fig, axes = plt.subplots(len(inits), len(clips) + 1, figsize=(4.0 * (len(clips) + 1), 3.3 * len(inits)),
                             squeeze=False)  # fmt: skip
    styles = {"clip": ("--", "tab:orange", "Clip"), "norm": ("-", "tab:blue", "Norm"),
              ADAPTIVE: (":", "tab:green", "Adaptive clip")}  # fmt: skip
    colors = dict(zip(clips, plt.cm.viridis(np.linspace(0.1, 0.85, len(clips))), strict=True))
    for i, init in enumerate(inits):
        for j, c in enumerate(clips):
            ax = axes[i][j]
            for alg, (style, color, name) in styles.items():
                y = curves.get((alg, c, init, eta))
                if y is not None:
                    ax.plot(np.arange(len(y)), y, style, color=color, label=name, lw=1.3)
            ax.set_yscale("log")
            plain_log_labels(ax)
            ax.set_title(f"{init}: C (= C_0) = {c:g}, eta = {eta:g}", fontsize=10)
            ax.set_xlabel("round k")
            ax.set_ylabel("f(w_k) - f*")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        ax = axes[i][-1]
        for c in clips:
            y = c_k.get((ADAPTIVE, c, init, eta))
            if y is not None:
                ax.plot(np.arange(1, len(y)), y[1:], color=colors[c], label=f"C_0 = {c:g}", lw=1.3)
        ax.set_title(f"{init}: adaptive C_k (eta = {eta:g})", fontsize=10)
        ax.set_xlabel("round k")
        ax.set_ylabel("C_k")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Adaptive clipping beside clip and norm, mean over seeds; (5, 1e-6)-DP, z = {z:.3f}", fontsize=11)
    fig.tight_layout()
    path = out / "adaptive.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_synthetic(
    out: Path,
    *,
    clips: Sequence[float] = (40.0, 50.0, 100.0),
    inits: Sequence[str] = ("I1", "I2"),
    etas: Sequence[float] = (0.0003, 0.001, 0.003),
    seeds: int = 3,
    rounds: int = 500,
    snr_eta: float | None = None,
    algorithms: Sequence[str] = ALGORITHMS,
    **options: Unpack[RunOptions],
) -> dict[str, Path]:
    """Run (or resume) the grid (on a Ray cluster with ``ray_address``), then write the CSV, figures and summary.

    ``options`` (`dpfedavg.experiments.sweep.RunOptions`) say how the cells run: as batches
    (`dpfedavg.engines.batched_runs`) of at most ``max_batch_memory`` bytes by default.
    """
    from dpfedavg.privacy.setup import PrivacySetup

    split_run_options(options)  # a key that is no run option fails here, before anything runs
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cells = synthetic_cells(out, clips=clips, inits=inits, etas=etas, seeds=seeds, rounds=rounds, algorithms=algorithms)
    run_cells(cells, desc="synthetic", **options)
    z = PrivacySetup.resolve(cells[0].cfg).plan.noise_multiplier
    rows = collect(cells, out / "synthetic.csv")
    snr_eta = snr_eta if snr_eta is not None else sorted(etas)[len(etas) // 2]
    figures = plot(rows, cells, out, z, snr_eta)
    adaptive_figure = plot_adaptive(rows, out, z, snr_eta)
    if adaptive_figure is not None:
        figures.append(adaptive_figure)
    write_text(out / "summary.md", summarize(rows, z))
    return {"csv": out / "synthetic.csv", "summary": out / "summary.md", **{p.stem: p for p in figures}}
