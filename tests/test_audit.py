"""The privacy auditor (dpfedavg/privacy/audit.py): it catches a placement's variance leak, finds no violation in
the shipped placements, is not toothless, and its exact-epsilon check agrees with closed forms and Monte Carlo."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from legacy_placement import LEGACY_CLIENT
from scipy import optimize, stats

from dpfedavg import calibrate_noise_multiplier, epsilon_for
from dpfedavg.core.mechanism import PLACEMENTS, Neighbouring, released_sum
from dpfedavg.core.server import poisson_sample
from dpfedavg.privacy.audit import (
    AuditSetting,
    delta_of_gaussian_pair,
    epsilon_lower_bound,
    exact_epsilon_gaussian_pair,
    exact_epsilon_variance_leak,
    released_sums_batch,
    run_audit,
)

ROOT = Path(__file__).resolve().parents[1]
CLIP = 50.0
DELTA = 1e-5


def _setting(placement, n: int, r: float, dim: int, rounds: int, epsilon: float) -> AuditSetting:
    z = calibrate_noise_multiplier(epsilon, DELTA, r / n, rounds, "pld")
    return AuditSetting(placement, n, r, dim, rounds, z, CLIP, DELTA)


# ---------------------------------------------------------------- the auditor catches the old leak
@pytest.mark.parametrize(("n", "dim", "rounds", "epsilon"), [(5, 2000, 1, 1.0), (10, 3000, 2, 2.0)])
def test_auditor_catches_legacy_client_variance_leak(n: int, dim: int, rounds: int, epsilon: float) -> None:
    """q = 1, large d, few rounds: the old placement's lower bound exceeds what the old accountant reported.

    The sums' variance differs by a factor n/(n-1) between the neighbours, which a chi-square on d
    coordinates sees at once: the bound is limited only by the 1000 evaluation trials (about 5.6).
    """
    setting = _setting(LEGACY_CLIENT, n, n, dim, rounds, epsilon)
    result = run_audit(setting, 2000, seed=1)
    assert result.epsilon_reported == pytest.approx(epsilon_for(setting.noise_multiplier, 1.0, rounds, DELTA, "pld"))
    assert result.epsilon_reported == pytest.approx(epsilon, rel=2e-3)
    assert result.epsilon_lower_bound > result.epsilon_reported + 3.0
    assert result.epsilon_exact is not None and result.epsilon_exact > 10 * epsilon  # the truth is far worse


# ---------------------------------------------------------------- ... and finds no violation after the fix
@pytest.mark.parametrize(
    ("placement", "n", "r", "dim", "rounds", "epsilon"),
    [
        ("client-calibrated", 5, 5, 2000, 1, 1.0),
        ("server", 5, 5, 2000, 1, 1.0),
        ("client", 5, 5, 2000, 1, 1.0),
        ("client-calibrated", 10, 10, 3000, 2, 2.0),
        ("server", 10, 10, 3000, 2, 2.0),
        ("client", 10, 10, 3000, 2, 2.0),
        ("client-calibrated", 40, 10, 500, 3, 2.0),  # q = 0.25
        ("server", 40, 10, 500, 3, 2.0),
    ],
)
def test_fixed_placements_stay_below_reported(
    placement: str, n: int, r: float, dim: int, rounds: int, epsilon: float
) -> None:
    setting = _setting(placement, n, r, dim, rounds, epsilon)
    assert setting.adjacency is PLACEMENTS[placement].adjacency
    result = run_audit(setting, 2000, seed=1)
    assert result.epsilon_lower_bound <= result.epsilon_reported
    if setting.q == 1.0:  # the pair's exact epsilon is the accountant's (the top-up removes the variance leak)
        assert result.epsilon_exact == pytest.approx(result.epsilon_reported, rel=1e-3)


@pytest.mark.parametrize(("placement", "n", "r"), [("server", 5, 5), ("server", 20, 10), ("client-calibrated", 20, 10)])
def test_auditor_has_teeth_on_a_correct_mechanism(placement: str, n: int, r: float) -> None:
    """z = 0.5, one round: a real (accounted) leak; the bound is well above 0 and below the reported epsilon."""
    setting = AuditSetting(placement, n, r, 500, 1, 0.5, CLIP, DELTA)
    result = run_audit(setting, 2000, seed=3)
    assert 1.5 < result.epsilon_lower_bound <= result.epsilon_reported


def test_bound_is_zero_for_identical_worlds() -> None:
    rng = np.random.default_rng(0)
    test = epsilon_lower_bound(rng.standard_normal(4000), rng.standard_normal(4000), DELTA)
    assert test.epsilon_lower_bound < 0.25


def test_bound_holds_with_its_confidence_on_a_known_pair() -> None:
    """N(0, 1) vs N(1, 1) at delta = 0.1 (exact epsilon 1.16): over 100 repetitions of 2000 trials per world,
    at most 5% of the 95%-confidence lower bounds exceed the truth (none do: the joint Clopper-Pearson
    bound is conservative), and the bound is informative (mean above 0.5)."""
    true = exact_epsilon_gaussian_pair(mean_norm=1.0, var0=1.0, var1=1.0, dim=1, delta=0.1)
    assert true == pytest.approx(_balle_wang_epsilon(1.0, 0.1), rel=1e-3)
    rng = np.random.default_rng(7)
    bounds = np.array(
        [
            epsilon_lower_bound(rng.standard_normal(2000), 1.0 + rng.standard_normal(2000), 0.1).epsilon_lower_bound
            for _ in range(100)
        ]
    )
    assert (bounds > true).mean() <= 0.05
    assert bounds.mean() > 0.5


def test_bound_finds_the_lower_direction() -> None:
    """A statistic that is *smaller* in world 1: the chosen test is "statistic < threshold", and the reported
    rates are those of that test on the evaluation half."""
    rng = np.random.default_rng(1)
    stat0, stat1 = rng.standard_normal(2000), -3.0 + rng.standard_normal(2000)
    test = epsilon_lower_bound(stat0, stat1, DELTA)
    assert test.sign == -1
    assert test.fpr == pytest.approx((stat0[1000:] < test.threshold).mean())
    assert test.fnr == pytest.approx((stat1[1000:] >= test.threshold).mean())
    assert test.epsilon_lower_bound > 2.0


def test_many_clients_are_sampled_in_bounded_chunks() -> None:
    """n = 5000, q = 0.002: the trials are chunked by K max(d, n), not K d alone."""
    setting = AuditSetting("client-calibrated", 5000, 10, 4, 2, 1.0, CLIP, DELTA)
    result = run_audit(setting, 40, seed=0)
    assert result.epsilon_lower_bound <= result.epsilon_reported


# ---------------------------------------------------------------- the batch agrees with released_sum
def _reference_sums(setting: AuditSetting, world: int, trials: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One round per trial through the core's `released_sum()` (the engines' add_noise + top-up)."""
    rng = np.random.default_rng(seed)
    placement, n = setting.placement, setting.num_clients
    t, s = np.empty(trials), np.empty(trials)
    for i in range(trials):
        sampled = poisson_sample(n, setting.q, rng)
        if world == 0 and setting.adjacency is Neighbouring.ADD_REMOVE:
            sampled = sampled[sampled != 0]  # the canary (client 0) is not in world 0's federation
        g = np.zeros((sampled.size, setting.dim))
        if world == 1 and sampled.size and sampled[0] == 0:
            g[0, 0] = setting.clip
        y = released_sum(
            g,
            placement,
            noise_multiplier=setting.noise_multiplier,
            clip=setting.clip,
            clients_per_round=setting.clients_per_round,
            num_sampled=sampled.size,
            client_rngs=rng.spawn(sampled.size),
            server_rng=rng,
        )
        t[i], s[i] = y[0], y @ y
    return t, s


@pytest.mark.parametrize(
    ("placement", "n", "r"),
    [("client-calibrated", 8, 4), ("server", 8, 4), ("client", 5, 5), (LEGACY_CLIENT, 5, 5)],
    ids=["client-calibrated", "server", "client", "legacy-client"],
)
@pytest.mark.parametrize("world", [0, 1])
def test_batch_release_agrees_with_released_sum(placement, n: int, r: float, world: int) -> None:
    """Same law: the means of <y, e_1>, of ||y||^2 and the variance of <y, e_1> agree within 5 standard errors
    (3000 trials each, fixed seeds), and match the analytic means."""
    setting = AuditSetting(placement, n, r, 20, 1, 1.0, 2.0, DELTA)
    trials = 3000
    ref_t, ref_s = _reference_sums(setting, world, trials, seed=11)
    bt, bs = released_sums_batch(setting, world, trials, np.random.default_rng(12))
    bt, bs = bt[:, 0], bs[:, 0]
    for a, b in ((ref_t, bt), (ref_s, bs), ((ref_t - ref_t.mean()) ** 2, (bt - bt.mean()) ** 2)):
        se = math.sqrt(a.var() / a.size + b.var() / b.size)
        assert abs(a.mean() - b.mean()) < 5 * se
    # analytic: E<y, e_1> = P(canary sends) C; E||y||^2 = d E[var] + P(canary sends) C^2
    zc2 = (setting.noise_multiplier * setting.clip) ** 2
    sends = setting.q if world == 1 else 0.0
    if placement is LEGACY_CLIENT:
        var = (n - 1 + world) * zc2 / r  # no top-up: the variance counts the clients
    else:
        var = zc2
    expected_s = setting.dim * var + sends * setting.clip**2
    assert abs(bs.mean() - expected_s) < 5 * bs.std() / math.sqrt(trials)
    assert abs(bt.mean() - sends * setting.clip) < 5 * bt.std() / math.sqrt(trials)


# ---------------------------------------------------------------- the exact epsilon, without the accountant
def test_exact_variance_leak_of_the_default_run() -> None:
    """q = 1, n = r = 100, d = 200, K = 200, z = 13.8671875, C = 50, delta = 1e-6: about 9.5, not 5.0."""
    z = 13.8671875
    exact = exact_epsilon_variance_leak(
        noise_multiplier=z, clip=50.0, clients_per_round=100, num_others=100, dim=200, rounds=200, delta=1e-6
    )
    reported = epsilon_for(z, 1.0, 200, 1e-6, "pld")
    assert 8.5 < exact < 10.5
    assert reported == pytest.approx(5.0, abs=0.05)


def _balle_wang_epsilon(mu: float, delta: float) -> float:
    def excess(eps: float) -> float:
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2) - delta

    return optimize.brentq(excess, 0.0, 200.0, xtol=1e-12)


@pytest.mark.parametrize(("mu", "delta"), [(1.0198, 1e-6), (0.3, 1e-5), (1.0, 1e-5), (3.0, 1e-5)])
def test_exact_epsilon_equal_variances_is_the_gaussian_mechanism(mu: float, delta: float) -> None:
    sigma = CLIP / mu
    ours = exact_epsilon_gaussian_pair(mean_norm=CLIP, var0=sigma**2, var1=sigma**2, dim=500, delta=delta)
    assert ours == pytest.approx(_balle_wang_epsilon(mu, delta), rel=1e-3)


def test_exact_delta_unequal_variances_matches_monte_carlo() -> None:
    """N(0, I_20) vs N(e_1, 1.3 I_20): the integrated delta(eps) (both directions) against 200000 samples each,
    within 0.01 absolute (the Monte Carlo standard error is below 0.002)."""
    rng = np.random.default_rng(5)
    dim, a, b, m, size = 20, 1.0, 1.3, 1.0, 200_000

    def loss(y: np.ndarray) -> np.ndarray:  # log p(y) - log q(y)
        return (
            dim / 2 * math.log(b / a)
            - (y**2).sum(1) / (2 * a)
            + ((y[:, 0] - m) ** 2 + (y[:, 1:] ** 2).sum(1)) / (2 * b)
        )

    yp = rng.standard_normal((size, dim)) * math.sqrt(a)
    yq = rng.standard_normal((size, dim)) * math.sqrt(b)
    yq[:, 0] += m
    lp, lq = loss(yp), -loss(yq)
    for eps in (0.5, 1.0, 2.0):
        mc = max(np.maximum(1 - np.exp(eps - lp), 0).mean(), np.maximum(1 - np.exp(eps - lq), 0).mean())
        assert delta_of_gaussian_pair(eps, m, a, b, dim, 20001) == pytest.approx(mc, abs=0.01)


# ------------------------------------------------------------------------ CLI
def test_audit_cli_json_and_plot(tmp_path: Path) -> None:
    plot = tmp_path / "roc.png"
    args = ["audit", "--placement", "server", "--num-clients", "5", "--dim", "50", "--rounds", "2"]
    args += ["--epsilon", "2", "--delta", "1e-5", "--trials", "200", "--plot", str(plot), "--json"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "run_sim.py"), *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    keys = {"epsilon_lower_bound", "epsilon_reported", "placement", "adjacency", "trials", "n", "r", "q", "d", "K"}
    keys |= {"z", "delta", "fpr", "tpr", "seconds"}
    assert keys <= set(report)
    assert report["placement"] == "server" and report["trials"] == 200 and report["q"] == 1.0
    assert report["epsilon_reported"] == pytest.approx(2.0, rel=2e-3)
    assert 0.0 <= report["epsilon_lower_bound"] <= report["epsilon_reported"]
    assert plot.stat().st_size > 0


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--placement", "client", "--num-clients", "10", "--clients-per-round", "5"], "--clients-per-round = 5 <"),
        (["--clients-per-round", "200"], "--clients-per-round must be in (0, --num-clients], got 200"),
        (["--confidence", "1.5"], "--confidence 1.5: expected a float in (0, 1)"),
        (["--trials", "3"], "--trials 3: expected an integer >= 10"),
        (["--epsilon", "1", "--noise-multiplier", "2"], "give one of them, not both"),
        (["--delta", "0"], "delta must be in (0, 1), got 0.0"),
        (["--dim", "0"], "--dim and --rounds must be >= 1, got 0 and 200"),
    ],
)
def test_audit_cli_bad_flags(flags: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(ROOT))
    try:
        import run_sim
    finally:
        sys.path.remove(str(ROOT))
    with pytest.raises(SystemExit) as exit_info:
        run_sim.main(["audit", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("run_sim.py: error: ") and fragment in err
