"""Run outputs: ``metrics.csv`` (one row per round), ``config.json`` and ``model.npz``."""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import platform
from collections.abc import Mapping, Sequence
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from dpfedavg.io.atomic import atomic_write_bytes

__all__ = ["RunRecorder", "package_versions", "read_metrics", "write_config_json"]

logger = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def _versions() -> tuple[tuple[str, str], ...]:
    out = [("python", platform.python_version())]
    for pkg in ("dpfedavg", "flwr", "numpy", "dp-accounting", "ray"):
        try:
            out.append((pkg, metadata.version(pkg)))
        except metadata.PackageNotFoundError:
            out.append((pkg, "not installed"))
    return tuple(out)


def package_versions() -> dict[str, str]:
    """Versions of Python and the packages a result depends on (looked up once per process)."""
    return dict(_versions())


def _fmt(value: Any) -> Any:
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        return repr(value)
    return value


def read_metrics(path: Path) -> list[dict[str, float]]:
    """``metrics.csv`` as rows of floats (an empty cell is NaN), in file order."""
    with Path(path).open(newline="") as fh:
        return [{k: float(v) if v != "" else math.nan for k, v in row.items()} for row in csv.DictReader(fh)]


def write_config_json(path: Path, payload: Mapping[str, Any]) -> None:
    """``config.json``'s format (indented, sorted keys), written atomically."""
    atomic_write_bytes(path, json.dumps(payload, indent=2, sort_keys=True, default=str).encode())


class RunRecorder:
    """Writes one run's results under ``directory``.

    ``metrics.csv`` is appended and flushed after every round, so a run that
    dies still leaves the rounds it finished.
    """

    def __init__(self, directory: Path, columns: Sequence[str], keep_rounds_through: int | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.columns = tuple(columns)
        self.metrics_path = self.directory / "metrics.csv"
        self.config_path = self.directory / "config.json"
        self.model_path = self.directory / "model.npz"
        kept: list[list[str]] = []
        if keep_rounds_through is not None and self.metrics_path.exists():
            # a resumed run: keep the rows up to the checkpoint's round (later ones are redone)
            with self.metrics_path.open(newline="") as fh:
                rows = list(csv.reader(fh))
            if rows and tuple(rows[0]) == self.columns:
                kept = [row for row in rows[1:] if row and int(row[0]) <= keep_rounds_through]
        buf = io.StringIO()
        csv.writer(buf).writerows([self.columns, *kept])
        atomic_write_bytes(self.metrics_path, buf.getvalue().encode())

    def write_config(self, payload: Mapping[str, Any]) -> None:
        write_config_json(self.config_path, payload)

    def write_row(self, row: Mapping[str, Any]) -> None:
        unknown = set(row) - set(self.columns)
        if unknown:
            raise KeyError(f"metrics row has columns not in metrics.csv: {sorted(unknown)}")
        with self.metrics_path.open("a", newline="") as fh:
            csv.writer(fh).writerow([_fmt(row.get(col, float("nan"))) for col in self.columns])

    def write_plot(self, headline: str, title: str = "") -> Path | None:
        """``metrics.png``: the headline metric and epsilon over the rounds, from ``metrics.csv``.

        People look at a curve before a CSV. Needs matplotlib (the ``sim`` extra; imported lazily): without
        it nothing is written and ``None`` is returned. A run that does not compute the headline metric
        (``secure-noise`` withholds training-data metrics) plots epsilon alone.
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            logger.info("metrics.png not written: matplotlib is not installed (pip install matplotlib)")
            return None
        with self.metrics_path.open(newline="") as fh:
            rows = list(csv.DictReader(fh))
        pts = [(int(r["round"]), float(r[headline])) for r in rows if r.get(headline, "") not in ("", None)]
        eps = [(int(r["round"]), float(r["epsilon"])) for r in rows if r.get("epsilon", "") not in ("", "inf")]
        fig, ax = plt.subplots(figsize=(6.4, 3.6), constrained_layout=True)
        if pts:
            ax.plot(*zip(*pts, strict=True), color="tab:blue", marker="." if len(pts) < 40 else None)
            values = [v for _, v in pts]
            if min(values) > 0 and max(values) / min(values) > 10:  # e.g. a suboptimality over decades
                ax.set_yscale("log")
        ax.set_xlabel("round k")
        ax.set_ylabel(headline if headline in self.columns else f"{headline} (not computed)", color="tab:blue")
        if eps:
            twin = ax.twinx()
            twin.plot(*zip(*eps, strict=True), color="tab:red", linestyle="--", marker="o" if len(eps) < 40 else None)
            twin.set_ylabel("epsilon spent", color="tab:red")
            twin.set_ylim(bottom=0)
        ax.set_title(title, fontsize=9)
        path = self.directory / "metrics.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def write_model(self, **arrays: np.ndarray | int | float) -> None:
        buf = io.BytesIO()
        np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items()})
        atomic_write_bytes(self.model_path, buf.getvalue())
