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
from functools import cached_property, lru_cache

import numpy as np

from dpfedavg.config import RunConfig
from dpfedavg.core.seeding import Stream, make_rng
from dpfedavg.core.types import BatchUpdateFn, GradFn, RunsUpdateFn, Vector
from dpfedavg.tasks.base import runs_step_sizes

__all__ = ["Federation", "QuadraticTask", "QuadraticClient", "RANK", "federation", "local_steps_gain"]

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


class Federation:
    """Every client's ``(A_i, w_i*)`` of one ``(seed, n, d)``, stacked, and what the closed forms reuse.

    Built once per process and shared by every task (and every run of a sweep) with the same
    ``(seed, n, d)`` (`federation()`); the ``init`` of a run changes only its ``w_0``.

    Each client's span is kept in the eigenbasis of its ``RANK x RANK`` Gram matrix:
    ``A_i^T A_i = V_i diag(lambda_i) V_i^T`` and ``B_i = A_i V_i`` (``d x RANK``, orthogonal columns of norms
    ``sqrt(lambda_i)``), so that ``Q_i = A_i A_i^T = B_i B_i^T`` and ``||A_i^T x|| = ||B_i^T x||``.
    """

    def __init__(self, seed: int, num_clients: int, dim: int) -> None:
        clients = [make_client(seed, i, dim) for i in range(num_clients)]
        self.a = np.stack([c.a for c in clients])  # (n, d, RANK)
        self.w_stars = np.stack([c.w_star for c in clients])  # (n, d)
        self.num_clients, self.dim = num_clients, dim
        self.eigenvalues, vectors = np.linalg.eigh(np.matmul(self.a.transpose(0, 2, 1), self.a))  # (n, RANK), ...
        self.eigenvalues = np.maximum(self.eigenvalues, 0.0)  # a Gram matrix: rounding may give -1e-17
        basis = np.matmul(self.a, vectors)  # B_i = A_i V_i, (n, d, RANK)
        #: ``[B_0 | B_1 | ...]``, ``(d, n RANK)``: ``W @ basis_flat`` projects every run on every client at once.
        self.basis_flat = np.ascontiguousarray(basis.transpose(1, 0, 2).reshape(dim, num_clients * RANK))
        #: ``B_i^T`` of every client, contiguous (``(n, RANK, d)``), and ``B_i^T w_i*`` (``(n, RANK)``).
        self.basis_t = np.ascontiguousarray(basis.transpose(0, 2, 1))
        self.star_proj = np.einsum("nrd,nd->nr", self.basis_t, self.w_stars)
        self._last: tuple[np.ndarray, np.ndarray] | None = None  # (w, projections(w))
        self._last_gain: tuple[tuple, np.ndarray] | None = None  # (clients, eta_k, E), gain(...)

    def projections(self, w: np.ndarray) -> np.ndarray:
        """``B_i^T (w_r - w_i*)`` for every run ``r`` (rows of ``w``, ``(R, d)``) and client: ``(R, n, RANK)``.

        The last result is kept: the server's evaluation of ``w_{k+1}`` and the next round's local steps
        (from the same ``w_{k+1}``, every client sampled) need the same product.
        """
        last = self._last
        if last is not None and last[0].shape == w.shape and np.array_equal(last[0], w):
            return last[1]
        proj = np.matmul(w, self.basis_flat).reshape(len(w), self.num_clients, RANK) - self.star_proj[None]
        proj.flags.writeable = False
        self._last = (np.array(w, copy=True), proj)
        return proj

    def gain(self, ids_key: bytes, eigenvalues: np.ndarray, lrs: np.ndarray, num_steps: int) -> np.ndarray:
        """`local_steps_gain()` of these clients (``eigenvalues``, named by ``ids_key``) for each run's ``eta_k``:
        ``(B, R, RANK)``. The last one is kept: a batch's rounds repeat it while ``eta_k`` does not decay."""
        key = (ids_key, lrs.tobytes(), num_steps)
        if self._last_gain is not None and self._last_gain[0] == key:
            return self._last_gain[1]
        distinct, which = np.unique(lrs, return_inverse=True)  # a sweep's runs share a few eta_k
        gain = local_steps_gain(eigenvalues, distinct, num_steps)[:, which.reshape(-1)]
        gain.flags.writeable = False
        self._last_gain = (key, gain)
        return gain

    def objective(self, w: np.ndarray) -> np.ndarray:
        """``f(w_r) = (1/n) sum_i 1/2 ||B_i^T (w_r - w_i*)||^2`` for each row of ``w``: ``(R,)``."""
        proj = self.projections(w).reshape(len(w), -1)
        return 0.5 * np.einsum("rj,rj->r", proj, proj) / self.num_clients

    @cached_property
    def optimum(self) -> tuple[Vector, float]:
        """``(w*, f*)`` (see `QuadraticTask.optimum`)."""
        hessian = np.einsum("ndr,ner->de", self.a, self.a)
        rhs = np.einsum("ndr,ner,ne->d", self.a, self.a, self.w_stars)
        w_opt, *_ = np.linalg.lstsq(hessian, rhs, rcond=None)
        return w_opt, float(self.objective(w_opt[None])[0])


def local_steps_gain(eigenvalues: np.ndarray, lrs: np.ndarray, num_steps: int) -> np.ndarray:
    """``h = (1 - (1 - eta lambda)^E) / (eta lambda)`` (``E`` at ``eta lambda = 0``) per client, run and direction.

    ``eigenvalues`` is ``(B, RANK)`` and ``lrs`` is ``(R,)``; the result is ``(B, R, RANK)``. E gradient steps of
    size ``eta`` on ``1/2 x^T Q x`` multiply the component of ``x`` along an eigenvector of ``Q`` with
    eigenvalue ``lambda`` by ``(1 - eta lambda)^E``, so ``u = (x_0 - x_E) / eta`` is ``h`` times ``Q x_0``'s
    component. For ``eta lambda < 1/2`` it is computed as ``-expm1(E log1p(-eta lambda)) / (eta lambda)``
    (accurate to the last digits even when ``eta lambda`` is tiny); above, the power itself is exact enough.
    """
    x = lrs[None, :, None] * eigenvalues[:, None, :]
    safe = np.where(x > 0, x, 1.0)
    small = -np.expm1(num_steps * np.log1p(-np.minimum(x, 0.5))) / safe
    large = (1.0 - (1.0 - x) ** num_steps) / safe
    return np.where(x > 0, np.where(x < 0.5, small, large), float(num_steps))


@lru_cache(maxsize=8)
def federation(seed: int, num_clients: int, dim: int) -> Federation:
    """The `Federation` of ``(seed, n, d)``, built once per process."""
    return Federation(seed, num_clients, dim)


class QuadraticTask:
    """Paper §4.4: n clients with convex, smooth, heterogeneous quadratics."""

    name = "quadratic"
    metric_names = ("suboptimality", "dist_to_opt", "objective")
    headline_metric = "suboptimality"
    #: Computed from every client's private data (A_i, w_i*): withheld with secure-noise (see Task).
    training_data_metrics = ("suboptimality", "dist_to_opt", "objective")
    #: Keys that may differ between runs sharing `client_runs_update_fn()` (``init`` moves only ``w_0``).
    run_axis_keys = ("init",)

    def __init__(self, cfg: RunConfig) -> None:
        self.seed = cfg.seed
        self.num_clients = cfg.num_clients
        self.dim = cfg.dim
        self.init = cfg.init

    @property
    def batch_shared_bytes(self) -> int:
        """Memory of the stacked federation a batch of runs shares (`Federation`: ``A`` three times)."""
        return 4 * 8 * self.num_clients * self.dim * RANK

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

    def client_runs_update_fn(self, client_ids: np.ndarray, server_round: int = 0) -> RunsUpdateFn:
        """``u = (w_k - w_{k,E}) / eta_k`` of E local steps for a block of clients and several runs, exactly.

        Alg. 1 / Alg. 2 lines 5-9 in closed form. A step on ``f_i`` moves the iterate by
        ``-eta Q_i (w - w_i*)`` with ``Q_i = B_i B_i^T`` (`Federation`: ``B_i``'s columns are the
        eigenvectors of ``Q_i`` with eigenvalues ``lambda_i``, scaled by ``sqrt(lambda_i)``), so after E steps

            ``u = B_i (h_i * B_i^T (w_k - w_i*))``,  ``h_i = (1 - (1 - eta_k lambda_i)^E) / (eta_k lambda_i)``

        (`local_steps_gain()`): two products of ``d x RANK`` per client and run instead of ``2 E`` of them.
        The returned function maps the runs' ``w_k`` (``(R, d)``) and ``eta_k`` (``(R,)``) to ``u`` of shape
        ``(R, B, d)`` (one row per run and client); the same as `dpfedavg.core.client_update()` on
        `client_batch_grad_fn()`, up to float64 rounding (tested). ``server_round`` is unused (full batches).
        """
        fed = federation(self.seed, self.num_clients, self.dim)
        ids = np.asarray(client_ids, dtype=np.int64)
        every = len(ids) == self.num_clients and bool(np.all(ids == np.arange(self.num_clients)))
        ids_key = b"every" if every else ids.tobytes()
        if every:
            basis_t, eigenvalues = fed.basis_t, fed.eigenvalues
        else:
            basis_t, eigenvalues = fed.basis_t[ids], fed.eigenvalues[ids]  # (B, RANK, d), (B, RANK)
            basis_flat = np.ascontiguousarray(basis_t.transpose(2, 0, 1).reshape(self.dim, -1))
            star_proj = fed.star_proj[ids]

        def update(w: np.ndarray, lrs: np.ndarray, num_steps: int) -> np.ndarray:
            lrs = runs_step_sizes(lrs, num_steps)
            w = np.atleast_2d(np.asarray(w, dtype=np.float64))
            if every:  # the product the server's evaluation of w_k already formed
                v = fed.projections(w).transpose(1, 0, 2)  # (B, R, RANK)
            else:
                v = np.matmul(w, basis_flat).reshape(len(w), len(ids), RANK).transpose(1, 0, 2) - star_proj[:, None]
            gain = fed.gain(ids_key, eigenvalues, lrs, num_steps)  # (B, R, RANK)
            u = np.empty((len(w), len(ids), self.dim))  # (R, B, d), C-ordered: the bound's passes run along rows
            np.matmul(gain * v, basis_t, out=u.transpose(1, 0, 2))  # the (B, R, d) products, written in place
            return u

        return update

    def client_batch_update_fn(self, client_ids: np.ndarray) -> BatchUpdateFn:
        """`client_runs_update_fn()` for one run: ``(w_k, eta_k, E) -> u`` of shape ``(B, d)``."""
        runs_update = self.client_runs_update_fn(client_ids)
        return lambda w, lr, num_steps: runs_update(np.asarray(w)[None, :], np.array([lr]), num_steps)[0]

    # --- server side: everything below needs all n clients ------------------
    @property
    def _stacked(self) -> tuple[np.ndarray, np.ndarray]:
        fed = federation(self.seed, self.num_clients, self.dim)
        return fed.a, fed.w_stars

    @property
    def optimum(self) -> tuple[Vector, float]:
        """``(w*, f*)``: the exact minimizer of ``f`` and its value.

        ``grad f(w) = 0  <=>  (sum_i Q_i) w = sum_i Q_i w_i*``, solved with a
        least-squares solver so that a rank-deficient ``sum_i Q_i`` (fewer than
        ``d / 20`` clients) still gives an exact minimizer.
        """
        return federation(self.seed, self.num_clients, self.dim).optimum

    def objective(self, w: Vector) -> float:
        """``f(w) = (1/n) sum_i f_i(w)``."""
        return float(federation(self.seed, self.num_clients, self.dim).objective(np.asarray(w)[None, :])[0])

    def initial_weights(self) -> Vector:
        """I1: ``w_0 = w* + z``; I2: ``w_0 = w* + z/5``; ``z ~ U(0, 1)^d``."""
        z = make_rng(self.seed, Stream.INIT).uniform(0.0, 1.0, size=self.dim)
        w_opt, _ = self.optimum
        return w_opt + (z if self.init == "I1" else z / 5.0)

    def evaluate(self, w: Vector) -> dict[str, float]:
        """``f(w_k) - f*``, ``||w_k - w*||`` and ``f(w_k)``."""
        return self.evaluate_runs(np.asarray(w)[None, :])[0]

    def evaluate_runs(self, w: np.ndarray) -> list[dict[str, float]]:
        """`evaluate()` for each row of ``w`` (``(R, d)``, one run per row), in one product."""
        fed = federation(self.seed, self.num_clients, self.dim)
        w_opt, f_opt = fed.optimum
        f_w = fed.objective(np.asarray(w, dtype=np.float64))
        dist = np.linalg.norm(w - w_opt[None, :], axis=1)
        return [
            {"suboptimality": float(f) - f_opt, "dist_to_opt": float(e), "objective": float(f)}
            for f, e in zip(f_w, dist, strict=True)
        ]
