"""Run a grid of configured runs ("cells"): parallel, resumable, deterministic, with a progress bar.

Every cell is one :class:`~dpfedavg.config.RunConfig` whose results go to
``<out>/runs/<cell key>/``. A cell whose ``config.json`` holds a final summary
for the same run config is done and is skipped, so a killed sweep continues
where it stopped and a finished one reruns nothing. Results depend only on
the cell's config (every random stream derives from its ``seed``), so the
order and parallelism of execution do not matter.

Cells run in this process (``jobs = 1``), in ``jobs`` local processes, or as
tasks on a Ray cluster (``ray_address``): there each cell runs in a temporary
folder of whichever node Ray picks and its result files come back to the
driver as bytes, so the nodes need no shared file system; the driver writes
them to ``<out>/runs/<cell key>/`` as a local run would have.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import socket
import tempfile
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from dpfedavg.config import RunConfig

__all__ = ["Cell", "SweepError", "cell_done", "check_ray_address", "run_cells"]

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


def set_aside_incomplete(cell: Cell) -> Path | None:
    """Move the folder of a cell that did not finish to ``<key>.incomplete-<n>`` (first free ``n``), so that its rerun
    starts in an empty folder and nothing of the earlier attempt is lost (a run never overwrites another's results)."""
    directory = cell.directory
    if not directory.exists() or not any(directory.iterdir()):
        return None
    n = 1
    while (target := directory.with_name(f"{directory.name}.incomplete-{n}")).exists():
        n += 1
    directory.rename(target)
    logger.warning("cell %s did not finish earlier: its files are kept in %s and the cell runs again", cell.key, target)
    return target


def _quiet_worker() -> None:
    logging.getLogger("dpfedavg").setLevel(logging.WARNING)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")  # the cells are the parallelism


def _run_batched_cell(cfg: RunConfig) -> str:
    from dpfedavg.engines.batched import run_batched

    return str(run_batched(cfg, threads=1).directory)  # the sweep runs cells in parallel processes instead


#: Where a cell ran on a Ray cluster (node id, host, pid, seconds): written beside its results.
RAY_TASK_FILE = "ray_task.json"
#: How often Ray reruns a cell whose node or worker process died (a cell's own exception is not retried).
RAY_MAX_RETRIES = 3


def check_ray_address(address: str, timeout: float = 5.0) -> str:
    """Check that ray imports and ``address`` answers, cheaply, before any work starts.

    ``address`` is ``host:port`` of the head node's GCS (``ray start --head --port``),
    ``ray://host:port`` (Ray Client) or ``auto`` (``RAY_ADDRESS``, else the cluster
    that ``ray start`` last started on this machine). Returns the address to pass
    to ``ray.init``; raises :class:`SweepError` with one line saying what is wrong.
    """
    try:
        import ray  # noqa: F401
    except ImportError as err:
        raise SweepError(
            f"--ray-address needs ray, which does not import here ({err}); "
            "install it with: pip install 'ray[default]' (flwr[simulation] brings it)"
        ) from None
    if address == "auto":
        from ray._private.services import get_ray_address_from_environment

        try:
            found = get_ray_address_from_environment("auto", None)
        except ConnectionError:
            found = None
        if not found:
            raise SweepError(
                "--ray-address auto: no running Ray cluster found (RAY_ADDRESS is unset and `ray start` "
                "started none on this machine); pass the head's HOST:PORT"
            )
        address = found
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise SweepError(f"--ray-address = {address!r}: expected HOST:PORT, ray://HOST:PORT or auto")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as err:
        raise SweepError(
            f"--ray-address {address}: nothing answers there ({err}); start the head with "
            f"`ray start --head --port {port}` or pass the address `ray start` printed"
        ) from None
    return address


def _ray_cell(values: dict) -> dict:
    """A Ray task: run one cell in a temporary folder on this node; return its files as bytes."""
    from dataclasses import replace

    import ray

    from dpfedavg.io.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
    from dpfedavg.io.results import write_config_json

    _quiet_worker()
    t0 = time.monotonic()
    cfg = RunConfig.from_run_config(values)
    with tempfile.TemporaryDirectory(prefix="dpfedavg-cell-") as tmp:
        directory = Path(_run_batched_cell(cfg.replace(output_dir=tmp)))
        # config.json and the checkpoint name the run's output-dir: the driver's, as a local run writes it
        saved = json.loads((directory / "config.json").read_text())
        saved["run_config"]["output-dir"] = values["output-dir"]
        write_config_json(directory / "config.json", saved)
        if (directory / CHECKPOINT_FILE).exists():
            ckpt = load_checkpoint(directory)
            save_checkpoint(
                directory, replace(ckpt, run_config={**ckpt.run_config, "output-dir": values["output-dir"]})
            )
        files = {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}
    where = {
        "node_id": ray.get_runtime_context().get_node_id(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "seconds": time.monotonic() - t0,
    }
    return {"files": files, "where": where}


def _write_cell_files(cell: Cell, result: dict) -> None:
    """Write a Ray cell's files; config.json last, so a cell counts as done only when all its files are there."""
    from dpfedavg.io.atomic import atomic_write_bytes

    directory = cell.directory
    directory.mkdir(parents=True, exist_ok=True)
    files = result["files"]
    for name in sorted(files, key=lambda n: n == "config.json"):
        atomic_write_bytes(directory / name, files[name])
    atomic_write_bytes(directory / RAY_TASK_FILE, (json.dumps(result["where"], indent=2) + "\n").encode())


def _run_cells_ray(todo: Sequence[Cell], address: str, bar, failures: dict[str, str]) -> None:
    import ray

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # Ray's tip about accelerator env vars (no GPU is asked)
        ray.init(
            address=address,
            # the driver's dpfedavg goes to every node with the tasks: the nodes run this exact code
            runtime_env={"py_modules": [str(Path(__file__).resolve().parent)]},
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    try:
        run = ray.remote(num_cpus=1, max_retries=RAY_MAX_RETRIES)(_ray_cell)
        pending = {}
        for cell in todo:
            values = cell.cfg.to_run_config()
            pending[run.remote(values)] = cell
        while pending:
            # a timeout, so that Ctrl-C reaches Python between waits (a blocking wait ignores it)
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0.5)
            for ref in ready:
                cell = pending.pop(ref)
                try:
                    _write_cell_files(cell, ray.get(ref))
                except Exception as err:  # noqa: BLE001 - reported per cell
                    failures[cell.key] = f"{type(err).__name__}: {str(err).strip().splitlines()[-1]}"
                bar.update()
    finally:
        ray.shutdown()


def run_cells(
    cells: Sequence[Cell],
    *,
    engine: str = "batched",
    jobs: int = 1,
    progress: bool = True,
    desc: str = "cells",
    ray_address: str | None = None,
) -> list[Path]:
    """Run the cells that are not done yet; returns every cell's run directory.

    With ``ray_address`` (see :func:`check_ray_address`) the batched cells run as
    Ray tasks on that cluster, one CPU each (``jobs`` is then unused); a task
    whose node dies is rerun elsewhere up to :data:`RAY_MAX_RETRIES` times.

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
    for cell in todo:
        set_aside_incomplete(cell)
    failures: dict[str, str] = {}
    bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc=desc, unit="cell", disable=not progress)
    if ray_address is not None and engine != "batched":
        raise ValueError(f"a Ray cluster runs batched cells only, not engine {engine!r}")
    if engine == "batched" and ray_address is not None and todo:
        _run_cells_ray(todo, check_ray_address(ray_address), bar, failures)
    elif engine == "batched" and jobs > 1 and len(todo) > 1:
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
