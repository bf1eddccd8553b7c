"""The Python entry point: ``run(config, task=...)`` trains with the batched engine and returns the result.

From a notebook or a script::

    from dpfedavg import RunConfig, run
    result = run(RunConfig(algorithm="norm", epsilon=5.0, num_rounds=50), progress=False)
    result.weights, result.random_iterate, result.epsilon, result.history, result.directory

``task=`` takes a `Task` (for instance a `TorchTask` around
your own ``nn.Module``) or a factory ``factory(cfg) -> Task``; without it the task ``config.task`` names
is built. The run writes the same files as ``python -m dpfedavg`` and ``flwr run``
(``metrics.csv``, ``config.json``, ``model.npz``, ``metrics.png`` with matplotlib) and gives the same
trajectory for the same seed.

A finished run's folder loads back with ``load_run(path)``, and its model into your own module with
``load_into``::

    from dpfedavg import load_run
    result = load_run("outputs/my-run")        # model.npz, config.json, metrics.csv
    model = result.load_into(MyNet())          # w_K in MyNet's parameters (the architecture the run trained)
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dpfedavg.config import RunConfig
from dpfedavg.server.session import RunResult
from dpfedavg.tasks.base import Task

__all__ = ["load_run", "run"]

logger = logging.getLogger(__name__)


def run(
    config: RunConfig | None = None,
    *,
    task: Task | Callable[[RunConfig], Task] | None = None,
    progress: bool = True,
    **overrides: Any,
) -> RunResult:
    """Train ``config`` (DP-FedAvg / DP-NormFedAvg, Alg. 1 / Alg. 2) with the batched engine.

    Parameters
    ----------
    config:
        The run's configuration (default: `RunConfig`'s defaults, the paper's
        §4.4 quadratic with DP-NormFedAvg).
    task:
        A Task, or a factory called with the config; ``None`` builds the task ``config.task`` names.
        With a task object, the run records its ``name`` as the config's ``task``.
    progress:
        Show a progress bar over the rounds.
    **overrides:
        Fields to change in ``config`` (snake_case, e.g. ``num_rounds=50``), validated like the config.

    Returns
    -------
    RunResult
        ``weights`` (``w_K``), ``random_iterate`` (``w_{k~}``, Alg. 1 line 13), ``epsilon`` and ``delta``,
        ``guarantee``, ``history`` (``metrics.csv``'s rows) and ``directory`` (the run's files).

    Raises
    ------
    dpfedavg.config.ConfigError
        A bad key or value, a task that is not one, a privacy budget that cannot hold: before anything
        is written or trained.
    """
    from dpfedavg.engines.batched import run_batched

    cfg = config if config is not None else RunConfig()
    if overrides:
        cfg = cfg.replace(**overrides)
    return run_batched(cfg, task=task, progress=progress, run_id="python")


def load_run(path: str | Path) -> RunResult:
    """A finished run's result from its folder (``model.npz``, ``config.json``, ``metrics.csv``).

    The same ``RunResult`` the run returned: ``weights``, ``random_iterate``, ``epsilon``, ``delta``,
    ``guarantee``, ``history`` and ``directory``; ``result.load_into(module)`` copies the model into a
    ``torch.nn.Module`` of the architecture the run trained.

    Raises
    ------
    FileNotFoundError
        When the folder is not a finished run's: it names the missing file (a run is finished once
        ``config.json`` has its ``final`` summary, written after ``model.npz``).
    """
    from dpfedavg.io.results import read_metrics

    directory = Path(path).expanduser()
    config_path, model_path = directory / "config.json", directory / "model.npz"
    for needed in (config_path, model_path, directory / "metrics.csv"):
        if not needed.is_file():
            raise FileNotFoundError(
                f"{directory} is not a finished run's folder: {needed.name} is missing (a run writes metrics.csv, "
                "model.npz and config.json into <output-dir>/<run-name>)"
            )
    final = json.loads(config_path.read_text()).get("final")
    if final is None:
        raise FileNotFoundError(
            f"{directory}: config.json has no 'final' summary: the run did not finish (resume it with resume=true)"
        )
    with np.load(model_path) as model:
        weights = np.asarray(model["w_final"], dtype=np.float64)
        random_iterate = np.asarray(model["w_random_iterate"], dtype=np.float64)
        random_round = int(model["random_iterate_round"])
    stopped = final.get("stopped_by_budget_before_round")
    return RunResult(
        weights=weights,
        random_iterate=random_iterate,
        random_round=random_round,
        epsilon=float(final.get("epsilon", math.inf)),
        delta=float(final["delta"]),
        guarantee=str(final["guarantee"]),
        history=read_metrics(directory / "metrics.csv"),
        directory=directory,
        stopped_by_budget_before_round=None if stopped is None else int(stopped),
    )
