"""The Task protocol: an objective, its data and its metrics, independent of the strategy."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from dpfedavg.core.types import GradFn, Vector

__all__ = ["Task"]


@runtime_checkable
class Task(Protocol):
    """What the strategy and the clients need from a task.

    A task is built from the validated :class:`~dpfedavg.config.RunConfig`
    (``Task(cfg)``) and must be deterministic in ``cfg.seed``: the server and
    every client rebuild the same task independently. Building a task must be
    cheap; anything heavy belongs in :meth:`client_grad_fn` (one client) or
    :meth:`evaluate` (server only), computed lazily.
    """

    name: str
    num_clients: int
    dim: int
    #: Names of the server-side metrics returned by :meth:`evaluate` (CSV columns).
    metric_names: tuple[str, ...]
    #: The metric the run summary reports, averaged over the last 5 evaluated rounds.
    headline_metric: str
    #: The metrics computed from the clients' private data (not a public test set). No accountant covers
    #: them: a run with ``secure-noise = true`` does not compute them, seeded runs mark them non-private.
    #: Optional; a task without the attribute declares none.
    training_data_metrics: tuple[str, ...]

    def initial_weights(self) -> Vector:
        """``w_0`` as a flat float vector of length ``dim``."""

    def client_grad_fn(self, client_id: int) -> GradFn:
        """The full-batch gradient of ``f_i`` for client ``i``; builds only that client's data."""

    def client_batch_grad_fn(self, client_ids: np.ndarray) -> GradFn:
        """Batched gradients for the batched engine: maps ``W`` of shape ``(B, dim)`` to ``(B, dim)``.

        Optional: without it the batched engine stacks :meth:`client_grad_fn`.
        """

    # Optional, for speed: ``client_batch_update_fn(client_ids) -> BatchUpdateFn``, the
    # client updates ``u`` of E local steps from the shared ``w_k`` in closed form (or vmapped, the
    # torch tasks); it must equal :func:`dpfedavg.core.client_update` on :meth:`client_batch_grad_fn` (tested).
    #
    # Optional, for local steps that depend on the round (the torch tasks' mini-batches):
    # ``client_round_grad_fn(client_id, server_round) -> GradFn``. When a task has it, the ClientApp and
    # the batched engine call it instead of :meth:`client_grad_fn`, and call
    # ``client_batch_update_fn(client_ids, server_round=k)``.

    def evaluate(self, w: Vector) -> dict[str, float]:
        """Server-side metrics of the global model ``w`` (keys: :attr:`metric_names`)."""
