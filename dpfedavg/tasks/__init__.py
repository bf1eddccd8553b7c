"""Task registry. Adding a task means adding a module here, nothing in the strategy."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from dpfedavg.tasks.base import Task

if TYPE_CHECKING:
    from dpfedavg.config import RunConfig


def _quadratic(cfg: RunConfig) -> Task:
    from dpfedavg.tasks.quadratic import QuadraticTask

    return QuadraticTask(cfg)


def _logistic(cfg: RunConfig) -> Task:
    from dpfedavg.tasks.logistic import LogisticTask

    return LogisticTask(cfg)


#: name -> factory(cfg) -> Task. Factories import lazily so that heavy task
#: dependencies are only loaded when that task runs (torch only for CIFAR).
TASKS: dict[str, Callable[[RunConfig], Task]] = {
    "quadratic": _quadratic,
    "digits": _logistic,
    "fmnist": _logistic,
    "cifar10": _logistic,
    "cifar100": _logistic,
}


def build_task(cfg: RunConfig) -> Task:
    """Build the task named by ``cfg.task``."""
    try:
        factory = TASKS[cfg.task]
    except KeyError:
        raise ValueError(f"unknown task {cfg.task!r}; allowed: {', '.join(TASKS)}") from None
    return factory(cfg)


__all__ = ["TASKS", "Task", "build_task"]
