"""Run a grid of configured runs ("cells"): parallel, resumable, deterministic, with a progress bar.

Every cell is one `RunConfig` whose results go to
``<out>/runs/<cell key>/``. A cell whose ``config.json`` holds a final summary
for the same run config is done and is skipped, so a killed sweep continues
where it stopped and a finished one reruns nothing. Results depend only on
the cell's config (every random stream derives from its ``seed``), so the
order and parallelism of execution do not matter.

With the batched engine, cells that differ only in what a run axis can hold (``C``, ``eta``, ``beta``,
``mu``, ``z``, the initialization, the algorithm, ...) run together as batches
(`dpfedavg.engines.batched_runs`, cut by `dpfedavg.engines.batch_plan.plan_batches()` within a
memory budget); a cell that cannot join a batch runs alone, and the sweep logs why. A batch that
fails is rerun cell by cell, so one bad cell fails alone.

Units of work (batches, lone cells) run in this process (``jobs = 1``), in ``jobs`` local processes, or as
tasks on a Ray cluster (``ray_address``): there each unit runs in a temporary
folder of whichever node Ray picks and its cells' result files come back to the
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
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from dpfedavg.config import RunConfig

__all__ = ["Cell", "RunOptions", "SweepError", "cell_done", "check_ray_address", "plan_units", "run_cells"]

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


class RunOptions(TypedDict, total=False):
    """How a grid's cells run: `run_cells()`'s keywords but ``desc`` (a missing one takes its default there).

    The experiments (`run_synthetic()`, `run_table1()`, `run_private_tuning()`) take them as keywords and
    pass them on to `run_cells()` unchanged.
    """

    engine: str
    jobs: int
    progress: bool
    ray_address: str | None
    max_batch_memory: int | None


def split_run_options(kwargs: Mapping[str, Any], allowed: Sequence[str] = ()) -> tuple[RunOptions, dict[str, Any]]:
    """``kwargs`` split into the `RunOptions` and the rest, which may hold only ``allowed`` keys.

    Raises
    ------
    TypeError
        Before anything runs, naming a key that is neither a run option nor allowed.
    """
    keys = tuple(RunOptions.__annotations__)
    unknown = [k for k in kwargs if k not in keys and k not in allowed]
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}: expected one of "
            f"{', '.join((*allowed, *keys))}"
        )
    options: RunOptions = {k: v for k, v in kwargs.items() if k in keys}  # type: ignore[assignment]
    return options, {k: v for k, v in kwargs.items() if k not in keys}


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
    return _set_aside(cell.directory, cell.key)


def _set_aside(directory: Path, key: str) -> Path | None:
    if not directory.exists() or not any(directory.iterdir()):
        return None
    n = 1
    while (target := directory.with_name(f"{directory.name}.incomplete-{n}")).exists():
        n += 1
    directory.rename(target)
    logger.warning("cell %s did not finish earlier: its files are kept in %s and the cell runs again", key, target)
    return target


def _quiet_worker() -> None:
    logging.getLogger("dpfedavg").setLevel(logging.WARNING)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")  # the cells are the parallelism


def _run_batched_cell(cfg: RunConfig) -> str:
    from dpfedavg.engines.batched import run_batched

    return str(run_batched(cfg, threads=1).directory)  # the sweep runs cells in parallel processes instead


def _run_unit(cfgs: Sequence[RunConfig], batched: bool, progress: bool = False) -> dict[str, str]:
    """One unit of work: a batch (`run_batch()`) or cells alone.

    Returns ``run-name -> error`` (``""`` for a cell that finished). A batch that raises is rerun cell
    by cell (logged), so that only a cell that fails alone is reported.
    """
    if batched:
        from dpfedavg.engines.batched_runs import run_batch

        try:
            run_batch(cfgs, progress=progress)
            return {cfg.run_name: "" for cfg in cfgs}
        except Exception as err:  # noqa: BLE001 - retried cell by cell below
            logger.warning(
                "a batch of %d cells failed (%s: %s); running them one at a time", len(cfgs), type(err).__name__, err
            )
        for cfg in cfgs:  # what the failed batch wrote is kept beside the rerun
            if cfg.run_name:  # a sweep's cells are always named (the cell key)
                _set_aside(Path(cfg.output_dir) / cfg.run_name, cfg.run_name)
    errors = {}
    for cfg in cfgs:
        try:
            _run_batched_cell(cfg)
            errors[cfg.run_name] = ""
        except Exception as err:  # noqa: BLE001 - reported per cell
            errors[cfg.run_name] = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err) else ''}"
    return errors


#: Where a cell ran on a Ray cluster (node id, host, pid, seconds): written beside its results.
RAY_TASK_FILE = "ray_task.json"
#: How often Ray reruns a cell whose node or worker process died (a cell's own exception is not retried).
RAY_MAX_RETRIES = 3


def check_ray_address(address: str, timeout: float = 5.0) -> str:
    """Check that ray imports and ``address`` answers, cheaply, before any work starts.

    ``address`` is ``host:port`` of the head node's GCS (``ray start --head --port``),
    ``ray://host:port`` (Ray Client) or ``auto`` (``RAY_ADDRESS``, else the cluster
    that ``ray start`` last started on this machine). Returns the address to pass
    to ``ray.init``; raises `SweepError` with one line saying what is wrong.
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


def _ray_cells(values: list[dict], batched: bool) -> list[dict]:
    """A Ray task: run a unit of cells (a batch, or cells alone) in a temporary folder on this node.

    Returns, per cell, its files as bytes (or its error) and where it ran.
    """
    from dataclasses import replace

    import ray

    from dpfedavg.io.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
    from dpfedavg.io.results import write_config_json

    _quiet_worker()
    t0 = time.monotonic()
    out = []
    with tempfile.TemporaryDirectory(prefix="dpfedavg-cells-") as tmp:
        cfgs = [RunConfig.from_run_config(v).replace(output_dir=tmp) for v in values]
        errors = _run_unit(cfgs, batched)
        where = {
            "node_id": ray.get_runtime_context().get_node_id(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "seconds": time.monotonic() - t0,
            "batch_size": len(cfgs),
        }
        for cfg, v in zip(cfgs, values, strict=True):
            if errors[cfg.run_name]:
                out.append({"error": errors[cfg.run_name], "where": where})
                continue
            directory = Path(tmp) / cfg.run_name
            # config.json and the checkpoint name the run's output-dir: the driver's, as a local run writes it
            saved = json.loads((directory / "config.json").read_text())
            saved["run_config"]["output-dir"] = v["output-dir"]
            write_config_json(directory / "config.json", saved)
            if (directory / CHECKPOINT_FILE).exists():
                ckpt = load_checkpoint(directory)
                save_checkpoint(directory, replace(ckpt, run_config={**ckpt.run_config, "output-dir": v["output-dir"]}))
            files = {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}
            out.append({"files": files, "where": where})
    return out


def _write_cell_files(cell: Cell, result: dict) -> None:
    """Write a Ray cell's files; config.json last, so a cell counts as done only when all its files are there."""
    from dpfedavg.io.atomic import atomic_write_bytes

    directory = cell.directory
    directory.mkdir(parents=True, exist_ok=True)
    files = result["files"]
    for name in sorted(files, key=lambda n: n == "config.json"):
        atomic_write_bytes(directory / name, files[name])
    atomic_write_bytes(directory / RAY_TASK_FILE, (json.dumps(result["where"], indent=2) + "\n").encode())


def _nodes_in_turn(ray: Any) -> Callable[[int], Any]:
    """Batch ``i``'s scheduling: the cluster's alive nodes in turn, each as often as it has CPUs, softly.

    Ray's default packs a busy head node first, and ``SPREAD`` is best effort: short batches submitted together
    could all run on the node that freed up first. Each batch goes to the next of the nodes' CPU slots instead,
    taken one node after the other (by node id: two nodes of 1 and 3 CPUs give ``a, b, b, b``; of 2 and 2,
    ``a, b, a, b``); ``soft``: if that node is gone (or dies before the batch runs), Ray runs the batch on another.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cpus = {n["NodeID"]: int(n.get("Resources", {}).get("CPU", 0)) for n in ray.nodes() if n.get("Alive")}
    slots: list[str] = []
    for turn in range(max(cpus.values(), default=0)):
        slots += [node for node in sorted(cpus) if cpus[node] > turn]
    return lambda i: NodeAffinitySchedulingStrategy(slots[i % len(slots)], soft=True) if slots else "SPREAD"


def _run_cells_ray(units: Sequence[tuple[list[Cell], bool]], address: str, bar, failures: dict[str, str]) -> None:
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
        run = ray.remote(num_cpus=1, max_retries=RAY_MAX_RETRIES)(_ray_cells)
        node_for = _nodes_in_turn(ray)
        pending = {}
        for i, (cells, batched) in enumerate(units):  # one Ray task per batch of cells
            task = run.options(scheduling_strategy=node_for(i))
            pending[task.remote([cell.cfg.to_run_config() for cell in cells], batched)] = cells
        while pending:
            # a timeout, so that Ctrl-C reaches Python between waits (a blocking wait ignores it)
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0.5)
            for ref in ready:
                cells = pending.pop(ref)
                try:
                    results = ray.get(ref)
                except Exception as err:  # noqa: BLE001 - reported per cell
                    message = f"{type(err).__name__}: {str(err).strip().splitlines()[-1]}"
                    results = [{"error": message}] * len(cells)
                for cell, result in zip(cells, results, strict=True):
                    if "error" in result:
                        failures[cell.key] = result["error"]
                    else:
                        _write_cell_files(cell, result)
                bar.update(len(cells))
    finally:
        ray.shutdown()


def plan_units(
    todo: Sequence[Cell], *, jobs: int = 1, max_batch_memory: int | None = None
) -> list[tuple[list[Cell], bool]]:
    """The units of work of ``todo``: ``(cells, batched)``, batches first, then the cells that run alone.

    The batches fit ``max_batch_memory`` bytes each (default: half the available memory over ``jobs``);
    a lone cell's reason is logged.

    Raises
    ------
    dpfedavg.engines.batch_plan.BatchMemoryError
        ``max_batch_memory`` is below one run's need (the message gives the minimum).
    """
    from dpfedavg.engines.batch_plan import default_budget, plan_batches

    strict = max_batch_memory is not None
    budget = max_batch_memory if strict else default_budget(jobs)
    plan = plan_batches(todo, max_memory=budget, strict=strict)
    for cell, reason in plan.alone:
        logger.info("cell %s runs alone (not in a batch): %s", cell.key, reason)
    if plan.batches:
        sizes = [len(b) for b in plan.batches]
        logger.info("%d cells in %d batches (%d to %d runs each)", sum(sizes), len(sizes), min(sizes), max(sizes))
    return [(batch, True) for batch in plan.batches] + [([cell], False) for cell, _ in plan.alone]


def _run_units_in_processes(units: Sequence, jobs: int, done: Callable[[list[Cell], dict[str, str]], None]) -> None:
    """Each unit (a batch, or one cell) in one of ``jobs`` worker processes; ``done(unit, errors)`` as each ends."""
    context = multiprocessing.get_context("spawn")  # no fork of a process with BLAS threads
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_quiet_worker) as pool:
        futures = {pool.submit(_run_unit, [c.cfg for c in unit], batched): unit for unit, batched in units}
        for future in as_completed(futures):
            unit = futures[future]
            try:
                errors = future.result()
            except Exception as err:  # noqa: BLE001 - reported per cell
                errors = {c.cfg.run_name: f"{type(err).__name__}: {err}" for c in unit}
            done(unit, errors)


def _run_cells_flower(todo: Sequence[Cell], bar: Any, failures: dict[str, str]) -> None:
    """Each cell through ``flwr run`` on one private local SuperLink (one cell at a time)."""
    from dpfedavg.engines.flower import run_flower
    from dpfedavg.engines.local_superlink import LocalSuperLink

    if not todo:
        return
    with tempfile.TemporaryDirectory(prefix="dpfedavg-sweep-") as tmp:
        with LocalSuperLink(Path(tmp)) as link:
            for cell in todo:
                try:
                    run_flower(cell.cfg, link, num_cpus=1)
                except Exception as err:  # noqa: BLE001 - reported per cell
                    failures[cell.key] = f"{type(err).__name__}: {err}"
                bar.update()


def run_cells(
    cells: Sequence[Cell],
    *,
    engine: str = "batched",
    jobs: int = 1,
    progress: bool = True,
    desc: str = "cells",
    ray_address: str | None = None,
    max_batch_memory: int | None = None,
) -> list[Path]:
    """Run the cells that are not done yet; returns every cell's run directory.

    With the batched engine the cells run as batches (`plan_units()`; ``max_batch_memory`` bytes
    each at most). With ``ray_address`` (see `check_ray_address()`) each batch runs as a
    Ray task on that cluster, one CPU each (``jobs`` is then unused); a task
    whose node dies is rerun elsewhere up to `RAY_MAX_RETRIES` times.

    Raises
    ------
    SweepError
        After all other cells finished, if any cell failed (its error is named).
    dpfedavg.engines.batch_plan.BatchMemoryError
        Before anything runs, when ``max_batch_memory`` cannot hold one run.
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
    if ray_address is not None and engine != "batched":
        raise ValueError(f"a Ray cluster runs batched cells only, not engine {engine!r}")
    units = plan_units(todo, jobs=jobs, max_batch_memory=max_batch_memory) if engine == "batched" and todo else []
    bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc=desc, unit="run", disable=not progress)

    def done(unit: list[Cell], errors: dict[str, str]) -> None:
        for cell in unit:
            if errors.get(cell.cfg.run_name, "missing"):
                failures[cell.key] = errors.get(cell.cfg.run_name, "no result")
        bar.update(len(unit))

    if engine == "batched" and ray_address is not None and todo:
        _run_cells_ray(units, check_ray_address(ray_address), bar, failures)
    elif engine == "batched" and jobs > 1 and len(units) > 1:
        _run_units_in_processes(units, jobs, done)
    elif engine == "batched":
        for unit, batched in units:
            done(unit, _run_unit([c.cfg for c in unit], batched, progress=progress))
    elif engine == "flower":
        _run_cells_flower(todo, bar, failures)
    else:
        raise ValueError(f"unknown engine {engine!r}; allowed: 'batched', 'flower'")
    bar.close()
    if failures:
        lines = "; ".join(f"{k}: {v}" for k, v in sorted(failures.items())[:5])
        raise SweepError(f"{len(failures)} of {len(cells)} cells failed ({lines}); rerun to retry only those")
    return [c.directory for c in cells]
