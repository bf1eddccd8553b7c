"""The paper's synthetic quadratic problem (§4.4).

``f_i(w) = 1/2 (w - w_i*)^T Q_i (w - w_i*)`` for ``i in [n]`` (paper: n = 100,
d = 200), ``w_i* ~ N(0, I_d)``, ``Q_i = A_i A_i^T`` with ``A_i`` a ``d x 20``
matrix of i.i.d. ``N(0, 1/20^2)`` entries, and ``f = (1/n) sum_i f_i``.
Initializations: I1 ``w_0 = w* + z`` and I2 ``w_0 = w* + z/5`` with
``z ~ U(0, 1)^d``.

Everything derives from ``seed``: client ``i``'s ``(A_i, w_i*)`` from
``make_rng(seed, Stream.TASK, i)``, ``z`` from ``make_rng(seed, Stream.INIT)``,
so a client builds only its own ``f_i`` and the server rebuilds all of them to
get ``w*`` and ``f* = f(w*)`` by an exact solve.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from dpfedavg.config import RunConfig
from dpfedavg.core.seeding import Stream, make_rng
from dpfedavg.core.types import GradFn, Vector

__all__ = ["QuadraticTask", "QuadraticClient", "RANK"]

#: Columns of A_i (paper: 20); entries have std 1/RANK.
RANK = 20


@dataclass(frozen=True)
class QuadraticClient:
    """Client ``i``'s objective ``f_i(w) = 1/2 ||A_i^T (w - w_i*)||^2``."""

    a: np.ndarray  # (d, RANK)
    w_star: np.ndarray  # (d,)

    def grad(self, w: Vector) -> Vector:
        """``grad f_i(w) = Q_i (w - w_i*) = A_i (A_i^T (w - w_i*))``."""
        return self.a @ (self.a.T @ (w - self.w_star))

    def loss(self, w: Vector) -> float:
        """``f_i(w)``."""
        r = self.a.T @ (w - self.w_star)
        return 0.5 * float(r @ r)

    @property
    def hessian(self) -> np.ndarray:
        """``Q_i = A_i A_i^T`` (dense; for tests and closed forms)."""
        return self.a @ self.a.T


def make_client(seed: int, client_id: int, dim: int) -> QuadraticClient:
    """Build client ``i``'s ``(A_i, w_i*)`` from ``seed`` alone."""
    rng = make_rng(seed, Stream.TASK, client_id)
    w_star = rng.standard_normal(dim)
    a = rng.normal(0.0, 1.0 / RANK, size=(dim, RANK))
    return QuadraticClient(a=a, w_star=w_star)


class QuadraticTask:
    """Paper §4.4: n clients with convex, smooth, heterogeneous quadratics."""

    name = "quadratic"
    metric_names = ("suboptimality", "dist_to_opt", "objective")
    headline_metric = "suboptimality"
    #: Computed from every client's private data (A_i, w_i*): withheld with secure-noise (see Task).
    training_data_metrics = ("suboptimality", "dist_to_opt", "objective")

    def __init__(self, cfg: RunConfig) -> None:
        self.seed = cfg.seed
        self.num_clients = cfg.num_clients
        self.dim = cfg.dim
        self.init = cfg.init

    def client(self, client_id: int) -> QuadraticClient:
        """Client ``i``'s objective (built on demand, nothing else)."""
        if not 0 <= client_id < self.num_clients:
            raise ValueError(f"client id {client_id} outside [0, {self.num_clients})")
        return make_client(self.seed, client_id, self.dim)

    def client_grad_fn(self, client_id: int) -> GradFn:
        return self.client(client_id).grad

    def client_batch_grad_fn(self, client_ids: np.ndarray) -> GradFn:
        """Gradients of several clients at once: row ``b`` of ``W`` is client ``client_ids[b]``'s iterate."""
        all_a, all_w_star = self._stacked  # every client's data, built once
        ids = np.asarray(client_ids, dtype=np.int64)
        a, w_star = all_a[ids], all_w_star[ids]  # (B, d, RANK), (B, d)

        def grad(w: np.ndarray) -> np.ndarray:
            proj = np.matmul((w - w_star)[:, None, :], a)  # (B, 1, RANK) = (A_i^T (w - w_i*))^T
            return np.matmul(proj, a.transpose(0, 2, 1))[:, 0, :]  # (B, d) = A_i A_i^T (w - w_i*)

        return grad

    # --- server side: everything below needs all n clients ------------------
    @cached_property
    def _stacked(self) -> tuple[np.ndarray, np.ndarray]:
        clients = [self.client(i) for i in range(self.num_clients)]
        a = np.stack([c.a for c in clients])  # (n, d, RANK)
        w_stars = np.stack([c.w_star for c in clients])  # (n, d)
        return a, w_stars

    @cached_property
    def optimum(self) -> tuple[Vector, float]:
        """``(w*, f*)``: the exact minimizer of ``f`` and its value.

        ``grad f(w) = 0  <=>  (sum_i Q_i) w = sum_i Q_i w_i*``, solved with a
        least-squares solver so that a rank-deficient ``sum_i Q_i`` (fewer than
        ``d / 20`` clients) still gives an exact minimizer.
        """
        a, w_stars = self._stacked
        hessian = np.einsum("ndr,ner->de", a, a)
        rhs = np.einsum("ndr,ner,ne->d", a, a, w_stars)
        w_opt, *_ = np.linalg.lstsq(hessian, rhs, rcond=None)
        return w_opt, self.objective(w_opt)

    def objective(self, w: Vector) -> float:
        """``f(w) = (1/n) sum_i f_i(w)``."""
        a, w_stars = self._stacked
        proj = np.einsum("ndr,nd->nr", a, w[None, :] - w_stars)
        return 0.5 * float(np.einsum("nr,nr->", proj, proj)) / self.num_clients

    def initial_weights(self) -> Vector:
        """I1: ``w_0 = w* + z``; I2: ``w_0 = w* + z/5``; ``z ~ U(0, 1)^d``."""
        z = make_rng(self.seed, Stream.INIT).uniform(0.0, 1.0, size=self.dim)
        w_opt, _ = self.optimum
        return w_opt + (z if self.init == "I1" else z / 5.0)

    def evaluate(self, w: Vector) -> dict[str, float]:
        """``f(w_k) - f*``, ``||w_k - w*||`` and ``f(w_k)``."""
        w_opt, f_opt = self.optimum
        f_w = self.objective(w)
        return {
            "suboptimality": f_w - f_opt,
            "dist_to_opt": float(np.linalg.norm(w - w_opt)),
            "objective": f_w,
        }
