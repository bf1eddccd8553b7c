"""Core math: clip/normalize, local steps, noise, Poisson sampling, aggregation, momentum."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from dpfedavg.core import (
    Stream,
    bound_sensitivity,
    client_update,
    clip,
    fixed_denominator_mean,
    gaussian_noise,
    keep_random_iterate,
    local_lr_at,
    local_steps,
    make_rng,
    momentum_step,
    normalize,
    poisson_sample,
    private_client_update,
    server_lr_at,
    server_noise_std,
)
from dpfedavg.core.mechanism import PLACEMENTS
from dpfedavg.tasks.quadratic import make_client

RNG = np.random.default_rng(1234)


# --------------------------------------------------------------- clip / norm
@pytest.mark.parametrize("scale", [0.01, 0.5, 0.999, 1.0, 1.001, 3.0, 1e6])
def test_clip_norm_and_direction(scale: float) -> None:
    c = 7.0
    direction = RNG.standard_normal(50)
    direction /= np.linalg.norm(direction)
    u = direction * c * scale
    g = clip(u, c)
    expected_norm = min(c, c * scale)
    assert np.linalg.norm(g) == pytest.approx(expected_norm, rel=1e-12)
    assert np.dot(g, direction) / np.linalg.norm(g) == pytest.approx(1.0, rel=1e-12)
    if np.linalg.norm(u) <= c:  # at or below the threshold clip is the identity (scale 1.0 can round either way)
        np.testing.assert_array_equal(g, u)


@pytest.mark.parametrize("scale", [1e-9, 0.01, 0.5, 1.0, 3.0, 1e6])
def test_normalize_norm_is_exactly_c_and_direction_kept(scale: float) -> None:
    c = 7.0
    direction = RNG.standard_normal(50)
    direction /= np.linalg.norm(direction)
    g = normalize(direction * c * scale, c)
    assert np.linalg.norm(g) == pytest.approx(c, rel=1e-12)
    np.testing.assert_allclose(g / c, direction, rtol=1e-10, atol=1e-12)


def test_zero_update_is_defined_for_both_and_never_nan() -> None:
    u = np.zeros(20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a division by zero would warn
        g_norm = normalize(u, 5.0)
        g_clip = clip(u, 5.0)
    np.testing.assert_array_equal(g_norm, np.zeros(20))
    np.testing.assert_array_equal(g_clip, np.zeros(20))


def test_clip_and_normalize_do_not_modify_input() -> None:
    u = RNG.standard_normal(10) * 100
    before = u.copy()
    clip(u, 1.0)
    normalize(u, 1.0)
    np.testing.assert_array_equal(u, before)


@pytest.mark.parametrize("c", [0.0, -1.0, float("nan")])
def test_bad_threshold_raises(c: float) -> None:
    with pytest.raises(ValueError, match="C must be > 0"):
        clip(np.ones(3), c)
    with pytest.raises(ValueError, match="C must be > 0"):
        normalize(np.ones(3), c)


def test_bound_sensitivity_dispatch() -> None:
    u = np.array([3.0, 4.0])  # norm 5
    np.testing.assert_allclose(bound_sensitivity(u, "clip", 10.0), u)
    np.testing.assert_allclose(bound_sensitivity(u, "norm", 10.0), 2 * u)
    np.testing.assert_allclose(bound_sensitivity(u, "none", 1.0), u)
    with pytest.raises(ValueError, match="allowed: 'clip', 'norm', 'none'"):
        bound_sensitivity(u, "median", 1.0)  # type: ignore[arg-type]


# ---------------------------------------------------------------- local steps
@pytest.mark.parametrize("num_steps", [1, 2, 20])
def test_local_steps_match_closed_form_on_quadratic(num_steps: int) -> None:
    """On f_i(w) = 1/2 (w - w*)^T Q (w - w*): w_E - w* = (I - eta Q)^E (w_0 - w*)."""
    client = make_client(seed=3, client_id=5, dim=40)
    q = client.hessian
    w0 = RNG.standard_normal(40)
    eta = 0.3
    w_e = local_steps(w0, client.grad, eta, num_steps)
    closed = client.w_star + np.linalg.matrix_power(np.eye(40) - eta * q, num_steps) @ (w0 - client.w_star)
    np.testing.assert_allclose(w_e, closed, rtol=1e-10, atol=1e-12)
    # u = (w_0 - w_E)/eta, line 9
    np.testing.assert_allclose(
        client_update(w0, client.grad, eta, num_steps), (w0 - closed) / eta, rtol=1e-8, atol=1e-10
    )


def test_one_local_step_update_is_the_gradient() -> None:
    client = make_client(seed=0, client_id=0, dim=30)
    w0 = RNG.standard_normal(30)
    np.testing.assert_allclose(client_update(w0, client.grad, 0.01, 1), client.grad(w0), rtol=1e-10)


def test_local_steps_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="E must be >= 1"):
        local_steps(np.zeros(2), lambda w: w, 0.1, 0)
    with pytest.raises(ValueError, match="must be > 0"):
        local_steps(np.zeros(2), lambda w: w, -0.1, 1)


# ---------------------------------------------------------------------- noise
def test_gaussian_noise_std_and_mean() -> None:
    std = 3.5
    x = gaussian_noise(400_000, std, np.random.default_rng(0))
    # tolerances: ~7 standard errors (SE of std ~ std/sqrt(2N) = 0.004, of mean ~ 0.0055)
    assert x.std() == pytest.approx(std, abs=0.03)
    assert abs(x.mean()) < 0.04


def test_zero_noise_is_exact_zero() -> None:
    np.testing.assert_array_equal(gaussian_noise(5, 0.0, np.random.default_rng(0)), np.zeros(5))


def test_noise_is_reproducible_from_explicit_generator() -> None:
    a = gaussian_noise(10, 1.0, make_rng(7, Stream.NOISE, 3))
    b = gaussian_noise(10, 1.0, make_rng(7, Stream.NOISE, 3))
    c = gaussian_noise(10, 1.0, make_rng(7, Stream.NOISE, 4))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


def test_per_client_noise_sums_to_z_c_and_averages_to_sigma() -> None:
    """Alg. 1 line 10: r clients each add N(0, r sigma^2 I); the mean carries sigma = zC/r."""
    z, c, r, d = 1.7, 4.0, 25, 20_000
    std = PLACEMENTS["client"].client_std(z, c, r, r)  # Alg. 1 line 10: z C / sqrt(r) each
    assert std == pytest.approx(np.sqrt(r) * server_noise_std(z, c, r))
    total = sum(gaussian_noise(d, std, make_rng(11, Stream.NOISE, i)) for i in range(r))
    # SE of the std estimate: std/sqrt(2d) = 0.5% -> 3% is ~6 SE
    assert total.std() == pytest.approx(z * c, rel=0.03)
    assert (total / r).std() == pytest.approx(z * c / r, rel=0.03)


def test_private_client_update_pipeline() -> None:
    client = make_client(seed=1, client_id=2, dim=25)
    w = RNG.standard_normal(25)
    out = private_client_update(
        w,
        client.grad,
        lr=0.01,
        num_steps=5,
        algorithm="norm",
        clip=2.0,
        noise_std=0.5,
        rng=make_rng(0, Stream.NOISE, 2),
    )
    u = client_update(w, client.grad, 0.01, 5)
    assert out.update_norm == pytest.approx(np.linalg.norm(u))
    np.testing.assert_allclose(out.clean, normalize(u, 2.0))
    np.testing.assert_allclose(out.noisy - out.clean, gaussian_noise(25, 0.5, make_rng(0, Stream.NOISE, 2)))


# ------------------------------------------------------------------- sampling
@pytest.mark.parametrize(("n", "q"), [(100, 0.3), (1000, 0.02), (50, 0.9)])
def test_poisson_counts_are_binomial(n: int, q: float) -> None:
    """|S_k| ~ Binomial(n, q): check mean and variance over many rounds (fixed seed).

    With R rounds the standard error of the mean is sqrt(nq(1-q)/R) and that of
    the variance about var*sqrt(2/R); tolerances are 5 standard errors.
    """
    rounds = 4000
    counts = np.array([len(poisson_sample(n, q, make_rng(42, Stream.SAMPLING, k))) for k in range(rounds)])
    mean, var = n * q, n * q * (1 - q)
    assert counts.mean() == pytest.approx(mean, abs=5 * np.sqrt(var / rounds))
    assert counts.var(ddof=1) == pytest.approx(var, abs=5 * var * np.sqrt(2 / rounds))


def test_poisson_each_client_has_probability_q() -> None:
    n, q, rounds = 40, 0.25, 8000
    hits = np.zeros(n)
    for k in range(rounds):
        hits[poisson_sample(n, q, make_rng(5, Stream.SAMPLING, k))] += 1
    se = np.sqrt(q * (1 - q) / rounds)
    assert np.all(np.abs(hits / rounds - q) < 5 * se)


def test_poisson_can_sample_nobody_and_everybody() -> None:
    rng = np.random.default_rng(0)
    assert poisson_sample(10, 0.0, rng).size == 0
    np.testing.assert_array_equal(poisson_sample(10, 1.0, rng), np.arange(10))
    with pytest.raises(ValueError):
        poisson_sample(10, 1.5, rng)


# ---------------------------------------------------------------- aggregation
def test_aggregation_divides_by_fixed_r_not_by_count() -> None:
    updates = [np.full(3, 1.0), np.full(3, 2.0), np.full(3, 6.0)]
    a = fixed_denominator_mean(sum(updates), clients_per_round=10.0)
    np.testing.assert_allclose(a, np.full(3, 0.9))  # 9/10, not 9/3
    np.testing.assert_array_equal(fixed_denominator_mean(np.zeros(3), 10.0), np.zeros(3))


def test_momentum_recursion() -> None:
    """m_{k+1} = mu m_k + a_k, w_{k+1} = w_k - beta_k m_{k+1}; unrolled by hand."""
    a_seq = [RNG.standard_normal(4) for _ in range(5)]
    betas = [0.5, 0.4, 0.3, 0.2, 0.1]
    mu = 0.8
    w, m = np.ones(4), np.zeros(4)
    for a, beta in zip(a_seq, betas, strict=True):
        w, m = momentum_step(w, m, a, beta, mu)
    expected_w = np.ones(4)
    for k, beta in enumerate(betas):
        m_k = sum(mu ** (k - j) * a_seq[j] for j in range(k + 1))
        expected_w = expected_w - beta * m_k
    np.testing.assert_allclose(w, expected_w, rtol=1e-12)


def test_zero_momentum_is_algorithm_1() -> None:
    w, a = RNG.standard_normal(3), RNG.standard_normal(3)
    w_new, m_new = momentum_step(w, np.full(3, 99.0), a, 0.1, 0.0)
    np.testing.assert_allclose(w_new, w - 0.1 * a)
    np.testing.assert_allclose(m_new, a)


def test_schedules() -> None:
    assert local_lr_at(0, 0.1, 0.99) == pytest.approx(0.1)
    assert local_lr_at(10, 0.1, 0.99) == pytest.approx(0.1 * 0.99**10)
    assert server_lr_at(10, 0.1, 0.99, None) == pytest.approx(0.1 * 0.99**10)  # beta_k = eta_k
    assert server_lr_at(10, 0.1, 0.99, 0.5) == 0.5


def _reservoir_pick(num_rounds: int, seed: int) -> int:
    kept = -1
    for k in range(num_rounds):
        if keep_random_iterate(k, make_rng(seed, Stream.ITERATE, k)):
            kept = k
    return kept


@pytest.mark.parametrize("num_rounds", [1, 5])
def test_reservoir_random_iterate_is_uniform(num_rounds: int) -> None:
    """Alg. 1 line 13: k~ ~ unif[0, K-1]; 5000 seeds, 5-standard-error tolerance per round."""
    picks = np.array([_reservoir_pick(num_rounds, s) for s in range(5000)])
    assert picks.min() == 0 and picks.max() == num_rounds - 1
    freq = np.bincount(picks, minlength=num_rounds) / len(picks)
    p = 1 / num_rounds
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / len(picks)))


def test_noise_laws_add_what_they_account() -> None:
    """Gaussian law: std as asked (5%), zero terms; the round's discrete law: every coordinate on the grid, in range."""
    from dpfedavg.core import NOISE_LAWS, noise_law, round_noise_law
    from dpfedavg.core.secagg import SecAggGrid
    from dpfedavg.core.types import RoundInstructions

    assert set(NOISE_LAWS) == {"gaussian", "discrete-gaussian"}
    assert noise_law(False).name == "gaussian" and noise_law(True).name == "discrete-gaussian"
    g = np.zeros(20000)
    zeta = noise_law(False).add(g, 1.0, 0.7, np.random.default_rng(0))
    assert abs(zeta.std() - 0.7) < 0.05 * 0.7
    assert noise_law(False).privacy_terms(delta=1e-6).delta_including_clipping == 1e-6
    ins = RoundInstructions(1, 0.1, 1, "clip", 1.0, 0.05, 3, False)
    assert round_noise_law(ins).name == "gaussian"
    grid = SecAggGrid.for_round(1.0, 0.05, 10.0, 16, 32)
    ins = RoundInstructions(1, 0.1, 1, "clip", 1.0, 0.05, 3, False, grid.step, grid.clipping_range)
    law = round_noise_law(ins)
    y = law.add(np.full(500, 0.01), 1.0, 0.05, np.random.default_rng(1))
    assert law.name == "discrete-gaussian"
    np.testing.assert_array_equal(y, np.round(y / grid.step) * grid.step)
    assert np.all(np.abs(y) <= grid.clipping_range) and abs(np.std(y - 0.01) - 0.05) < 0.01


def test_client_normals_are_each_clients_own_draws_on_one_reused_pool(monkeypatch) -> None:
    """Long rows are drawn on the process's one noise pool, short rows on the caller's thread; same values."""
    from dpfedavg.core import pipeline
    from dpfedavg.core.seeding import noise_rng

    ids = np.array([3, 17, 4, 250, 9])

    def reference(dim: int) -> np.ndarray:
        return np.stack([noise_rng(12345, int(i)).standard_normal(dim) for i in ids])

    monkeypatch.setattr(pipeline, "cpu_share", lambda: 4)
    long = pipeline.NOISE_THREAD_MIN_DIM
    assert pipeline.noise_threads(len(ids), long) == 4 and pipeline.noise_threads(len(ids), 200) == 1
    np.testing.assert_array_equal(pipeline.client_normals(12345, ids, long), reference(long))
    pool = pipeline._noise_pool()
    np.testing.assert_array_equal(pipeline.client_normals(12345, ids[::-1], long), reference(long)[::-1])
    assert pipeline._noise_pool() is pool  # one pool for the process, never one per call
    monkeypatch.setattr(pipeline, "_noise_pool", lambda: pytest.fail("a pool for rows of 200"))
    np.testing.assert_array_equal(pipeline.client_normals(12345, ids, 200), reference(200))
    monkeypatch.setattr(pipeline, "cpu_share", lambda: 1)  # a Flower app process, or one CPU
    assert pipeline.noise_threads(len(ids), long) == 1
    np.testing.assert_array_equal(pipeline.client_normals(12345, ids, long), reference(long))


@pytest.mark.parametrize("noise_seed", [0, 7, 2**32 - 1, 2**32, 8765432187654321, 2**63 - 2])
def test_block_seeding_gives_each_clients_own_generator_state(noise_seed: int, monkeypatch, caplog) -> None:
    """seed_rows hashes a block's SeedSequences at once: the same PCG64 states, so the same rows, as noise_rng."""
    from dpfedavg.core import seed_rows
    from dpfedavg.core.seeding import noise_rng

    ids = np.array([0, 1, 5, 99, 2**31, 2**32 - 1, 2**32, 2**40])  # the last two: 2 words, drawn one by one
    made = []
    monkeypatch.setattr(seed_rows, "noise_rng", lambda *a: made.append(a) or noise_rng(*a))
    out = np.full((len(ids) + 1, 13), np.nan)
    seed_rows.fill_noise_rows(noise_seed, ids[:6], out, range(6))
    assert len(made) == 1  # the check of the first client; the others from the block's states
    seed_rows.fill_noise_rows(noise_seed, ids, out, range(6, 8))  # a chunk of rows, as a noise thread fills
    assert len(made) == 3
    for b, i in enumerate(ids):
        np.testing.assert_array_equal(out[b], noise_rng(noise_seed, int(i)).standard_normal(13))
    assert np.isnan(out[-1]).all()
    # a numpy that seeded differently: found at the call's first client, drawn client by client, said once
    monkeypatch.setattr(seed_rows, "_PCG_MULT", seed_rows._PCG_MULT + 2)
    monkeypatch.setattr(seed_rows, "_warned", False)
    again = np.empty((3, 13))
    seed_rows.fill_noise_rows(noise_seed, ids[:3], again, range(3))
    np.testing.assert_array_equal(again, out[:3])
    assert "seeds PCG64 differently" in caplog.text


def test_round_streams_draw_what_make_rng_draws_in_any_order() -> None:
    """RoundStreams reuses one generator per stream from cached states: the same draws as a fresh make_rng."""
    from dpfedavg.core.seeding import RoundStreams, Stream, make_rng

    a, b = RoundStreams(3), RoundStreams(3)
    for stream, k in [(Stream.SAMPLING, 0), (Stream.ITERATE, 0), (Stream.SAMPLING, 7), (Stream.SAMPLING, 0),
                      (Stream.SERVER_NOISE, 499), (Stream.ITERATE, 2**20)]:  # fmt: skip
        first = a.rng(stream, k).random(5)
        np.testing.assert_array_equal(first, make_rng(3, stream, k).random(5))
        np.testing.assert_array_equal(b.rng(stream, k).random(5), first)  # another run of the seed: the cache
        np.testing.assert_array_equal(a.rng(stream, k).random(5), first)  # again from the start, not continued
    other_seed = RoundStreams(4).rng(Stream.SAMPLING, 0).random(5)
    assert not np.array_equal(other_seed, make_rng(3, Stream.SAMPLING, 0).random(5))


def test_round_streams_share_a_seeds_draw_once() -> None:
    """RoundStreams.draw computes a (seed, stream, k, key) draw once and shares it read-only; other keys draw anew."""
    from dpfedavg.core.seeding import RoundStreams, Stream, make_rng
    from dpfedavg.core.server import poisson_sample

    calls = []

    def sample(rng: np.random.Generator) -> np.ndarray:
        calls.append(1)
        return poisson_sample(50, 0.3, rng)

    first = RoundStreams(11).draw(Stream.SAMPLING, 4, ("poisson", 50, 0.3), sample)
    again = RoundStreams(11).draw(Stream.SAMPLING, 4, ("poisson", 50, 0.3), sample)
    np.testing.assert_array_equal(first, poisson_sample(50, 0.3, make_rng(11, Stream.SAMPLING, 4)))
    assert again is first and len(calls) == 1 and not first.flags.writeable
    RoundStreams(11).draw(Stream.SAMPLING, 4, ("poisson", 60, 0.3), sample)  # another n: its own draw
    RoundStreams(12).draw(Stream.SAMPLING, 4, ("poisson", 50, 0.3), sample)  # another seed
    assert len(calls) == 3


def test_round_streams_keep_few_draws_however_long_a_run(monkeypatch) -> None:
    """The shared draws are a small cache (a batch's runs share one round's): bounded in entries and in bytes."""
    from dpfedavg.core import seeding
    from dpfedavg.core.seeding import RoundStreams, Stream

    monkeypatch.setattr(seeding, "_draws", type(seeding._draws)())
    monkeypatch.setattr(seeding, "_draw_bytes", 0)
    monkeypatch.setattr(seeding, "_MAX_DRAW_BYTES", 10 * 8 * 1000)  # ten cohorts of every one of 1000 clients
    streams = RoundStreams(0)
    for k in range(300):  # a long check-in run: every client every round
        streams.draw(Stream.SAMPLING, k, ("all", 1000), lambda rng: np.arange(1000))
    assert len(seeding._draws) == 10 and seeding._draw_bytes == 10 * 8 * 1000
    for k in range(1000):
        streams.draw(Stream.ITERATE, k, "keep", lambda rng: bool(rng.random() < 0.5))
    assert len(seeding._draws) == seeding._MAX_DRAWS
