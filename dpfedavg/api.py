"""The Python entry point: ``run(config, task=...)`` trains with the batched engine and returns the result.

From a notebook or a script::

    from dpfedavg import RunConfig, run
    result = run(RunConfig(algorithm="norm", epsilon=5.0, num_rounds=50), progress=False)
    result.weights, result.random_iterate, result.epsilon, result.history, result.directory

``task=`` takes a `Task` (for instance a `TorchTask` around
your own ``nn.Module``) or a factory ``factory(cfg) -> Task``; without it the task ``config.task`` names
is built. The run writes the same files as ``python -m dpfedavg.run`` and ``flwr run``
(``metrics.csv``, ``config.json``, ``model.npz``, ``metrics.png`` with matplotlib) and gives the same
trajectory for the same seed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from dpfedavg.config import RunConfig
from dpfedavg.server.session import RunResult
from dpfedavg.tasks.base import Task

__all__ = ["run"]

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
