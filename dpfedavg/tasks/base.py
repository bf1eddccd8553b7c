"""The Task protocol (an objective, its data and its metrics, independent of the strategy) and its optional hooks.

A task has the members of `Task` (`REQUIRED_MEMBERS`, checked when a user's task is
built) and may have the optional ones `TaskHooks` looks up, once, in one place: the engines
and the ClientApp ask `task_hooks()` for a round's gradients or a block's updates, never the
task itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from dpfedavg.core.types import BatchUpdateFn, GradFn, RunsUpdateFn, Vector

__all__ = ["OPTIONAL_MEMBERS", "REQUIRED_MEMBERS", "Task", "TaskHooks", "runs_step_sizes", "task_hooks"]


class Task(Protocol):
    """What the strategy and the clients need from a task (the required members).

    A task is built from the validated `RunConfig` (``factory(cfg)``) and must
    be deterministic in ``cfg.seed``: the server and every client rebuild the same task independently.
    Building a task must be cheap; anything heavy belongs in `client_grad_fn()` (one client) or
    `evaluate()` (server only), computed lazily. The optional members are `TaskHooks`'.
    """

    name: str
    num_clients: int
    dim: int
    #: Names of the server-side metrics returned by `evaluate()` (CSV columns).
    metric_names: tuple[str, ...]
    #: The metric the run summary reports, averaged over the last 5 evaluated rounds.
    headline_metric: str

    def initial_weights(self) -> Vector:
        """``w_0`` as a flat float vector of length ``dim``."""

    def client_grad_fn(self, client_id: int) -> GradFn:
        """The full-batch gradient of ``f_i`` for client ``i``; builds only that client's data."""

    def evaluate(self, w: Vector) -> dict[str, float]:
        """Server-side metrics of the global model ``w`` (keys: `metric_names`)."""


#: What a task must have: `Task`'s attributes and methods (checked when a user's task is built).
REQUIRED_MEMBERS: tuple[str, ...] = (
    *Task.__annotations__,
    *(name for name in vars(Task) if not name.startswith("_") and callable(vars(Task)[name])),
)


@dataclass(frozen=True)
class TaskHooks:
    """A task's optional members, looked up once (`task_hooks()`).

    Attributes
    ----------
    training_data_metrics:
        ``task.training_data_metrics``: the metrics computed from the clients' private data (not a public
        test set). No accountant covers them: a run with ``secure-noise = true`` does not compute them,
        seeded runs mark them non-private. Default: none.
    batch_grad:
        ``task.client_batch_grad_fn(client_ids) -> GradFn``: gradients of a block of clients, mapping ``W``
        of shape ``(B, dim)`` to ``(B, dim)``. Default: the stacked `Task.client_grad_fn()`.
    batch_update:
        ``task.client_batch_update_fn(client_ids[, server_round=k]) -> BatchUpdateFn``: the updates ``u`` of a
        block of clients after E local steps, in closed form (or vmapped, the torch tasks); it must equal
        `dpfedavg.core.client_update()` on the task's gradients (tested).
    round_grad:
        ``task.client_round_grad_fn(client_id, server_round) -> GradFn``: local steps that depend on the
        round (the torch tasks' mini-batches); used instead of `Task.client_grad_fn()`, and
        ``batch_update`` is then called with ``server_round``.
    runs_update:
        ``task.client_runs_update_fn(client_ids, server_round=k) -> RunsUpdateFn``: the local steps of a
        ``(runs, clients)`` block, for a sweep's batch of runs (`dpfedavg.engines.batched_runs`).
    run_axis_keys:
        ``task.run_axis_keys``: run_config keys the runs of one batch may differ in (e.g. ``init``).
    supports_run_axis, run_axis_limitation:
        Whether this task (as configured) can run on a run axis, and why not.
    evaluate_runs:
        ``task.evaluate_runs(W) -> [metrics]``: the server's evaluation of a ``(runs, d)`` stack in one call.
    parallel_steps:
        The local steps use their own threads (torch): blocks of clients run one at a time.
    batch_shared_bytes:
        Memory a batch's runs share (the task's data), for sizing batches.
    """

    training_data_metrics: tuple[str, ...] = ()
    batch_grad: Callable[[np.ndarray], GradFn] | None = None
    batch_update: Callable[..., BatchUpdateFn] | None = None
    round_grad: Callable[[int, int], GradFn] | None = None
    runs_update: Callable[..., RunsUpdateFn] | None = None
    run_axis_keys: tuple[str, ...] = ()
    supports_run_axis: bool = True
    run_axis_limitation: str = "no run axis for this configuration"
    evaluate_runs: Callable[[np.ndarray], list[dict[str, float]]] | None = None
    parallel_steps: bool = False
    batch_shared_bytes: int = 0

    def grad_fn(self, task: Task, client_id: int, server_round: int) -> GradFn:
        """Client ``i``'s gradient oracle in ``server_round``."""
        if self.round_grad is not None:
            return self.round_grad(client_id, server_round)
        return task.client_grad_fn(client_id)

    def block_grad(self, task: Task, client_ids: np.ndarray, server_round: int) -> GradFn:
        """The gradients of a block of clients in ``server_round``: ``(B, dim) -> (B, dim)``."""
        if self.batch_grad is not None and self.round_grad is None:
            return self.batch_grad(client_ids)
        fns = [self.grad_fn(task, int(i), server_round) for i in client_ids]
        return lambda w: np.stack([fn(row) for fn, row in zip(fns, w, strict=True)])

    def block_update(self, client_ids: np.ndarray, server_round: int) -> BatchUpdateFn | None:
        """The task's closed form of a block's ``client_update`` in ``server_round``, or ``None``."""
        if self.batch_update is None:
            return None
        if self.round_grad is not None:
            return self.batch_update(client_ids, server_round=server_round)
        return self.batch_update(client_ids)


#: The members `TaskHooks` looks up: hook field -> the task's attribute.
OPTIONAL_MEMBERS: dict[str, str] = {
    "training_data_metrics": "training_data_metrics",
    "batch_grad": "client_batch_grad_fn",
    "batch_update": "client_batch_update_fn",
    "round_grad": "client_round_grad_fn",
    "runs_update": "client_runs_update_fn",
    "run_axis_keys": "run_axis_keys",
    "supports_run_axis": "supports_run_axis",
    "run_axis_limitation": "run_axis_limitation",
    "evaluate_runs": "evaluate_runs",
    "parallel_steps": "parallel_steps",
    "batch_shared_bytes": "batch_shared_bytes",
}


def runs_step_sizes(lrs: Any, num_steps: int) -> np.ndarray:
    """A `RunsUpdateFn`'s ``eta_k`` (one per run) as float64 ``(R,)``, once it and ``E`` are checked.

    The local steps of Alg. 1 lines 5-7 need ``E >= 1`` and ``eta_k > 0`` (as `dpfedavg.core.local_steps()`).

    Raises
    ------
    ValueError
        Naming ``E`` or ``eta_k`` when it is out of range.
    """
    lrs = np.asarray(lrs, dtype=np.float64).reshape(-1)
    if num_steps < 1:
        raise ValueError(f"local-steps E must be >= 1, got {num_steps!r}")
    if not np.all(lrs > 0):
        raise ValueError(f"local learning rate eta_k must be > 0, got {lrs!r}")
    return lrs


def task_hooks(task: Task) -> TaskHooks:
    """The optional members of ``task`` (absent ones are ``None``, or ``()`` for the metrics)."""
    found: dict[str, Any] = {
        field: getattr(task, member) for field, member in OPTIONAL_MEMBERS.items() if hasattr(task, member)
    }
    for field in ("training_data_metrics", "run_axis_keys"):
        found[field] = tuple(found.get(field) or ())
    found["batch_shared_bytes"] = int(found.get("batch_shared_bytes") or 0)
    found["parallel_steps"] = bool(found.get("parallel_steps", False))
    found["supports_run_axis"] = bool(found.get("supports_run_axis", True))
    return TaskHooks(**found)
