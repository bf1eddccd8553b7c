"""Multinomial logistic regression with weight decay on real data (paper §5, Table 1).

``f_i(W, b) = (1/m) sum_j CE(softmax(W^T x_j + b), y_j) + (lambda/2) (||W||^2 + ||b||^2)``
over client ``i``'s ``m`` examples, ``lambda`` = ``weight-decay`` (paper: 1e-4, as
PyTorch's ``weight_decay`` on every parameter). The model is the flat vector
``w = [vec(W), b]`` of length ``d c + c``, starting at zero. Full-batch gradients.

The data (`dpfedavg.tasks.datasets`) is memory-mapped; the paper's shard
split (`dpfedavg.tasks.partition`) is computed once per
``(num-clients, seed)`` and cached beside it, so a client process reads only
its own rows. The server evaluates test accuracy and loss and the training
objective ``f = (1/n) sum_i f_i``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np

from dpfedavg.config import ConfigError, RunConfig
from dpfedavg.core.types import BatchUpdateFn, GradFn, RunsUpdateFn, Vector
from dpfedavg.tasks.base import runs_step_sizes
from dpfedavg.tasks.datasets import DATASETS, PreparedData, locked, prepare_dataset, save_npy
from dpfedavg.tasks.partition import paper_shard_partition

__all__ = ["LogisticTask", "ShardSplit", "softmax_cross_entropy"]

#: Rows per chunk when the server evaluates on a whole split (bounds memory).
EVAL_CHUNK = 8192


def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(per-example CE, softmax probabilities)``, numerically stable."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    total = exp.sum(axis=1, keepdims=True)
    probs = exp / total
    ce = np.log(total[:, 0]) - shifted[np.arange(len(labels)), labels]
    return ce, probs


class _Client:
    """Client ``i``'s objective on its own rows."""

    def __init__(self, x: np.ndarray, y: np.ndarray, num_classes: int, weight_decay: float) -> None:
        self.x = np.ascontiguousarray(x, dtype=np.float32)  # half the memory; products are float64
        self.y = np.asarray(y, dtype=np.int64)
        self.c = num_classes
        self.lam = weight_decay
        self.d = self.x.shape[1]

    def _split(self, w: Vector) -> tuple[np.ndarray, np.ndarray]:
        return w[: self.d * self.c].reshape(self.d, self.c), w[self.d * self.c :]

    def grad(self, w: Vector) -> Vector:
        """``grad f_i(w)``: ``X^T (p - Y) / m + lambda W`` and ``mean(p - Y) + lambda b``."""
        weights, bias = self._split(w)
        _, probs = softmax_cross_entropy(self.x @ weights + bias, self.y)
        probs[np.arange(len(self.y)), self.y] -= 1.0
        probs /= len(self.y)
        g_w = self.x.T @ probs + self.lam * weights
        g_b = probs.sum(axis=0) + self.lam * bias
        return np.concatenate([g_w.ravel(), g_b])

    def loss(self, w: Vector) -> float:
        weights, bias = self._split(w)
        ce, _ = softmax_cross_entropy(self.x @ weights + bias, self.y)
        return float(ce.mean() + 0.5 * self.lam * (w @ w))


class ShardSplit:
    """A prepared dataset (`dpfedavg.tasks.datasets`) and the paper's shard split of it over ``num-clients``.

    Shared by the logistic-regression tasks and the torch examples (`dpfedavg.tasks.torch_examples`).
    """

    def __init__(self, cfg: RunConfig, dataset: str) -> None:
        self.name = dataset
        self.cfg = cfg
        self.num_clients = cfg.num_clients

    @cached_property
    def data(self) -> PreparedData:
        """The prepared, memory-mapped dataset (prepared on first use)."""
        cfg = self.cfg
        return prepare_dataset(
            self.name,
            data_dir=cfg.data_dir or None,
            cache_dir=cfg.cache_dir or None,
            image_size=cfg.feature_image_size,
        )

    @cached_property
    def partition(self) -> np.ndarray:
        """``(n, m)`` training indices per client: the paper's shard split, cached on disk.

        Seeded by ``data-seed`` (``seed`` when it is -1): private tuning keeps the federation fixed
        while every trial draws its own sampling and noise.
        """
        directory: Path = self.data.directory
        seed = self.cfg.data_seed if self.cfg.data_seed >= 0 else self.cfg.seed
        path = directory / f"partition-n{self.num_clients}-seed{seed}.npy"
        if not path.exists():
            with locked(directory / ".partition.lock"):
                if not path.exists():
                    try:
                        split = paper_shard_partition(self.data.train_y, self.num_clients, seed)
                    except ValueError as err:
                        raise ConfigError(f"invalid run config: 'num-clients' = {self.num_clients}: {err}") from None
                    save_npy(path, split)
        return np.load(path, mmap_mode="r")


class LogisticTask:
    """Logistic regression on ``digits``, ``fmnist``, ``cifar10`` or ``cifar100``."""

    metric_names = ("test_accuracy", "test_loss", "train_loss")
    headline_metric = "test_accuracy"
    #: Computed from the clients' private training data: withheld with secure-noise (see Task).
    training_data_metrics = ("train_loss",)

    def __init__(self, cfg: RunConfig) -> None:
        self.name = cfg.task
        self.spec = DATASETS[cfg.task]
        self.split = ShardSplit(cfg, cfg.task)
        self.cfg = cfg
        self.num_clients = cfg.num_clients
        self.num_classes = self.spec.num_classes
        #: Keys that may differ between runs sharing `client_runs_update_fn()`: with a fixed ``data-seed``
        #: (private tuning's trials) the clients' data does not depend on ``seed``.
        self.run_axis_keys: tuple[str, ...] = ("seed",) if cfg.data_seed >= 0 and cfg.backend == "numpy" else ()
        #: A sweep's batch (engines.batched_runs) needs the same local steps as a run alone: the numpy closed form,
        #: or torch's vmapped steps (mini-batches). The torch closed form (full batches) has no run axis.
        self.supports_run_axis = cfg.backend == "numpy" or cfg.local_batch_size > 0
        #: torch's steps run on torch's own threads (the batched engine then computes one block at a time).
        self.parallel_steps = cfg.backend == "torch"
        self.run_axis_limitation = "backend = 'torch' with full batches runs the torch closed form, one run at a time"
        if cfg.backend == "numpy" and cfg.local_batch_size:
            raise ConfigError(
                f"invalid run config: 'local-batch-size' = {cfg.local_batch_size} with 'backend' = 'numpy': the numpy "
                "backend runs full-batch steps (the paper); use backend='torch' for mini-batches, or local-batch-size=0"
            )
        if cfg.backend == "torch":  # fail here (no torch, no CUDA) rather than in the first round
            from dpfedavg.tasks.torch_task import resolve_device

            resolve_device(cfg.device)

    # ------------------------------------------------------------------ data
    @property
    def data(self) -> PreparedData:
        """The prepared, memory-mapped dataset (prepared on first use)."""
        return self.split.data

    @property
    def partition(self) -> np.ndarray:
        """``(n, m)`` training indices per client: the paper's shard split, cached on disk."""
        return self.split.partition

    @property
    def feature_dim(self) -> int:
        return int(self.data.train_x.shape[1])

    @property
    def dim(self) -> int:
        """``d c + c``."""
        return self.feature_dim * self.num_classes + self.num_classes

    def client(self, client_id: int) -> _Client:
        if not 0 <= client_id < self.num_clients:
            raise ValueError(f"client id {client_id} outside [0, {self.num_clients})")
        rows = np.sort(np.asarray(self.partition[client_id]))
        return _Client(self.data.train_x[rows], self.data.train_y[rows], self.num_classes, self.cfg.weight_decay)

    @cached_property
    def torch_task(self):  # -> TorchTask
        """The same objective on torch (``backend = "torch"``): a linear model, same data, same ``w`` layout."""
        from dpfedavg.tasks.torch_task import ShardedClients, TorchTask, linear_softmax_model

        return TorchTask(
            self.cfg,
            model=lambda: linear_softmax_model(self.feature_dim, self.num_classes),
            clients=ShardedClients(lambda: (self.data.train_x, self.data.train_y, self.partition), self.num_clients),
            loss="cross_entropy",
            name=self.name,
        )

    def client_grad_fn(self, client_id: int) -> GradFn:
        if self.cfg.backend == "torch":
            return self.torch_task.client_grad_fn(client_id)
        return self.client(client_id).grad

    def client_round_grad_fn(self, client_id: int, server_round: int) -> GradFn:
        """Client ``i``'s gradient oracle in round ``k`` (mini-batches need the round; torch backend only)."""
        if self.cfg.backend == "torch":
            return self.torch_task.client_round_grad_fn(client_id, server_round)
        return self._cached_grad(client_id)

    @cached_property
    def _cached_grad(self) -> Callable[[int], GradFn]:
        """Each client's numpy gradient, built once (a ClientApp asks for it every round)."""
        return lru_cache(maxsize=4096)(self.client_grad_fn)

    def client_batch_grad_fn(self, client_ids: np.ndarray) -> GradFn:
        """Gradients of several clients at once (every client has the same number of examples)."""
        rows = np.sort(np.asarray(self.partition)[np.asarray(client_ids)], axis=1)
        x = np.asarray(self.data.train_x[rows.ravel()], dtype=np.float64).reshape(len(client_ids), rows.shape[1], -1)
        y = np.asarray(self.data.train_y[rows.ravel()]).reshape(rows.shape)
        d, c, lam, m = self.feature_dim, self.num_classes, self.cfg.weight_decay, rows.shape[1]
        batch_idx, example_idx = np.arange(len(client_ids))[:, None], np.arange(m)[None, :]

        def grad(w: np.ndarray) -> np.ndarray:
            weights, bias = w[:, : d * c].reshape(len(w), d, c), w[:, d * c :]
            logits = np.matmul(x, weights) + bias[:, None, :]
            logits -= logits.max(axis=2, keepdims=True)
            probs = np.exp(logits)
            probs /= probs.sum(axis=2, keepdims=True)
            probs[batch_idx, example_idx, y] -= 1.0
            probs /= m
            g_w = np.matmul(x.transpose(0, 2, 1), probs) + lam * weights
            g_b = probs.sum(axis=1) + lam * bias
            return np.concatenate([g_w.reshape(len(w), -1), g_b], axis=1)

        return grad

    def client_batch_update_fn(self, client_ids: np.ndarray, server_round: int = 0) -> BatchUpdateFn:
        """``u = (w_k - w_{k,E}) / eta_k`` of E local steps for several clients at once, exactly.

        With ``backend = "torch"``: the same closed form in torch (`_torch_closed_form()`), or with
        ``local-batch-size > 0`` the vmapped mini-batch steps of `TorchTask.client_batch_update_fn()`.

        The closed form of `dpfedavg.core.client_update()` on this
        objective (Alg. 1/2 lines 5-9) that the batched engine uses: a gradient
        step moves ``W`` by ``-eta (X^T P_t + lambda W_t)`` with ``P_t`` the
        ``(m, c)`` residuals ``(softmax - onehot)/m``, so after ``t`` steps

            ``W_t = c_t W_k + X^T A_t``,  ``c_t = (1 - eta lambda)^t``,
            ``A_{t+1} = (1 - eta lambda) A_t - eta P_t``,

        and the logits ``X W_t + b_t = c_t (X W_k) + G A_t + b_t`` need only
        the client's ``m x m`` Gram matrix ``G = X X^T``. A step costs
        ``O(m^2 c)`` instead of ``O(m d c)``: ``m = 20 << d = 784`` for FMNIST.
        The same iterates as the step-by-step loop, up to float64 rounding
        (``tests/test_data.py`` checks it against `client_update()`).
        """
        if self.cfg.backend == "torch":
            if self.cfg.local_batch_size > 0:  # mini-batches: the generic vmapped steps of TorchTask
                return self.torch_task.client_batch_update_fn(client_ids, server_round)
            return self._torch_closed_form(client_ids)
        runs_update = self.client_runs_update_fn(client_ids)
        return lambda w, lr, num_steps: runs_update(np.asarray(w)[None, :], np.array([lr]), num_steps)[0]

    def client_runs_update_fn(self, client_ids: np.ndarray, server_round: int = 0) -> RunsUpdateFn:
        """The closed form of `client_batch_update_fn()` for ``R`` runs at once (a sweep's run axis).

        Maps the runs' ``w_k`` (``(R, dim)``) and ``eta_k`` (``(R,)``) to ``u`` of shape ``(R, B, dim)``. The
        runs share the clients' data and Gram matrices; their iterates are laid out as ``(B, m, c, R)``, the
        run last, so that ``X W_k`` is one matrix product for the whole block, ``G_i A_t`` one per client for
        every run at once, and the softmax's reductions over the ``c`` classes run along whole rows of runs.
        With ``backend = "torch"`` and mini-batches: `TorchTask.client_runs_update_fn()` (the steps a run alone
        takes too); the torch closed form has no run axis (`supports_run_axis`).
        """
        if self.cfg.backend != "numpy":
            if not self.supports_run_axis:
                raise NotImplementedError(self.run_axis_limitation)
            return self.torch_task.client_runs_update_fn(client_ids, server_round)
        rows = np.sort(np.asarray(self.partition)[np.asarray(client_ids)], axis=1)
        num, m = rows.shape
        x = np.asarray(self.data.train_x[rows.ravel()], dtype=np.float64).reshape(num, m, -1)
        y = np.asarray(self.data.train_y[rows.ravel()]).reshape(rows.shape)
        gram = np.matmul(x, x.transpose(0, 2, 1))  # (B, m, m)
        d, c, lam = self.feature_dim, self.num_classes, self.cfg.weight_decay
        example, label = np.arange(num * m), y.ravel()  # the one-hot Y as indices
        x_t, x_flat = x.transpose(0, 2, 1), x.reshape(num * m, d)

        def update(w: np.ndarray, lrs: np.ndarray, num_steps: int) -> np.ndarray:
            lrs = runs_step_sizes(lrs, num_steps)
            w = np.atleast_2d(np.asarray(w, dtype=np.float64))
            runs = len(w)
            weights, bias = w[:, : d * c].reshape(runs, d, c), w[:, d * c :]  # (R, d, c), (R, c)
            # X W_k for every client and run: (B, m, c, R)
            stacked = weights.transpose(1, 2, 0).reshape(d, c * runs)
            base_logits = np.matmul(x_flat, stacked).reshape(num, m, c, runs)
            decay = 1.0 - lrs * lam  # (R,)
            # With c_t = decay^t: A_t = c_t A~_t and b_t = c_t b~_t, so one step is
            # A~_{t+1} = A~_t - (eta / c_{t+1}) P_t and the logits are c_t (X W_k + G A~_t + b~_t).
            coef = np.zeros((num, m, c, runs))  # A~_t
            b = np.repeat(bias.T[None], num, axis=0)  # b~_t, (B, c, R)
            scale = np.ones(runs)  # c_t
            logits, probs = np.empty_like(base_logits), np.empty_like(base_logits)
            moved = np.empty((num, m, c * runs))
            for _ in range(num_steps):
                np.add(base_logits, np.matmul(gram, coef.reshape(num, m, c * runs), out=moved).reshape(logits.shape),
                       out=logits)  # fmt: skip
                logits += b[:, None]
                logits *= scale
                np.exp(logits, out=probs)
                total = probs.sum(axis=2, keepdims=True)  # (B, m, 1, R)
                if not np.all(np.isfinite(total) & (total > 0)):  # exp over- or underflowed: shift each row
                    logits -= logits.max(axis=2, keepdims=True)
                    np.exp(logits, out=probs)
                    total = probs.sum(axis=2, keepdims=True)
                scale = scale * decay  # c_{t+1}
                step = lrs / (scale * m)  # eta / (c_{t+1} m)
                probs *= step / total  # (eta / c_{t+1}) softmax / m
                flat = probs.reshape(num * m, c, runs)
                flat[example, label] -= step  # (eta / c_{t+1}) (softmax - Y) / m
                coef -= probs
                b -= probs.sum(axis=1)
            # w_k - w_{k,E} = [(1 - c_E) W_k - c_E X^T A~_E, b_k - c_E b~_E]
            moved_w = np.matmul(x_t, coef.reshape(num, m, c * runs)).reshape(num, d, c, runs)  # X^T A~_E
            delta_w = (1.0 - scale)[:, None, None, None] * weights[:, None] - scale[
                :, None, None, None
            ] * moved_w.transpose(3, 0, 1, 2)
            delta_b = bias[:, None, :] - scale[:, None, None] * b.transpose(2, 0, 1)  # (R, B, c)
            delta = np.concatenate([delta_w.reshape(runs, num, d * c), delta_b], axis=2)
            return delta / lrs[:, None, None]

        return update

    def _torch_closed_form(self, client_ids: np.ndarray) -> BatchUpdateFn:
        """The closed form above (same recursion on ``A_t``, ``b_t``, ``c_t``) in torch: CPU or GPU, ``torch-dtype``.

        Tested equal to the numpy closed form and to `dpfedavg.core.client_update()` on the torch
        backend's autograd gradient (`client_grad_fn()`).
        """
        tt = self.torch_task
        torch = tt.torch
        x_np, y_np, _ = tt.data.block(np.asarray(client_ids))  # rows in ascending order, as above
        x, y = tt._x(x_np), tt._y(y_np)
        gram = torch.matmul(x, x.transpose(1, 2))
        d, c, lam, m, num = self.feature_dim, self.num_classes, self.cfg.weight_decay, x.shape[1], x.shape[0]
        onehot = torch.nn.functional.one_hot(y, c).to(tt.dtype)

        def update(w: Vector, lr: float, num_steps: int) -> np.ndarray:
            if num_steps < 1:
                raise ValueError(f"local-steps E must be >= 1, got {num_steps!r}")
            if not lr > 0:
                raise ValueError(f"local learning rate eta_k must be > 0, got {lr!r}")
            w_t = torch.as_tensor(np.asarray(w, dtype=np.float64), device=tt.device).to(tt.dtype)
            weights, bias = w_t[: d * c].reshape(d, c), w_t[d * c :]
            base_logits = torch.matmul(x, weights)  # X W_k, (B, m, c)
            decay = 1.0 - lr * lam
            coef = torch.zeros((num, m, c), device=tt.device, dtype=tt.dtype)  # A_t
            b = bias.expand(num, c).clone()  # b_t
            scale = 1.0  # c_t
            for _ in range(num_steps):
                logits = scale * base_logits + torch.matmul(gram, coef) + b[:, None, :]
                residual = (torch.softmax(logits, dim=2) - onehot) / m  # P_t
                coef = decay * coef - lr * residual
                b = decay * b - lr * residual.sum(dim=1)
                scale *= decay
            delta_w = (1.0 - scale) * weights[None] - torch.matmul(x.transpose(1, 2), coef)
            delta = torch.cat([delta_w.reshape(num, -1), bias[None, :] - b], dim=1)
            return (delta.to(torch.float64) / lr).cpu().numpy()

        return update

    def initial_weights(self) -> Vector:
        return np.zeros(self.dim)

    # ------------------------------------------------------------ evaluation
    def _scores(
        self, w: np.ndarray, x: np.ndarray, y: np.ndarray, rows: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(mean CE, accuracy)`` of each run (rows of ``w``, ``(R, dim)``) over a split (or its ``rows``).

        In chunks read from the memory map; each chunk's logits for every run come from one product.
        """
        d, c, runs = self.feature_dim, self.num_classes, len(w)
        weights = w[:, : d * c].reshape(runs, d, c).transpose(1, 0, 2).reshape(d, runs * c)  # (d, R c)
        bias = w[:, d * c :]  # (R, c)
        total = len(y) if rows is None else len(rows)
        ce_sum, correct = np.zeros(runs), np.zeros(runs, dtype=np.int64)
        for start in range(0, total, EVAL_CHUNK):
            index = slice(start, start + EVAL_CHUNK) if rows is None else rows[start : start + EVAL_CHUNK]
            xb, yb = np.asarray(x[index], dtype=np.float64), np.asarray(y[index])
            logits = (xb @ weights).reshape(len(yb), runs, c) + bias[None]  # (N, R, c)
            shifted = logits - logits.max(axis=2, keepdims=True)
            picked = np.take_along_axis(shifted, yb[:, None, None], axis=2)[:, :, 0]
            ce_sum += (np.log(np.exp(shifted).sum(axis=2)) - picked).sum(axis=0)
            correct += (logits.argmax(axis=2) == yb[:, None]).sum(axis=0)
        return ce_sum / total, correct / total

    def evaluate(self, w: Vector) -> dict[str, float]:
        """Test accuracy and loss, and the training objective ``f(w)`` over the clients' data."""
        return self.evaluate_runs(np.asarray(w)[None, :])[0]

    def evaluate_runs(self, w: np.ndarray) -> list[dict[str, float]]:
        """`evaluate()` for each row of ``w`` (``(R, dim)``, one run per row): one pass over the data."""
        w = np.asarray(w, dtype=np.float64)
        test_loss, test_acc = self._scores(w, self.data.test_x, self.data.test_y)
        rows = np.sort(np.asarray(self.partition).ravel())
        train_ce, _ = self._scores(w, self.data.train_x, self.data.train_y, rows)  # no copy of the whole split
        penalty = 0.5 * self.cfg.weight_decay * np.einsum("rj,rj->r", w, w)
        return [
            {"test_accuracy": float(acc), "test_loss": float(loss), "train_loss": float(ce + pen)}
            for acc, loss, ce, pen in zip(test_acc, test_loss, train_ce, penalty, strict=True)
        ]
