"""Run outputs: ``metrics.csv`` (one row per round), ``config.json`` and ``model.npz``."""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import platform
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dpfedavg.errors import ConfigError
from dpfedavg.io.atomic import append_bytes, atomic_write_bytes
from dpfedavg.io.metrics import MetricsRow

if TYPE_CHECKING:
    from dpfedavg.config import RunConfig

__all__ = [
    "RESULT_FILES",
    "RunRecorder",
    "RunResult",
    "check_output_dir",
    "check_run_directory",
    "complete_rows",
    "package_versions",
    "read_metrics",
    "run_directory",
    "write_config_json",
]

#: The files a run writes in its directory: a directory holding one of them holds a run's results.
RESULT_FILES = ("metrics.csv", "config.json", "model.npz", "checkpoint.npz", "metrics.png", "trajectory.npy")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunResult:
    """What a finished run returns (its files are in `directory`).

    Attributes
    ----------
    weights:
        ``w_K``, the last model (flat, float64), as in ``model.npz`` ``w_final``.
    random_iterate:
        ``w_{k~}`` (Alg. 1 line 13), the iterate the paper's guarantee is about, and its round.
    epsilon, delta:
        The ``(epsilon, delta)`` the run spent (``inf`` without DP).
    guarantee:
        ``"dp"``, ``"seeded"`` or ``"none"`` (``config.json`` ``privacy.guarantee`` explains it).
    history:
        ``metrics.csv`` as a list of rows (round 0 first): column -> value, NaN where empty.
    directory:
        The run directory: ``metrics.csv``, ``config.json``, ``model.npz``, ``metrics.png``.
    """

    weights: np.ndarray
    random_iterate: np.ndarray
    random_round: int
    epsilon: float
    delta: float
    guarantee: str
    history: list[dict[str, float]]
    directory: Path
    stopped_by_budget_before_round: int | None = None
    #: ``canary-clients > 0``: the run's empirical epsilons beside the accountant's (``config.json`` ``final.audit``;
    #: ``dpfedavg.privacy.canary.CanaryAudit``); ``None`` otherwise.
    audit: dict[str, Any] | None = None

    def load_into(self, module: Any, *, iterate: str = "final") -> Any:
        """Copy the run's model into a ``torch.nn.Module`` of the architecture it trained; returns the module.

        ``iterate``: ``"final"`` (``w_K``, ``weights``) or ``"random"`` (``w_{k~}``, Alg. 1 line 13). The flat
        vector's layout is `TorchTask`'s (see `dpfedavg.tasks.torch_task.load_weights`).
        """
        from dpfedavg.tasks.torch_task import load_weights

        choices = {"final": self.weights, "random": self.random_iterate}
        if iterate not in choices:
            raise ValueError(f"iterate = {iterate!r}: allowed values are 'final' (w_K) and 'random' (w_k~)")
        return load_weights(module, choices[iterate])


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


def complete_rows(path: Path) -> list[list[str]]:
    """``metrics.csv``'s complete rows, header first: a last line without its terminator (a process killed while
    appending it) is dropped with a warning, and so is any row of the wrong width."""
    text = Path(path).read_bytes().decode()
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith(("\n", "\r")):
        logger.warning("%s ends with an incomplete row (written when the run stopped); it is ignored", path)
        lines = lines[:-1]
    rows = list(csv.reader(lines))
    if not rows:
        return rows
    width = len(rows[0])
    kept = [row for row in rows if len(row) == width]
    if len(kept) != len(rows):
        logger.warning("%s: %d rows of the wrong width are ignored", path, len(rows) - len(kept))
    return kept


def read_metrics(path: Path) -> list[dict[str, float]]:
    """``metrics.csv`` as rows of floats (an empty cell is NaN), in file order (complete rows only)."""
    header, *rows = complete_rows(path) or [[]]
    return [
        MetricsRow((k, float(v) if v != "" else math.nan) for k, v in zip(header, row, strict=True)) for row in rows
    ]


def run_directory(cfg: RunConfig, run_id: int | str) -> Path:
    """``<output-dir>/<run-name>``; the default name is ``<task>-<algorithm>-<UTC time>-<run id>``."""
    task = re.sub(r"[^A-Za-z0-9._-]+", "-", cfg.task.rsplit("/", 1)[-1])  # a user's "/path/mytask.py:make_task"
    name = cfg.run_name or f"{task}-{cfg.algorithm}-{datetime.now(UTC):%Y%m%d-%H%M%S}-{run_id}"
    return Path(cfg.output_dir).expanduser().resolve() / name


def _results_in(directory: Path) -> list[str]:
    """The run files ``directory`` holds (none if it does not exist)."""
    return [name for name in RESULT_FILES if (directory / name).exists()]


def check_run_directory(cfg: RunConfig) -> None:
    """A named run never overwrites another run's results: `ConfigError` before anything starts.

    ``run-name`` names a folder that already holds a run's files (``metrics.csv``, ``config.json``, ...) and
    ``resume`` is false: refused, naming the folder (continue it with ``resume=true``, or pick a new name). A
    default, timestamped name never collides: `dpfedavg.server.session.RunSession` appends ``-2``, ``-3``, ... instead.
    """
    if not cfg.run_name or cfg.resume:
        return
    directory = Path(cfg.output_dir).expanduser().resolve() / cfg.run_name
    found = _results_in(directory)
    if found:
        raise ConfigError(
            f"invalid run config: 'run-name' = {cfg.run_name!r}: {directory} holds the results of an earlier run "
            f"({', '.join(found)}) and a run never overwrites another; pass resume=true to continue that run from "
            "its checkpoint, or choose a new run-name"
        )


def check_output_dir(output_dir: str, run_name: str = "") -> None:
    """The run can write its results under ``output_dir``: one ``ConfigError`` before any expensive start-up.

    The nearest folder of ``<output-dir>/<run-name>`` that exists must be a folder this process can write in
    (checked by creating and removing a file there, so read-only file systems and permissions both count); the
    folders below it are created by the run. Nothing is left behind.
    """
    target = (Path(output_dir).expanduser() / run_name).absolute()
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    prefix = f"invalid run config: 'output-dir' = {output_dir!r}"
    allowed = "allowed: a folder this process can create and write in (or pass another output-dir)"
    if not existing.is_dir():
        raise ConfigError(f"{prefix}: {existing} is not a folder, so {target} cannot be created; {allowed}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".dpfedavg-write-check-", dir=existing)
    except OSError as err:
        raise ConfigError(
            f"{prefix}: cannot write in {existing} ({type(err).__name__}: {err.strerror or err}); {allowed}"
        ) from None
    os.close(fd)
    os.unlink(probe)


def write_config_json(path: Path, payload: Mapping[str, Any]) -> None:
    """``config.json``'s format (indented, sorted keys), written atomically."""
    atomic_write_bytes(path, json.dumps(payload, indent=2, sort_keys=True, default=str).encode())


class RunRecorder:
    """Writes one run's results under ``directory``.

    ``metrics.csv`` gets one row per round, appended as one write that is undone if it fails
    (`dpfedavg.io.atomic.append_bytes()`), so a run that dies or fills the disk leaves the rounds it
    finished, every row complete; the other files are replaced atomically.
    """

    def __init__(self, directory: Path, columns: Sequence[str], keep_rounds_through: int | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.columns = tuple(columns)
        #: rows kept for flush_rows() (hold_rows()); None: written at once. Tuples of strings: the garbage collector
        #: stops tracking them, so a batch's held rows do not lengthen its collections.
        self._held: list[tuple[Any, ...]] | None = None
        self.metrics_path = self.directory / "metrics.csv"
        self.config_path = self.directory / "config.json"
        self.model_path = self.directory / "model.npz"
        kept: list[list[str]] = []
        if keep_rounds_through is not None and self.metrics_path.exists():
            # a resumed run: keep the rows up to the checkpoint's round (later ones are redone)
            rows = complete_rows(self.metrics_path)
            if rows and tuple(rows[0]) == self.columns:
                kept = [row for row in rows[1:] if row and int(row[0]) <= keep_rounds_through]
        buf = io.StringIO()
        csv.writer(buf).writerows([self.columns, *kept])
        atomic_write_bytes(self.metrics_path, buf.getvalue().encode())

    def write_config(self, payload: Mapping[str, Any]) -> None:
        write_config_json(self.config_path, payload)

    def write_values(self, values: Sequence[Any]) -> None:
        """Append the round's row, its values in column order, to ``metrics.csv`` (or keep it for `flush_rows()`
        while rows are held). A float is written as its ``repr`` (every bit), NaN as an empty cell."""
        if len(values) != len(self.columns):
            raise ValueError(f"metrics row has {len(values)} values, metrics.csv {len(self.columns)} columns")
        # NaN is the one float unequal to itself: an empty cell
        values = tuple([(repr(v) if v == v else "") if isinstance(v, float) else v for v in values])
        if self._held is not None:
            self._held.append(values)
            return
        buf = io.StringIO()
        csv.writer(buf).writerow(values)
        append_bytes(self.metrics_path, buf.getvalue().encode())

    def hold_rows(self) -> None:
        """Keep the rows `write_values()` gets in memory until `flush_rows()`, which appends them in one write.

        For a sweep's batch (`dpfedavg.engines.batched_runs`): thousands of rows a second, one file open each,
        and a cell that stops early is rerun whole, so its rows need not reach the disk one by one. The file's
        bytes are the same as row by row.
        """
        if self._held is None:
            self._held = []

    def flush_rows(self) -> None:
        """Append the held rows to ``metrics.csv`` in one write (nothing when none are held)."""
        held = self._held
        if not held:
            return
        buf = io.StringIO()
        csv.writer(buf).writerows(held)
        append_bytes(self.metrics_path, buf.getvalue().encode())
        held.clear()

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

            from dpfedavg.io.log_axis import plain_log_labels
        except ImportError:
            logger.info("metrics.png not written: matplotlib is not installed (pip install matplotlib)")
            return None
        header, *lines = complete_rows(self.metrics_path) or [[]]
        rows = [dict(zip(header, line, strict=True)) for line in lines]
        pts = [(int(r["round"]), float(r[headline])) for r in rows if r.get(headline, "") not in ("", None)]
        eps = [(int(r["round"]), float(r["epsilon"])) for r in rows if r.get("epsilon", "") not in ("", "inf")]
        fig, ax = plt.subplots(figsize=(6.4, 3.6), constrained_layout=True)
        if pts:
            ax.plot(*zip(*pts, strict=True), color="tab:blue", marker="." if len(pts) < 40 else None)
            values = [v for _, v in pts]
            if min(values) > 0 and max(values) / min(values) > 10:  # e.g. a suboptimality over decades
                ax.set_yscale("log")
                plain_log_labels(ax)
        ax.set_xlabel("round k")
        ax.set_ylabel(headline if headline in self.columns else f"{headline} (not computed)", color="tab:blue")
        if eps:
            twin = ax.twinx()
            twin.plot(*zip(*eps, strict=True), color="tab:red", linestyle="--", marker="o" if len(eps) < 40 else None)
            twin.set_ylabel("epsilon spent", color="tab:red")
            twin.set_ylim(bottom=0)
        ax.set_title(title, fontsize=9)
        path = self.directory / "metrics.png"
        buf = io.BytesIO()
        fig.savefig(buf, dpi=110, format="png")
        plt.close(fig)
        atomic_write_bytes(path, buf.getvalue())
        return path

    def write_model(self, **arrays: np.ndarray | int | float) -> None:
        buf = io.BytesIO()
        np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items()})
        atomic_write_bytes(self.model_path, buf.getvalue())

    def write_array(self, name: str, array: np.ndarray) -> None:
        """``<name>`` (``.npy``) written atomically (the trajectory)."""
        buf = io.BytesIO()
        np.save(buf, array)
        atomic_write_bytes(self.directory / name, buf.getvalue())
