"""The paper's §4.4 quadratic task."""

from __future__ import annotations

import numpy as np
import pytest
from reference import quadratic_data, quadratic_optimum

from dpfedavg.config import RunConfig
from dpfedavg.tasks import build_task
from dpfedavg.tasks.quadratic import RANK, QuadraticTask, make_client


@pytest.fixture(scope="module")
def task() -> QuadraticTask:
    return build_task(RunConfig())  # paper sizes: n = 100, d = 200


def test_paper_sizes_and_distributions(task: QuadraticTask) -> None:
    assert (task.num_clients, task.dim) == (100, 200)
    clients = [task.client(i) for i in range(task.num_clients)]
    a, w_stars = np.stack([c.a for c in clients]), np.stack([c.w_star for c in clients])
    assert a.shape == (100, 200, RANK) and w_stars.shape == (100, 200)
    # A_i entries N(0, 1/20^2), w_i* ~ N(0, I): 4e5 and 2e4 samples, 5% tolerance
    assert a.std() == pytest.approx(1 / 20, rel=0.05)
    assert w_stars.std() == pytest.approx(1.0, rel=0.05)
    assert abs(w_stars.mean()) < 0.05


def test_optimum_is_stationary_and_suboptimality_nonnegative(task: QuadraticTask) -> None:
    w_opt, f_opt = task.optimum
    grad = sum(task.client(i).grad(w_opt) for i in range(task.num_clients)) / task.num_clients
    assert np.linalg.norm(grad) < 1e-10
    assert f_opt > 0  # heterogeneous: no point minimizes every f_i (n * 20 > d)
    rng = np.random.default_rng(0)
    for _ in range(5):
        assert task.evaluate(w_opt + rng.standard_normal(200))["suboptimality"] > 0
    assert task.evaluate(w_opt)["suboptimality"] == pytest.approx(0.0, abs=1e-10)


def test_objective_matches_dense_reference(task: QuadraticTask) -> None:
    qs, w_stars = quadratic_data(0, 100, 200)
    w = np.random.default_rng(1).standard_normal(200)
    dense = np.mean([0.5 * (w - ws) @ q @ (w - ws) for q, ws in zip(qs, w_stars, strict=True)])
    assert task.objective(w) == pytest.approx(dense, rel=1e-10)
    np.testing.assert_allclose(task.optimum[0], quadratic_optimum(qs, w_stars), rtol=1e-8, atol=1e-10)


def test_clients_rebuild_only_their_own_objective_deterministically() -> None:
    a = make_client(seed=7, client_id=3, dim=50)
    b = make_client(seed=7, client_id=3, dim=50)
    c = make_client(seed=7, client_id=4, dim=50)
    np.testing.assert_array_equal(a.a, b.a)
    np.testing.assert_array_equal(a.w_star, b.w_star)
    assert not np.allclose(a.w_star, c.w_star)
    task = build_task(RunConfig(seed=7, dim=50))
    np.testing.assert_array_equal(task.client(3).a, a.a)
    with pytest.raises(ValueError, match="outside"):
        task.client(100)


@pytest.mark.parametrize(("init", "scale"), [("I1", 1.0), ("I2", 0.2)])
def test_initializations(init: str, scale: float) -> None:
    task = build_task(RunConfig(init=init))
    z = task.initial_weights() - task.optimum[0]
    # z ~ U(0,1)^d (I1) or U(0,1)^d / 5 (I2)
    assert z.min() >= 0 and z.max() <= scale
    assert z.mean() == pytest.approx(0.5 * scale, rel=0.1)


def test_rank_deficient_small_federation_still_has_exact_optimum() -> None:
    task = build_task(RunConfig(num_clients=3, clients_per_round=3.0, dim=200))  # 3 * 20 < 200
    w_opt, f_opt = task.optimum
    assert f_opt == pytest.approx(0.0, abs=1e-10)
    assert task.evaluate(w_opt)["suboptimality"] == pytest.approx(0.0, abs=1e-10)
