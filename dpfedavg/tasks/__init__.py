"""Task registry. Adding a task means adding a module here, nothing in the strategy.

``task`` in the run config is a registered name (`TASKS`) or a task from the user's own code:
``"mypackage.mytask:make_task"`` (a module on ``sys.path`` / ``PYTHONPATH``) or
``"/path/to/mytask.py:make_task"`` (a file), where ``make_task(cfg) -> Task``
(the documentation's "Your own model" tutorial). `resolve_task()` checks the name (the config does not: it
imports no task and no user code) and `build_task()` builds the task.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

from dpfedavg.config import ConfigError, RunConfig
from dpfedavg.tasks.base import REQUIRED_MEMBERS, Task, TaskHooks, task_hooks


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


def registered_tasks() -> tuple[str, ...]:
    """The names of the shipped tasks (`TASKS`): what an approved app declares (`dpfedavg.privacy.policy`)."""
    return tuple(TASKS)


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
    """The factory named by ``"module:attr"`` or ``"/path/to/file.py:attr"``; one `ConfigError` if it is not one.

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
        raise ConfigError(f"{prefix}: {attr!r} is a {type(obj).__name__}, not a task factory; {_FACTORY}")
    if inspect.isbuiltin(obj) or not _takes_one_argument(obj):
        kind = "a built-in function" if inspect.isbuiltin(obj) else "a callable that cannot be called with one argument"
        raise ConfigError(f"{prefix}: {attr!r} is {kind}, not a task factory; {_FACTORY}")
    return obj  # type: ignore[return-value]


#: What ``task = "module:factory"`` must name (the end of every error about it).
_FACTORY = (
    "expected a Python function (or class) of your own, called as factory(cfg) with the RunConfig and returning a "
    "Task (docs: tutorials/own-model.md)"
)


def _takes_one_argument(obj: object) -> bool:
    """Whether ``obj(cfg)`` binds (a signature Python cannot read is given the benefit of the doubt)."""
    try:
        inspect.signature(obj).bind(None)  # type: ignore[arg-type]
    except TypeError:
        return False
    except ValueError:
        return True
    return True


#: A task factory: ``factory(cfg) -> Task``.
TaskFactory = Callable[[RunConfig], Task]


def resolve_task(spec: str) -> TaskFactory:
    """The factory ``task`` names: a registered task (`TASKS`) or a user's ``module:factory``.

    Cheap (it imports the user's module, nothing else): call it before any expensive start-up.

    Raises
    ------
    ConfigError
        An unknown name (with a "did you mean"), or a ``module:factory`` that does not load.
    """
    if spec in TASKS:
        return TASKS[spec]
    if ":" in spec:
        return load_task_factory(spec)
    allowed = ", ".join(repr(c) for c in TASKS)
    hint = difflib.get_close_matches(spec, list(TASKS), n=1)
    more = f" (did you mean {hint[0]!r}?)" if hint else ""
    raise ConfigError(
        f"invalid run config: 'task' = {spec!r}: allowed values are {allowed}{more}, "
        "or your own 'module:factory' / '/path/to/file.py:factory' (docs: tutorials/own-model.md)"
    )


def build_task(cfg: RunConfig, task: Task | TaskFactory | None = None) -> Task:
    """The run's task: ``cfg.task`` built (`resolve_task()`), or ``task``: a Task, or a factory called with ``cfg``.

    Raises
    ------
    ConfigError
        An unknown task, an object that lacks a member of `Task`, a task whose
        ``num_clients`` differs from ``num-clients``, or one whose ``check_model()`` fails (`TorchTask`: the
        model's first forward pass).
    """
    what = f"'task' = {cfg.task!r}" if task is None else f"task={task!r}"
    if task is None:
        built = resolve_task(cfg.task)(cfg)
    elif not isinstance(task, type) and all(hasattr(task, m) for m in REQUIRED_MEMBERS):
        built = task  # type: ignore[assignment]
    elif callable(task):
        built = task(cfg)
    else:
        built = task  # type: ignore[assignment]
    missing = [m for m in REQUIRED_MEMBERS if not hasattr(built, m)]
    if missing:
        raise ConfigError(
            f"invalid run config: {what} gave a {type(built).__name__}, not a Task: it lacks {', '.join(missing)} "
            "(see dpfedavg.tasks.base.Task; dpfedavg.TorchTask makes one from a torch model)"
        )
    if built.num_clients != cfg.num_clients:
        raise ConfigError(
            f"invalid run config: {what} has num_clients = {built.num_clients}, but 'num-clients' = {cfg.num_clients}"
        )
    check_model = getattr(built, "check_model", None)
    if callable(check_model):  # a torch model's first forward pass, before any run folder exists
        check_model()
    return built


__all__ = [
    "registered_tasks",
    "TASKS",
    "Task",
    "TaskFactory",
    "TaskHooks",
    "build_task",
    "load_task_factory",
    "resolve_task",
    "task_hooks",
]
