"""Run outputs: ``metrics.csv`` (one row per round), ``config.json`` and ``model.npz``."""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import platform
import tempfile
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["RunRecorder", "TRAIN_COLUMNS", "package_versions", "atomic_write_bytes"]

logger = logging.getLogger(__name__)

#: Training columns of ``metrics.csv`` (the task's metrics follow ``beta``).
TRAIN_COLUMNS: tuple[str, ...] = (
    "num_sampled",
    "num_received",
    "num_failed",
    "num_dropped",
    "num_rejected",
    "eta",
    "beta",
    "snr",
    "frac_clipped",
    "mean_update_norm",
    "noise_multiplier",
    "epsilon",
    "skipped",
)


def package_versions() -> dict[str, str]:
    """Versions of Python and the packages a result depends on."""
    out = {"python": platform.python_version()}
    for pkg in ("dpfedavg", "flwr", "numpy", "dp-accounting", "ray"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fmt(value: Any) -> Any:
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        return repr(value)
    return value


class RunRecorder:
    """Writes one run's results under ``directory``.

    ``metrics.csv`` is appended and flushed after every round, so a run that
    dies still leaves the rounds it finished.
    """

    def __init__(self, directory: Path, metric_names: Sequence[str], keep_rounds_through: int | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.columns = ("round", *TRAIN_COLUMNS[:7], *metric_names, *TRAIN_COLUMNS[7:], "elapsed_s")
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
        data = json.dumps(payload, indent=2, sort_keys=True, default=str).encode()
        atomic_write_bytes(self.config_path, data)

    def write_row(self, row: Mapping[str, Any]) -> None:
        unknown = set(row) - set(self.columns)
        if unknown:
            raise KeyError(f"metrics row has columns not in metrics.csv: {sorted(unknown)}")
        with self.metrics_path.open("a", newline="") as fh:
            csv.writer(fh).writerow([_fmt(row.get(col, float("nan"))) for col in self.columns])

    def write_model(self, **arrays: np.ndarray | int | float) -> None:
        buf = io.BytesIO()
        np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items()})
        atomic_write_bytes(self.model_path, buf.getvalue())
