"""Task registry. Adding a task means adding a module here, nothing in the strategy.

``task`` in the run config is a registered name (:data:`TASKS`) or a task from the user's own code:
``"mypackage.mytask:make_task"`` (a module on ``sys.path`` / ``PYTHONPATH``) or
``"/path/to/mytask.py:make_task"`` (a file), where ``make_task(cfg) -> Task``
(README: "Bring your own model"). Each task module declares its own run_config keys in an
``OPTIONS`` tuple; :func:`task_options` collects them for :mod:`dpfedavg.config`.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dpfedavg.options import ConfigError, Option
from dpfedavg.tasks.base import Task

if TYPE_CHECKING:
    from dpfedavg.config import RunConfig


def _quadratic(cfg: RunConfig) -> Task:
    from dpfedavg.tasks.quadratic import QuadraticTask

    return QuadraticTask(cfg)


def _logistic(cfg: RunConfig) -> Task:
    from dpfedavg.tasks.logistic import LogisticTask

    return LogisticTask(cfg)


def _torch_example(cfg: RunConfig) -> Task:
    from dpfedavg.tasks.torch_examples import EXAMPLES

    return EXAMPLES[cfg.task](cfg)


#: name -> factory(cfg) -> Task. Factories import lazily so that heavy task
#: dependencies are only loaded when that task runs (torch only for CIFAR and the torch tasks).
TASKS: dict[str, Callable[[RunConfig], Task]] = {
    "quadratic": _quadratic,
    "digits": _logistic,
    "fmnist": _logistic,
    "cifar10": _logistic,
    "cifar100": _logistic,
    # torch models (dpfedavg/tasks/torch_examples.py) on the paper's shard split
    "mlp-digits": _torch_example,
    "mlp-fmnist": _torch_example,
    "cnn-fmnist": _torch_example,
    "mlp-cifar10": _torch_example,
    "mlp-cifar100": _torch_example,
}

#: Modules whose ``OPTIONS`` declare task-specific run_config keys (none of them imports torch or config).
OPTION_MODULES: tuple[str, ...] = ("dpfedavg.tasks.quadratic", "dpfedavg.tasks.logistic", "dpfedavg.tasks.torch_task")

#: What :func:`build_task` checks a user's task has (the :class:`Task` protocol's required members).
REQUIRED_MEMBERS: tuple[str, ...] = (
    "name",
    "num_clients",
    "dim",
    "metric_names",
    "headline_metric",
    "initial_weights",
    "client_grad_fn",
    "evaluate",
)


def task_options() -> tuple[Option, ...]:
    """The task-specific run_config keys, in :data:`OPTION_MODULES` order (a key declared twice is an error)."""
    out: dict[str, Option] = {}
    for name in OPTION_MODULES:
        for opt in importlib.import_module(name).OPTIONS:
            if opt.key in out:
                raise AssertionError(f"run_config key {opt.key!r} declared twice (again in {name})")
            out[opt.key] = opt
    return tuple(out.values())


def _module_from_file(path: Path) -> object:
    """Import a ``.py`` file once per process, under a name derived from its absolute path."""
    path = path.expanduser().resolve()
    name = f"_dpfedavg_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_task_factory(spec: str) -> Callable[[RunConfig], Task]:
    """The factory named by ``"module:attr"`` or ``"/path/to/file.py:attr"``; one :class:`ConfigError` if it is not one.

    The module is imported (once per process): from ``sys.path`` (``PYTHONPATH``) for a dotted name,
    from the file for a path ending in ``.py``. ``attr`` may be dotted (``Class.method``).
    """
    where, _, attr = spec.rpartition(":")
    prefix = f"'task' = {spec!r}"
    if not where or not attr:
        raise ConfigError(f"{prefix}: expected 'module:factory' or '/path/to/file.py:factory'")
    try:
        if where.endswith(".py") or "/" in where:
            path = Path(where)
            if not path.expanduser().is_file():
                raise ConfigError(f"{prefix}: no file {str(path)!r} (relative paths are relative to {Path.cwd()})")
            module = _module_from_file(path)
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except ModuleNotFoundError as err:
        raise ConfigError(
            f"{prefix}: cannot import module {where!r} ({err}); put its folder on PYTHONPATH (for flwr run: in the "
            "environment that starts the SuperLink) or give the file, 'task=\"/abs/path/mytask.py:make_task\"'"
        ) from None
    except Exception as err:  # noqa: BLE001 - the user's module failed while importing: say so, in one error
        raise ConfigError(f"{prefix}: importing {where!r} failed: {type(err).__name__}: {err}") from err
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            hint = difflib.get_close_matches(part, names, n=1)
            more = f" (did you mean {hint[0]!r}?)" if hint else ""
            callables = ", ".join(n for n in names if callable(getattr(obj, n, None)))
            raise ConfigError(f"{prefix}: {where!r} has no attribute {part!r}{more}; its callables: {callables}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(
            f"{prefix}: {attr!r} is a {type(obj).__name__}, not a task factory; expected a function (or class) "
            "called as factory(cfg) and returning a Task"
        )
    return obj  # type: ignore[return-value]


def build_task(cfg: RunConfig) -> Task:
    """Build the task named by ``cfg.task`` (a registered name or a user's ``module:factory``)."""
    if cfg.task in TASKS:
        return TASKS[cfg.task](cfg)
    if ":" not in cfg.task:
        allowed = ", ".join(TASKS)
        raise ConfigError(f"invalid run config: 'task' = {cfg.task!r}: allowed: {allowed} or 'module:factory'")
    task = load_task_factory(cfg.task)(cfg)
    missing = [m for m in REQUIRED_MEMBERS if not hasattr(task, m)]
    if missing:
        raise ConfigError(
            f"invalid run config: 'task' = {cfg.task!r} returned a {type(task).__name__}, not a Task: "
            f"it lacks {', '.join(missing)} (see dpfedavg/tasks/base.py; "
            "dpfedavg.tasks.torch_task.TorchTask makes one from a torch model)"
        )
    if task.num_clients != cfg.num_clients:
        raise ConfigError(
            f"invalid run config: 'task' = {cfg.task!r} has num_clients = {task.num_clients}, "
            f"but 'num-clients' = {cfg.num_clients}"
        )
    return task


__all__ = ["OPTION_MODULES", "TASKS", "Task", "build_task", "load_task_factory", "task_options"]
