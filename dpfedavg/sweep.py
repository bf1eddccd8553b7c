"""Run a grid of configured runs ("cells"): parallel, resumable, deterministic, with a progress bar.

Every cell is one :class:`~dpfedavg.config.RunConfig` whose results go to
``<out>/runs/<cell key>/``. A cell whose ``config.json`` holds a final summary
for the same run config is done and is skipped, so a killed sweep continues
where it stopped and a finished one reruns nothing. Results depend only on
the cell's config (every random stream derives from its ``seed``), so the
order and parallelism of execution do not matter.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import tempfile
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from dpfedavg.config import RunConfig

__all__ = ["Cell", "SweepError", "cell_done", "run_cells"]

logger = logging.getLogger(__name__)


class SweepError(RuntimeError):
    """Some cells of a sweep failed; the others finished and are kept."""


@dataclass(frozen=True)
class Cell:
    """One run of a sweep: its key (folder name) and its config."""

    key: str
    cfg: RunConfig

    @property
    def directory(self) -> Path:
        return Path(self.cfg.output_dir) / self.cfg.run_name


def make_cell(out: Path, key: str, values: dict) -> Cell:
    """A cell whose results go to ``<out>/runs/<key>`` (validates ``values``)."""
    cfg = RunConfig.from_run_config({**values, "output-dir": str(Path(out) / "runs"), "run-name": key})
    return Cell(key, cfg)


def cell_done(cell: Cell) -> bool:
    """True when the cell finished earlier with the same run config."""
    path = cell.directory / "config.json"
    if not path.exists():
        return False
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return "final" in saved and saved.get("run_config") == json.loads(json.dumps(cell.cfg.to_run_config()))


def _quiet_worker() -> None:
    logging.getLogger("dpfedavg").setLevel(logging.WARNING)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")  # the cells are the parallelism


def _run_batched_cell(cfg: RunConfig) -> str:
    from dpfedavg.engines.batched import run_batched

    return str(run_batched(cfg, threads=1))  # the sweep runs cells in parallel processes instead


def run_cells(
    cells: Sequence[Cell], *, engine: str = "batched", jobs: int = 1, progress: bool = True, desc: str = "cells"
) -> list[Path]:
    """Run the cells that are not done yet; returns every cell's run directory.

    Raises
    ------
    SweepError
        After all other cells finished, if any cell failed (its error is named).
    """
    from tqdm.auto import tqdm

    keys = [c.key for c in cells]
    if len(set(keys)) != len(keys):
        raise ValueError("cell keys must be unique")
    todo = [c for c in cells if not cell_done(c)]
    if len(todo) < len(cells):
        logger.info("%d of %d cells already done (resuming)", len(cells) - len(todo), len(cells))
    failures: dict[str, str] = {}
    bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc=desc, unit="cell", disable=not progress)
    if engine == "batched" and jobs > 1 and len(todo) > 1:
        context = multiprocessing.get_context("spawn")  # no fork of a process with BLAS threads
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_quiet_worker) as pool:
            futures = {pool.submit(_run_batched_cell, c.cfg): c for c in todo}
            for future in as_completed(futures):
                cell = futures[future]
                try:
                    future.result()
                except Exception as err:  # noqa: BLE001 - reported per cell below
                    failures[cell.key] = f"{type(err).__name__}: {err}"
                bar.update()
    elif engine == "batched":
        for cell in todo:
            try:
                _run_batched_cell(cell.cfg)
            except Exception as err:  # noqa: BLE001
                failures[cell.key] = f"{type(err).__name__}: {err}"
            bar.update()
    elif engine == "flower":
        from dpfedavg.engines.flower import run_flower
        from dpfedavg.engines.local_superlink import LocalSuperLink

        if todo:
            with tempfile.TemporaryDirectory(prefix="dpfedavg-sweep-") as tmp:
                with LocalSuperLink(Path(tmp)) as link:
                    for cell in todo:
                        try:
                            run_flower(cell.cfg, link, num_cpus=1)
                        except Exception as err:  # noqa: BLE001
                            failures[cell.key] = f"{type(err).__name__}: {err}"
                        bar.update()
    else:
        raise ValueError(f"unknown engine {engine!r}; allowed: 'batched', 'flower'")
    bar.close()
    if failures:
        lines = "; ".join(f"{k}: {v}" for k, v in sorted(failures.items())[:5])
        raise SweepError(f"{len(failures)} of {len(cells)} cells failed ({lines}); rerun to retry only those")
    return [c.directory for c in cells]
