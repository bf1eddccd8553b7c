"""Banded matrix-factorization noise: strategy, streamed noise, participation rules, sensitivity and accounting.

Every privacy number is checked against a computation written here, not read from the code under test:
``C`` materialized with ``scipy.linalg.toeplitz``, its inverse by ``scipy.linalg.solve_triangular``, the
sensitivity by enumerating participation patterns of that dense ``C``, epsilon from Gaussian DP's closed
form with ``scipy.stats.norm``, and (when installed) jax-privacy's ``minsep_sensitivity_squared`` and its
cyclic-Poisson accountant.
"""

from __future__ import annotations

import importlib.util
import io
import itertools
import json
import logging
import math
import sys
from fractions import Fraction

import dp_accounting
import numpy as np
import pytest
from scipy.linalg import solve_triangular, toeplitz
from scipy.optimize import brentq
from scipy.stats import chi, norm

from dpfedavg.core.banded_mf import (
    BandedNoiseStream,
    brute_force_sensitivity,
    check_coefficients,
    column_norms_squared,
    default_bands,
    inverse_coefficients,
    minsep_sensitivity,
    noise_norm_bounds,
    sqrt_prefix_coefficients,
    toeplitz_matrix,
)
from dpfedavg.core.dp import gaussian_noise
from dpfedavg.core.mechanism import SERVER, Neighbouring, released_sum
from dpfedavg.core.participation import (
    Participation,
    ParticipationError,
    ParticipationRule,
    ParticipationTracker,
    check_schedule,
)
from dpfedavg.core.seeding import Stream, make_rng
from dpfedavg.core.server import poisson_sample
from dpfedavg.privacy.accountants import RoundEvent
from dpfedavg.privacy.banded_mf_accounting import (
    BandedMFAccountant,
    BandedMFParams,
    banded_mf_epsilon,
    banded_mf_record,
    calibrate_noise_std,
)
from dpfedavg.privacy.banded_mf_mechanism import BandedMFMechanism, BandedMFSpec
from dpfedavg.privacy.calibration import calibrate_noise_multiplier, epsilon_for

HAS_JAX_PRIVACY = importlib.util.find_spec("jax_privacy") is not None
needs_jax_privacy = pytest.mark.skipif(
    not HAS_JAX_PRIVACY, reason="jax-privacy is not installed (optional: pip install jax-privacy==2.0.0)"
)


# ------------------------------------------------------------------------------------- independent references
def dense_c(coefs, num_rounds: int) -> np.ndarray:
    """``C`` from scipy: first column ``c_0 .. c_{b-1}, 0, ...``, zero first row past the diagonal."""
    col = np.zeros(num_rounds)
    col[: min(len(coefs), num_rounds)] = coefs[:num_rounds]
    return toeplitz(col, np.zeros(num_rounds))


def brute_sensitivity_squared(c: np.ndarray, min_sep: int, k: int | None) -> tuple[float, float]:
    """(lower, upper) on ``max_P sup_g ||sum_{t in P} C[:, t] g_t^T||_F^2`` over patterns of the dense ``C``.

    lower: attained (orthogonal g_t -> trace, equal g_t -> sum); upper: sum of |Gram entries|.
    """
    n = c.shape[0]
    most = n if k is None else k
    lo = hi = 0.0
    for size in range(1, most + 1):
        for p in itertools.combinations(range(n), size):
            if any(b - a < min_sep for a, b in zip(p, p[1:], strict=False)):
                continue
            cols = c[:, list(p)]
            gram = cols.T @ cols
            lo = max(lo, np.trace(gram), gram.sum())
            hi = max(hi, np.abs(gram).sum())
    return lo, hi


def gdp_epsilon(mu: float, delta: float) -> float:
    """Epsilon of a mu-GDP mechanism at ``delta`` (Dong, Roth, Su 2022, Corollary 2.13)."""

    def excess(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    if excess(0.0) <= 0:
        return 0.0
    hi = 1.0
    while excess(hi) > 0:  # delta(eps) decreases in eps
        hi *= 2.0
    return brentq(excess, 0.0, hi, xtol=1e-12, rtol=1e-14)


def rounds_apart(schedule, bands: int, k: int | None) -> bool:
    """True when every client's participations in ``schedule`` are >= bands apart and at most k."""
    seen: dict[int, list[int]] = {}
    for r, cohort in enumerate(schedule):
        for i in cohort:
            seen.setdefault(int(i), []).append(r)
    return all(
        all(b - a >= bands for a, b in zip(v, v[1:], strict=False)) and (k is None or len(v) <= k)
        for v in seen.values()
    )


RANDOM_COEFS = (1.3, -0.7, 0.4, 0.25, -0.1)  # mixed signs; |roots| > 1, so C^{-1} is stable
#: A banded-MF accountant counts rounds; q and z belong to independent noise.
ROUND = RoundEvent(1.0, 1.0)


# ---------------------------------------------------------------------------------------------- coefficients
def test_default_coefficients_are_binomials_and_the_untruncated_square_root_of_the_prefix_matrix() -> None:
    coefs = sqrt_prefix_coefficients(12)
    assert coefs == tuple(float(Fraction(math.comb(2 * j, j), 4**j)) for j in range(12))  # exact
    c = dense_c(coefs, 12)  # b = K: not truncated
    np.testing.assert_allclose(c @ c, np.tril(np.ones((12, 12))), rtol=0, atol=1e-12)


def test_toeplitz_matrix_is_the_banded_lower_triangular_toeplitz() -> None:
    for coefs, k in [(sqrt_prefix_coefficients(3), 7), (RANDOM_COEFS, 9), ((2.0,), 4)]:
        np.testing.assert_array_equal(toeplitz_matrix(coefs, k), dense_c(coefs, k))


# ----------------------------------------------------------------------------------------------- sensitivity
@pytest.mark.parametrize("coef_kind", ["default", "mixed-sign"])
def test_closed_form_sensitivity_equals_brute_force_for_every_small_run(coef_kind: str) -> None:
    """Every K <= 12, b <= min(K, 5), k in {None, 1, 2, 3}: closed form = brute force (bounds meet) to 1e-9."""
    for num_rounds in range(1, 13):
        for bands in range(1, min(num_rounds, 5) + 1):
            coefs = sqrt_prefix_coefficients(bands) if coef_kind == "default" else RANDOM_COEFS[:bands]
            c = dense_c(coefs, num_rounds)
            for k in (None, 1, 2, 3):
                lo, hi = brute_sensitivity_squared(c, bands, k)
                assert hi == pytest.approx(lo, rel=1e-12), (num_rounds, bands, k)  # disjoint columns: exact
                clip = 0.7
                closed = minsep_sensitivity(coefs, num_rounds, k, clip=clip)
                assert closed == pytest.approx(clip * math.sqrt(lo), rel=0, abs=1e-9), (num_rounds, bands, k)
                module_bf = brute_force_sensitivity(coefs, num_rounds, bands, k, clip=clip)
                assert module_bf.exact and module_bf.lower == pytest.approx(closed, abs=1e-9)


def test_disjoint_columns_formula_under_estimates_participations_closer_than_b() -> None:
    """The mis-computation the auditor must catch: sum of squared column norms over a pattern 2 rounds apart, b = 4."""
    coefs, num_rounds = sqrt_prefix_coefficients(4), 10
    c = dense_c(coefs, num_rounds)
    lo, _ = brute_sensitivity_squared(c, 2, None)  # what a client 2 rounds apart can really do
    wrong = float(np.sum(column_norms_squared(coefs, num_rounds)[::2]))  # disjoint-columns formula on 0, 2, 4, ...
    assert lo > 1.5 * wrong
    bounds = brute_force_sensitivity(coefs, num_rounds, 2)  # the module's brute force sees it too
    assert bounds.lower**2 == pytest.approx(lo, rel=1e-12) and bounds.worst_pattern == (0, 2, 4, 6, 8)


def test_prefix_sensitivity_is_that_of_the_leading_block() -> None:
    coefs = sqrt_prefix_coefficients(4)
    for rounds in range(1, 11):
        lo, _ = brute_sensitivity_squared(dense_c(coefs, 10)[:rounds, :rounds], 4, 2)
        params = BandedMFParams(coefs, 10, "min-separation", 2, clip=1.0, noise_std=1.0, delta=1e-5)
        assert params.sensitivity(rounds) == pytest.approx(math.sqrt(lo), abs=1e-9)


@needs_jax_privacy
def test_sensitivity_agrees_with_jax_privacy() -> None:
    import jax
    import jax.numpy as jnp
    from jax_privacy.matrix_factorization import toeplitz as jtoeplitz

    with jax.enable_x64(True):
        for num_rounds, bands, k in [(12, 3, None), (12, 4, 2), (10, 1, 5), (200, 4, None), (200, 7, 10), (50, 50, 1)]:
            coefs = sqrt_prefix_coefficients(bands)
            theirs = float(
                jtoeplitz.minsep_sensitivity_squared(jnp.asarray(coefs), bands, n=num_rounds, max_participations=k)
            )
            ours = minsep_sensitivity(coefs, num_rounds, k) ** 2
            assert ours == pytest.approx(theirs, rel=1e-6), (num_rounds, bands, k)
    # float32, as the issue states jax computes by default
    theirs32 = float(jtoeplitz.minsep_sensitivity_squared(jnp.asarray(sqrt_prefix_coefficients(4)), 4, n=12))
    assert minsep_sensitivity(sqrt_prefix_coefficients(4), 12) ** 2 == pytest.approx(theirs32, rel=1e-6)


# ---------------------------------------------------------------------------------------------- noise stream
def _stream_rounds(coefs, num_rounds: int, dim: int, sigma: float, seed: int) -> np.ndarray:
    stream = BandedNoiseStream(coefs, dim, sigma)
    return np.stack([stream.next(k, make_rng(seed, Stream.SERVER_NOISE, k)) for k in range(num_rounds)])


@pytest.mark.parametrize("coefs", [sqrt_prefix_coefficients(3), RANDOM_COEFS[:4]])
def test_streamed_noise_is_c_inverse_times_the_drawn_gaussians(coefs) -> None:
    """The recurrence equals a dense triangular solve of the same Z (to rounding)."""
    num_rounds, dim, sigma, seed = 9, 50, 2.0, 3
    z = np.stack([make_rng(seed, Stream.SERVER_NOISE, k).standard_normal(dim) * sigma for k in range(num_rounds)])
    expected = solve_triangular(dense_c(coefs, num_rounds), z, lower=True)
    np.testing.assert_allclose(_stream_rounds(coefs, num_rounds, dim, sigma, seed), expected, rtol=1e-12, atol=1e-12)


def test_a_caller_modifying_the_released_noise_does_not_change_later_rounds() -> None:
    coefs, dim = sqrt_prefix_coefficients(3), 16
    expected = _stream_rounds(coefs, 6, dim, 1.0, 9)
    stream = BandedNoiseStream(coefs, dim, 1.0)
    for k in range(6):
        w = stream.next(k, make_rng(9, Stream.SERVER_NOISE, k))
        np.testing.assert_array_equal(w, expected[k])
        w *= 1e6  # e.g. a caller that scales the noise in place


@pytest.mark.parametrize("coefs", [sqrt_prefix_coefficients(3), RANDOM_COEFS[:4]])
def test_streamed_noise_covariance_is_sigma_squared_c_inverse_c_inverse_transposed(coefs) -> None:
    """Empirical covariance over 5 seeds x 4000 coordinates (N = 20000 samples of the K-vector) within 5 SE.

    For zero-mean Gaussians, the entry ``mean(w_i w_j)`` has variance ``(S_ii S_jj + S_ij^2) / N``.
    """
    num_rounds, dim, sigma = 8, 4000, 1.5
    samples = np.concatenate([_stream_rounds(coefs, num_rounds, dim, sigma, seed).T for seed in range(5)])
    n = samples.shape[0]
    empirical = samples.T @ samples / n
    c_inv = solve_triangular(dense_c(coefs, num_rounds), np.eye(num_rounds), lower=True)
    theory = sigma**2 * c_inv @ c_inv.T
    se = np.sqrt((np.outer(np.diag(theory), np.diag(theory)) + theory**2) / n)
    z_scores = np.abs(empirical - theory) / se
    assert z_scores.max() < 5.0, z_scores.max()
    assert not np.allclose(theory, np.diag(np.diag(theory)))  # the noise really is correlated


def test_b1_releases_exactly_todays_server_noise() -> None:
    """b = 1 (c_0 = 1) with full participation: the same generators give bit for bit today's released noise."""
    dim, z, clip, n, seed = 37, 1.3, 2.0, 5, 11
    stream = BandedNoiseStream(sqrt_prefix_coefficients(1), dim, z * clip)
    for k in range(6):
        ours = stream.next(k, make_rng(seed, Stream.SERVER_NOISE, k))
        todays = released_sum(
            np.zeros((n, dim)),
            SERVER,
            noise_multiplier=z,
            clip=clip,
            clients_per_round=float(n),
            num_sampled=n,
            client_rngs=[make_rng(seed, Stream.NOISE, k, i) for i in range(n)],
            server_rng=make_rng(seed, Stream.SERVER_NOISE, k),
        )
        np.testing.assert_array_equal(ours, todays)
        np.testing.assert_array_equal(ours, gaussian_noise(dim, z * clip, make_rng(seed, Stream.SERVER_NOISE, k)))


def test_b1_full_participation_spends_todays_epsilon() -> None:
    """b = 1, everyone every round: one Gaussian with sensitivity clip sqrt(K) is K rounds of multiplier z."""
    z, clip, rounds, delta = 1.7, 3.0, 40, 1e-6
    rule = ParticipationRule("cyclic", 10, 1, rounds)
    params = BandedMFParams.from_rule(rule, sqrt_prefix_coefficients(1), clip=clip, noise_std=z * clip, delta=delta)
    assert banded_mf_epsilon(params, rounds) == pytest.approx(epsilon_for(z, 1.0, rounds, delta, "pld"), rel=1e-6)
    assert params.sensitivity() == pytest.approx(clip * math.sqrt(rounds), rel=1e-15)


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_b1_calibrates_todays_sigma(kind: str) -> None:
    """b = 1: the calibrated sigma is today's z C for full participation and for Poisson sampling (same trajectory)."""
    full = calibrate_noise_std(
        5.0, ParticipationRule("cyclic", 100, 1, 200), (1.0,), clip=50.0, delta=1e-6, accountant=kind
    )
    assert full == calibrate_noise_multiplier(5.0, 1e-6, 1.0, 200, kind) * 50.0
    rule = ParticipationRule("cyclic-poisson", 100, 1, 20, sampling_probability=0.2)
    sampled = calibrate_noise_std(2.0, rule, (1.0,), clip=2.0, delta=1e-5, accountant=kind)
    assert sampled == calibrate_noise_multiplier(2.0, 1e-5, 0.2, 20, kind) * 2.0


def test_zero_noise_std_draws_nothing() -> None:
    rng = np.random.default_rng(0)
    before = rng.bit_generator.state
    assert not BandedNoiseStream((1.0, 0.5), 4, 0.0).next(0, rng).any()
    assert rng.bit_generator.state == before


def _npz_round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    np.savez(buffer, **{k: np.asarray(v) for k, v in state.items()})
    buffer.seek(0)
    with np.load(buffer) as data:
        return {k: data[k] for k in data.files}


def test_noise_stream_resume_is_bit_identical() -> None:
    coefs, dim, sigma, seed = sqrt_prefix_coefficients(4), 64, 0.9, 5
    straight = _stream_rounds(coefs, 12, dim, sigma, seed)
    first = BandedNoiseStream(coefs, dim, sigma)
    for k in range(7):
        first.next(k, make_rng(seed, Stream.SERVER_NOISE, k))
    state = _npz_round_trip(first.state_dict())
    resumed = BandedNoiseStream(coefs, dim, sigma)
    resumed.load_state_dict(state)
    rest = np.stack([resumed.next(k, make_rng(seed, Stream.SERVER_NOISE, k)) for k in range(7, 12)])
    np.testing.assert_array_equal(rest, straight[7:])
    with pytest.raises(ValueError, match="asked for round 3"):
        resumed.next(3, make_rng(seed, Stream.SERVER_NOISE, 3))


@pytest.mark.parametrize("dim", [1, 12, 111, 1000, 100_000])
def test_noise_norm_bounds_contain_the_chi_quantiles(dim: int) -> None:
    """The closed-form bounds hold at least as much as scipy's exact chi quantiles at p = 1e-12 on each side."""
    std, p = 0.7, 1e-12
    low, high = noise_norm_bounds(std, dim, p)
    assert 0 <= low <= std * chi.ppf(p, dim) and high >= std * chi.isf(p, dim)
    assert high <= 1.5 * std * chi.isf(p, dim)  # and not so loose that a x1.5 edit passes at large d
    if dim >= 1000:
        assert low >= std * chi.ppf(p, dim) / 1.5


def test_the_noise_buffer_law_uses_the_rows_of_c_inverse() -> None:
    """e_t are the entries of C^{-1} (scipy's triangular solve); honest buffers pass at every round, edits do not."""
    coefs, dim, sigma = sqrt_prefix_coefficients(4), 40, 0.9
    c = toeplitz_matrix(coefs, 12)
    np.testing.assert_allclose(inverse_coefficients(coefs, 12), solve_triangular(c, np.eye(12), lower=True)[:, 0],
                               rtol=1e-12, atol=1e-15)  # fmt: skip
    for seed in range(20):
        stream = BandedNoiseStream(coefs, dim, sigma)
        for k in range(12):
            stream.next(k, make_rng(seed, Stream.SERVER_NOISE, k))
            BandedNoiseStream(coefs, dim, sigma).load_state_dict(_npz_round_trip(stream.state_dict()))
    state = _npz_round_trip(stream.state_dict())
    for history in [state["history"] * 1e6, np.full_like(state["history"], 1e300), state["history"] * 0]:
        with pytest.raises(ValueError, match="noise buffer"):
            BandedNoiseStream(coefs, dim, sigma).load_state_dict({**state, "history": history})
    early = BandedNoiseStream(coefs, dim, sigma)
    early.next(0, make_rng(0, Stream.SERVER_NOISE, 0))  # rows of rounds before 0 must be 0
    early_state = early.state_dict()
    early_state["history"][2] = 1e-3
    with pytest.raises(ValueError, match="there is no round before 0"):
        BandedNoiseStream(coefs, dim, sigma).load_state_dict(early_state)


def test_resuming_with_a_different_strategy_is_refused() -> None:
    stream = BandedNoiseStream(sqrt_prefix_coefficients(3), 8, 1.0)
    stream.next(0, np.random.default_rng(0))
    state = stream.state_dict()
    with pytest.raises(ValueError, match="strategy-coefficients"):
        BandedNoiseStream((1.0, 0.4, 0.3), 8, 1.0).load_state_dict(state)
    with pytest.raises(ValueError, match="sigma"):
        BandedNoiseStream(sqrt_prefix_coefficients(3), 8, 2.0).load_state_dict(state)
    rule = ParticipationRule("cyclic", 12, 3, 9)
    acc = BandedMFAccountant(BandedMFParams.from_rule(rule, (1.0, 0.5, 0.375), clip=1.0, noise_std=4.0, delta=1e-5))
    acc.step(ROUND, 2)
    other = BandedMFAccountant(BandedMFParams.from_rule(rule, (1.0, 0.4, 0.3), clip=1.0, noise_std=4.0, delta=1e-5))
    with pytest.raises(ValueError, match="strategy_coefficients"):
        other.load_state_dict(acc.state_dict())
    same = BandedMFAccountant(acc.params)
    same.load_state_dict(json.loads(json.dumps(acc.state_dict())))  # the checkpoint stores it as JSON
    assert same.rounds == 2 and same.epsilon == acc.epsilon > 0


# ------------------------------------------------------------------------------------------------ participation
def test_cyclic_asks_group_k_mod_b_and_keeps_the_rule() -> None:
    rule = ParticipationRule("cyclic", 10, 3, 11)
    tracker = ParticipationTracker(rule)
    schedule = [tracker.select(k) for k in range(11)]
    for k, cohort in enumerate(schedule):
        np.testing.assert_array_equal(cohort, [i for i in range(10) if i % 3 == k % 3])
    assert rounds_apart(schedule, 3, math.ceil(11 / 3))
    check_schedule(schedule, 3, rule.participations)


def test_min_separation_never_asks_a_client_outside_the_rule() -> None:
    """Random connectivity, capped cohorts: every asked client was connected and the schedule keeps (k, b)."""
    n, b, k, rounds = 30, 4, 3, 40
    rule = ParticipationRule("min-separation", n, b, rounds, max_participations=k, max_cohort=6)
    assert rule.adjacency is Neighbouring.ZERO_OUT  # a cap couples clients
    tracker = ParticipationTracker(rule)
    avail_rng = np.random.default_rng(7)
    schedule = []
    for r in range(rounds):
        connected = np.flatnonzero(avail_rng.random(n) < 0.6)
        cohort = tracker.select(r, make_rng(0, Stream.SAMPLING, r), available=connected)
        assert set(cohort) <= set(connected) and len(cohort) <= 6
        schedule.append(cohort)
    assert rounds_apart(schedule, b, k)
    assert sum(map(len, schedule)) > 0.8 * n * k  # the gate does not starve the run: most clients reach k
    check_schedule(schedule, b, k)


def test_the_gate_refuses_a_cohort_that_breaks_the_rule() -> None:
    tracker = ParticipationTracker(ParticipationRule("min-separation", 6, 3, 12, max_participations=2))
    tracker.admit(0, [0, 1])
    with pytest.raises(ParticipationError, match="client 0 may not take part.*last took part in round 0"):
        tracker.admit(1, [0, 2])
    tracker.admit(1, [2])  # the refused cohort was not recorded
    tracker.admit(2, [])
    tracker.admit(3, [0])
    tracker.admit(4, [])
    tracker.admit(5, [])
    with pytest.raises(ParticipationError, match="already 2 participations"):
        tracker.admit(6, [0])
    with pytest.raises(ParticipationError, match="at round 6, asked to admit round 8"):
        tracker.admit(8, [3])
    cyclic = ParticipationTracker(ParticipationRule("cyclic", 6, 3, 12))
    with pytest.raises(ParticipationError, match="its group is 1, round 0 asks group 0"):
        cyclic.admit(0, [0, 1])


def test_check_schedule_refuses_close_or_too_many_participations() -> None:
    with pytest.raises(ParticipationError, match="client 2 takes part in rounds 1 and 3, 2 apart"):
        check_schedule([[1], [2], [], [2]], bands=3)
    with pytest.raises(ParticipationError, match="client 1 takes part 3 times"):
        check_schedule([[1], [], [1], [], [1]], bands=2, max_participations=2)
    assert check_schedule([[1], [], [1]], bands=2, max_participations=2) == {1: [0, 2]}


def test_cyclic_poisson_samples_inside_the_group_at_rate_p() -> None:
    n, b, p, rounds = 400, 4, 0.25, 80
    tracker = ParticipationTracker(ParticipationRule("cyclic-poisson", n, b, rounds, sampling_probability=p))
    total = 0
    for r in range(rounds):
        cohort = tracker.select(r, make_rng(1, Stream.SAMPLING, r))
        assert np.all(cohort % b == r % b)
        total += len(cohort)
    trials = rounds * n // b
    assert abs(total / trials - p) < 5 * math.sqrt(p * (1 - p) / trials)  # 5 standard errors


def test_cyclic_poisson_with_one_band_is_todays_poisson_sampling() -> None:
    n, q = 50, 0.3
    tracker = ParticipationTracker(ParticipationRule("cyclic-poisson", n, 1, 5, sampling_probability=q))
    for r in range(5):
        ours = tracker.select(r, make_rng(2, Stream.SAMPLING, r))
        np.testing.assert_array_equal(ours, poisson_sample(n, q, make_rng(2, Stream.SAMPLING, r)))


def test_tracker_resume_is_identical() -> None:
    rule = ParticipationRule("min-separation", 20, 3, 15, max_participations=4, max_cohort=4)
    avail = [np.flatnonzero(np.random.default_rng(r).random(20) < 0.5) for r in range(15)]

    def run(tracker, rounds):
        return [tracker.select(r, make_rng(4, Stream.SAMPLING, r), avail[r]).tolist() for r in rounds]

    straight = run(ParticipationTracker(rule), range(15))
    first = ParticipationTracker(rule)
    run(first, range(8))
    second = ParticipationTracker(rule)
    second.load_state_dict(_npz_round_trip(first.state_dict()))
    assert run(second, range(8, 15)) == straight[8:]
    with pytest.raises(ValueError, match="participation rule"):
        ParticipationTracker(ParticipationRule("min-separation", 20, 3, 15, max_cohort=4)).load_state_dict(
            first.state_dict()
        )


def _zeroed(state: dict) -> dict:
    """A participation history edited to 'nobody ever took part', at the same position."""
    return {**state, "cohort_ids": state["cohort_ids"][:0], "cohort_sizes": np.zeros_like(state["cohort_sizes"])}


@pytest.mark.parametrize("scheme", ["min-separation", "cyclic"])
def test_edited_participation_history_is_refused_since_it_would_break_the_rule(scheme: str) -> None:
    """Emptying the history lets clients asked in the last b - 1 rounds be asked again at once: the checker
    (independent of the tracker) sees the rule broken. Checked against each round's cohort size, the load refuses."""
    cap = 4 if scheme == "min-separation" else None
    rule = ParticipationRule(scheme, 20, 3, 15, max_cohort=cap)
    first = ParticipationTracker(rule)
    schedule = [first.select(r, make_rng(4, Stream.SAMPLING, r)).tolist() for r in range(8)]
    sizes = [len(c) for c in schedule]
    edited = _npz_round_trip(_zeroed(first.state_dict()))
    blind = ParticipationTracker(rule)
    blind.load_state_dict(edited)  # without the cohort sizes the edit is a consistent state
    if scheme == "min-separation":
        with pytest.raises(ParticipationError):
            check_schedule(schedule + [blind.select(8, make_rng(4, Stream.SAMPLING, 8)).tolist()], bands=3)
    with pytest.raises(ValueError, match="but the rounds asked"):
        ParticipationTracker(rule).load_state_dict(edited, cohort_sizes=sizes)
    ParticipationTracker(rule).load_state_dict(_npz_round_trip(first.state_dict()), cohort_sizes=sizes)  # genuine


def test_participation_history_checks_catch_each_inconsistency() -> None:
    rule = ParticipationRule("min-separation", 12, 3, 12, max_participations=3)
    tracker = ParticipationTracker(rule)
    schedule = [tracker.select(r, available=np.flatnonzero(np.random.default_rng(r).random(12) < 0.6)).tolist()
                for r in range(7)]  # fmt: skip
    sizes = [len(c) for c in schedule]
    assert tracker.history_errors(tracker.last_round, tracker.count, 7, sizes) == []
    last, count = tracker.last_round.copy(), tracker.count.copy()
    recent = next(i for i in schedule[6] if count[i] <= 2)  # asked in the last round
    moved = last.copy()
    moved[recent] = (count[recent] - 1) * 3  # "last took part rounds earlier": eligible again at once
    cases = {
        "count outside": (last, np.where(np.arange(12) == recent, 9, count), sizes),
        "last round not in": (np.where(np.arange(12) == recent, 7, last), count, sizes),
        "took part iff": (np.where(np.arange(12) == recent, -1, last), count, sizes),
        "cannot fit": (last, np.where(last >= 0, np.minimum(count + 2, 3), count), None),
        "have it as last round": (moved, count, sizes),
        "has completed 6 rounds": (last, count, sizes[:6]),
    }
    for what, (l_, c_, s_) in cases.items():
        errors = tracker.history_errors(np.asarray(l_), np.asarray(c_), 7, s_)
        assert any(what in e for e in errors), (what, errors)
    cyclic = ParticipationTracker(ParticipationRule("cyclic", 12, 3, 12))
    for r in range(4):
        cyclic.select(r)
    last = cyclic.last_round.copy()
    last[0] = 1  # client 0 is in group 0: rounds 0, 3, ...
    assert any("cyclic group" in e for e in cyclic.history_errors(last, cyclic.count, 4))


@pytest.mark.parametrize("seed", range(5))
def test_participation_history_of_real_runs_passes_its_checks(seed: int) -> None:
    """No false alarm: histories the tracker writes (random availability, caps, Poisson groups) all pass."""
    rng = np.random.default_rng(seed)
    for rule in (
        ParticipationRule("min-separation", 30, 4, 20, max_participations=3, max_cohort=5),
        ParticipationRule("cyclic-poisson", 30, 3, 20, sampling_probability=0.4),
        ParticipationRule("cyclic", 31, 5, 20),
    ):
        tracker, sizes = ParticipationTracker(rule), []
        for r in range(20):
            available = np.flatnonzero(rng.random(30) < 0.7)
            sizes.append(len(tracker.select(r, make_rng(seed, Stream.SAMPLING, r), available)))
            assert tracker.history_errors(tracker.last_round, tracker.count, r + 1, sizes) == [], (rule, r)
        replayed = ParticipationTracker(rule)  # the counts follow from the recorded cohorts
        replayed.load_state_dict(_npz_round_trip(tracker.state_dict()), cohort_sizes=sizes)
        np.testing.assert_array_equal(replayed.count, tracker.count)
        np.testing.assert_array_equal(replayed.last_round, tracker.last_round)


# --------------------------------------------------------------------------------------------------- accounting
@pytest.mark.parametrize(
    ("scheme", "n", "bands", "rounds", "k"),
    [
        ("cyclic", 100, 4, 200, None),
        ("min-separation", 100, 5, 60, 3),
        ("cyclic", 10, 1, 30, None),
        ("cyclic", 9, 3, 10, None),
    ],
)
def test_epsilon_is_the_gaussian_dp_epsilon_of_the_recorded_sensitivity(scheme, n, bands, rounds, k) -> None:
    """A reader with config.json's numbers and scipy gets the reported epsilon (PLD is pessimistic: >= exact)."""
    rule = ParticipationRule(scheme, n, bands, rounds, max_participations=k)
    params = BandedMFParams.from_rule(rule, sqrt_prefix_coefficients(bands), clip=2.5, noise_std=9.0, delta=1e-6)
    record = banded_mf_record(params)
    exact = gdp_epsilon(record["sensitivity"] / record["noise_std"], record["delta"])
    assert exact <= record["epsilon"] <= exact + 1e-3
    # the recorded sensitivity is the dense C's worst pattern 0, b, 2b, ... (whose Gram block is diagonal)
    c = dense_c(record["strategy_coefficients"], record["num_rounds"])
    cols = c[:, 0 : record["bands"] * record["max_participations"] : record["bands"]]
    gram = cols.T @ cols
    np.testing.assert_allclose(gram, np.diag(np.diag(gram)), atol=1e-15)
    assert record["sensitivity"] == pytest.approx(record["clip"] * math.sqrt(np.trace(gram)), rel=1e-12)
    rdp = BandedMFParams.from_rule(
        rule, sqrt_prefix_coefficients(bands), clip=2.5, noise_std=9.0, delta=1e-6, accountant="rdp"
    )
    assert banded_mf_epsilon(rdp, rounds) >= exact


def test_epsilon_grows_with_the_rounds_released() -> None:
    rule = ParticipationRule("cyclic", 40, 4, 24)
    acc = BandedMFAccountant(
        BandedMFParams.from_rule(rule, sqrt_prefix_coefficients(4), clip=1.0, noise_std=3.0, delta=1e-5)
    )
    assert acc.epsilon == 0.0
    eps = []
    for _ in range(24):
        acc.step(ROUND)
        eps.append(acc.epsilon)
    assert all(b >= a for a, b in zip(eps, eps[1:], strict=False)) and eps[-1] > eps[0] > 0
    with pytest.raises(ValueError, match="num-rounds = 24"):
        acc.step(ROUND)


def test_calibrated_noise_meets_the_target_tightly() -> None:
    rule = ParticipationRule("cyclic", 100, 4, 200)
    coefs = sqrt_prefix_coefficients(4)
    sigma = calibrate_noise_std(5.0, rule, coefs, clip=1.0, delta=1e-6)
    delta_ = minsep_sensitivity(coefs, 200, None, 1.0)
    assert gdp_epsilon(delta_ / sigma, 1e-6) <= 5.0
    assert gdp_epsilon(delta_ / (sigma * 0.997), 1e-6) > 5.0  # within rel_tol = 1e-3 of the exact sigma (+ PLD slack)


def test_amplified_epsilon_is_the_cyclic_poisson_reduction() -> None:
    """cyclic-poisson: a reader composes ceil(K/b) Poisson-subsampled Gaussians from the record alone."""
    rule = ParticipationRule("cyclic-poisson", 1000, 4, 102, sampling_probability=0.2)
    coefs = sqrt_prefix_coefficients(4)
    sigma = calibrate_noise_std(4.0, rule, coefs, clip=1.5, delta=1e-5)
    record = banded_mf_record(BandedMFParams.from_rule(rule, coefs, clip=1.5, noise_std=sigma, delta=1e-5))
    steps = math.ceil(102 / 4)  # group 0 is asked in rounds 0, 4, ..., 100
    assert record["epsilon"] <= 4.0 and record["steps_per_client"] == steps == 26
    z = record["noise_std"] / (record["clip"] * math.sqrt(sum(c * c for c in record["strategy_coefficients"])))
    reader = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    reader.compose(
        dp_accounting.PoissonSampledDpEvent(record["sampling_probability"], dp_accounting.GaussianDpEvent(z)), steps
    )
    assert record["epsilon"] == pytest.approx(reader.get_epsilon(record["delta"]), rel=1e-2)
    # amplification pays: the same sigma without it would spend far more
    plain = gdp_epsilon(record["sensitivity"] / sigma, 1e-5)
    assert plain > 2 * record["epsilon"]


def test_amplified_with_one_band_is_todays_poisson_accounting() -> None:
    z, q, rounds = 1.1, 0.1, 50
    rule = ParticipationRule("cyclic-poisson", 100, 1, rounds, sampling_probability=q)
    params = BandedMFParams.from_rule(rule, (1.0,), clip=2.0, noise_std=2.0 * z, delta=1e-5)
    assert banded_mf_epsilon(params, rounds) == pytest.approx(epsilon_for(z, q, rounds, 1e-5, "pld"), rel=1e-6)


@needs_jax_privacy
def test_amplified_epsilon_agrees_with_jax_privacy_accountant() -> None:
    from jax_privacy.accounting import accountants, analysis

    n, bands, rounds, p = 1000, 4, 102, 0.2  # 102 = 25 b + 2: ceil(K / b) = 26 steps
    rule = ParticipationRule("cyclic-poisson", n, bands, rounds, sampling_probability=p)
    coefs = sqrt_prefix_coefficients(bands)
    params = BandedMFParams.from_rule(rule, coefs, clip=1.0, noise_std=1.6, delta=1e-5)
    theirs = analysis.DpsgdTrainingAccountant(accountants.PldAccountantConfig(value_discretization_interval=1e-4))
    dp_params = analysis.DpParams(
        noise_multipliers=params.amplified_noise_multiplier,
        num_samples=n,
        delta=1e-5,
        batch_size=int(p * n / bands),  # q = batch / (n // cycle_length) = p
        cycle_length=bands,
    )
    assert banded_mf_epsilon(params, rounds) == pytest.approx(theirs.compute_epsilon(rounds, dp_params), rel=1e-2)


def test_record_holds_what_the_issue_lists() -> None:
    rule = ParticipationRule("min-separation", 50, 2, 20, max_participations=4)
    record = banded_mf_record(BandedMFParams.from_rule(rule, (1.0, 0.5), clip=1.0, noise_std=2.0, delta=1e-5))
    for key in ("bands", "strategy_coefficients", "participation", "max_participations", "sensitivity", "noise_std"):
        assert key in record
    assert record["bands"] == 2 and record["max_participations"] == 4 and record["participation"] == "min-separation"
    # every eligible connected client: nobody's presence moves another
    assert record["adjacency"] == Neighbouring.ADD_REMOVE.value
    capped = ParticipationRule("min-separation", 50, 2, 20, max_participations=4, max_cohort=10)
    params = BandedMFParams.from_rule(capped, (1.0, 0.5), clip=1.0, noise_std=2.0, delta=1e-5)
    assert banded_mf_record(params)["adjacency"] == Neighbouring.ZERO_OUT.value
    assert json.loads(json.dumps(record)) == record


# ---------------------------------------------------------------------------------------------- default b
@pytest.mark.parametrize(
    ("n", "r", "rounds", "expected"),
    [(100, 25.0, 200, 4), (100, 100.0, 200, 1), (100, 100 / 3, 200, 3), (3000, 600.0, 100, 5), (100, 1.0, 10, 10)],
)
def test_default_bands(n: int, r: float, rounds: int, expected: int) -> None:
    assert default_bands(n, r, rounds) == expected
    ParticipationRule("cyclic", n, expected, rounds).check_cohort_size(min(r, n / expected))


# ------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: sqrt_prefix_coefficients(0), r"bands = 0: .* >= 1"),
        (lambda: ParticipationRule("cyclic", 10, -1, 5), r"bands = -1: .* >= 1"),
        (lambda: ParticipationRule("cyclic", 10, 2.5, 5), r"bands = 2.5: must be an integer"),
        (lambda: ParticipationRule("cyclic", 10, 6, 5), r"bands = 6 exceeds num-rounds = 5"),
        (lambda: check_coefficients((1.0, 0.5, 0.2), num_rounds=2), r"bands = 3 exceeds num-rounds = 2"),
        (lambda: check_coefficients(()), r"bands = 0"),
        (lambda: check_coefficients((0.0, 1.0)), r"c_0 = 0 makes C singular"),
        (lambda: check_coefficients((1.0, float("nan"))), r"must be finite"),
        (lambda: BandedNoiseStream((0.0,), 3, 1.0), r"singular"),
        (lambda: ParticipationRule("round-robin", 10, 2, 5), r"participation = 'round-robin': allowed 'cyclic'"),
        (lambda: ParticipationRule("cyclic", 3, 4, 8), r"num-clients = 3 in bands = 4 cyclic groups leaves 0"),
        (lambda: ParticipationRule("cyclic", 7, 4, 8, min_group_size=2), r"leaves 1 client.*at least 2 per group"),
        (lambda: ParticipationRule("cyclic", 8, 2, 8, max_participations=3), r"max-participations = 3 .* >= 4"),
        (lambda: ParticipationRule("cyclic", 8, 2, 8, sampling_probability=0.5), r"only 'cyclic-poisson' samples"),
        (lambda: ParticipationRule("cyclic-poisson", 8, 2, 8, sampling_probability=0.0), r"0 < p <= 1"),
        (lambda: ParticipationRule("min-separation", 8, 2, 8, max_participations=0), r"max-participations = 0"),
        (lambda: ParticipationRule("cyclic", 8, 2, 8, max_cohort=3), r"max-cohort = 3 .* only 'min-separation'"),
        (lambda: ParticipationRule("min-separation", 8, 2, 8, max_cohort=0), r"max-cohort = 0"),
        (
            lambda: ParticipationRule("min-separation", 20, 4, 8).check_cohort_size(6.0),
            r"clients-per-round = 6 .* bands <= 3",
        ),
        (lambda: default_bands(10, 20.0, 5), r"clients-per-round = 20.0"),
        (
            lambda: BandedMFParams.from_rule(
                ParticipationRule("cyclic", 8, 2, 8), (1.0,), clip=1, noise_std=1, delta=1e-5
            ),
            r"strategy-coefficients has 1 entries but bands = 2",
        ),
        (lambda: minsep_sensitivity((1.0, 0.5), 6, max_participations=0), r"max-participations = 0"),
    ],
)
def test_bad_input_raises_one_clear_error(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_unstable_inverse_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dpfedavg.core.banded_mf"):
        check_coefficients((1.0, 3.0))  # root -1/3: C^{-1} has entries (-3)^k
        check_coefficients(sqrt_prefix_coefficients(6))
    assert len(caplog.records) == 1 and "blow up" in caplog.records[0].getMessage()


# ------------------------------------------------------------------------------------- optimized coefficients
@needs_jax_privacy
def test_optimized_coefficients_from_jax_privacy_are_valid_and_cached() -> None:
    import jax.numpy as jnp
    from jax_privacy.matrix_factorization import toeplitz as jtoeplitz

    from dpfedavg.core.banded_mf_optimized import optimized_coefficients

    coefs = optimized_coefficients(40, 4)
    assert len(coefs) == 4 and math.isclose(math.fsum(c * c for c in coefs), 1.0, rel_tol=1e-5)
    assert optimized_coefficients(40, 4) is coefs  # cached by (K, b, workload)
    assert all(a >= b > 0 for a, b in itertools.pairwise(coefs))  # jax's sensitivity is then exact, not a bound
    theirs = float(jtoeplitz.minsep_sensitivity_squared(jnp.asarray(coefs), 4, n=40))
    assert minsep_sensitivity(coefs, 40) ** 2 == pytest.approx(theirs, rel=1e-5)

    # and it beats the truncated square root on the workload it was optimized for (mean prefix error x sens^2)
    def loss(c):
        inv = solve_triangular(dense_c(c, 40), np.eye(40), lower=True)
        b = np.tril(np.ones((40, 40))) @ inv
        return np.mean(np.sum(b**2, axis=1)) * minsep_sensitivity(c, 40) ** 2

    assert loss(coefs) < loss(sqrt_prefix_coefficients(4))


def test_optimized_coefficients_without_jax_privacy_say_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from dpfedavg.core import banded_mf_optimized

    banded_mf_optimized._optimize.cache_clear()
    monkeypatch.setitem(sys.modules, "jax_privacy", None)
    monkeypatch.setitem(sys.modules, "jax_privacy.matrix_factorization", None)
    with pytest.raises(ImportError, match=r"pip install jax-privacy==2\.0\.0"):
        banded_mf_optimized.optimized_coefficients(12, 3)
    with pytest.raises(ValueError, match="workload = 'mse'"):
        banded_mf_optimized.optimized_coefficients(12, 3, "mse")
    banded_mf_optimized._optimize.cache_clear()


def test_participation_enum_values() -> None:
    assert [p.value for p in Participation] == ["cyclic", "min-separation", "cyclic-poisson"]


# ------------------------------------------------------------------------------------ the mechanism as one object
def _spec(**overrides) -> BandedMFSpec:
    base = dict(num_clients=100, clients_per_round=25.0, num_rounds=200)
    return BandedMFSpec.build(**{**base, **overrides})


def test_default_mechanism_is_four_cyclic_groups_within_the_target() -> None:
    """The issue's done-when shape: n = 100, r = 25, K = 200, (5, 1e-6): b = 4 cyclic groups, epsilon <= 5."""
    spec = _spec()
    z = calibrate_noise_std(5.0, spec.rule, spec.coefficients, clip=1.0, delta=1e-6)
    mech = BandedMFMechanism(spec, z * 50.0, 20, clip=50.0, delta=1e-6, accountant="pld")
    record = mech.record()
    assert record["bands"] == 4 and record["participation"] == "cyclic" and record["max_participations"] == 50
    assert record["strategy_coefficients"] == [1.0, 0.5, 0.375, 0.3125] and record["denominator"] == 25.0
    assert gdp_epsilon(record["sensitivity"] / record["noise_std"], 1e-6) <= record["epsilon"] <= 5.0
    accountant = BandedMFAccountant(spec.params(noise_std=z, delta=1e-6, accountant="pld"))
    schedule = []
    for k in range(200):
        schedule.append(mech.select(k))
        mech.admit(k, schedule[-1])
        assert len(schedule[-1]) == 25
        mech.server_noise(k, lambda k=k: make_rng(0, Stream.SERVER_NOISE, k))
        accountant.step(ROUND)
    assert rounds_apart(schedule, 4, 50)
    assert accountant.epsilon == pytest.approx(record["epsilon"], rel=1e-12)


def test_mechanism_checkpoint_resumes_bit_identically() -> None:
    spec = _spec(participation="min-separation", max_participations=30, num_rounds=40)
    avail = [np.flatnonzero(np.random.default_rng(r).random(100) < 0.5) for r in range(40)]

    def make(sigma: float = 3.0) -> BandedMFMechanism:
        return BandedMFMechanism(spec, sigma, 16, clip=1.0, delta=1e-6, accountant="pld")

    def run(mech, rounds):
        out = []
        for k in rounds:
            cohort = mech.select(k, make_rng(1, Stream.SAMPLING, k), avail[k])
            mech.admit(k, cohort)
            out.append((cohort.tolist(), mech.server_noise(k, lambda k=k: make_rng(1, Stream.SERVER_NOISE, k))))
        return out

    straight = run(make(), range(40))
    first = make()
    run(first, range(17))
    second = make()
    second.load_state_dict(_npz_round_trip(first.state_dict()))
    for (c1, w1), (c2, w2) in zip(run(second, range(17, 40)), straight[17:], strict=True):
        assert c1 == c2
        np.testing.assert_array_equal(w1, w2)
    assert rounds_apart([c for c, _ in straight], 4, 30)
    with pytest.raises(ValueError, match="sigma"):
        make(3.5).load_state_dict(first.state_dict())


def test_cyclic_poisson_spec_defaults_to_an_expected_cohort_of_r() -> None:
    spec = _spec(participation="cyclic-poisson", bands=2, num_rounds=20)
    assert spec.rule.sampling_probability == pytest.approx(0.5) and spec.rule.amplified
    assert spec.rule.expected_cohort(0) == pytest.approx(25.0) == spec.denominator


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(bands=5), r"clients-per-round = 25 with bands = 5"),
        (dict(bands=0), r"bands = 0"),
        (dict(bands=201), r"'bands' = 201 exceeds 'num-rounds' = 200"),
        (dict(coefficients="0, 1, 0.5, 0.2"), r"singular"),
        (dict(coefficients=(1.0, 0.5), bands=4), r"has 2 number\(s\) but 'bands' = 4"),
        (dict(coefficients="1, x"), r"expected 'sqrt-prefix'"),
        (dict(num_clients=7, clients_per_round=1.0, bands=4, min_group_size=2), r"at least 2"),
    ],
)
def test_spec_settings_raise_one_clear_error(overrides, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _spec(**overrides)


def test_core_modules_are_pure_numpy() -> None:
    """The mechanism's math imports neither Flower, nor dp-accounting, nor jax; the privacy side no Flower or jax."""
    import subprocess

    code = (
        "import sys, dpfedavg.core.banded_mf, dpfedavg.core.participation, dpfedavg.core.banded_mf_optimized\n"
        "assert not {'flwr', 'dp_accounting', 'jax'} & set(sys.modules), 'core'\n"
        "import dpfedavg.privacy.banded_mf_mechanism\n"
        "assert not {'flwr', 'jax'} & set(sys.modules), 'privacy'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
