"""Canary clients and the run's empirical epsilons (dpfedavg/privacy/canary.py), each number checked against an
independent computation: the mu-GDP closed form, numerical integration, an exact binomial sum written here from
Steinke et al.'s theorem, and jax-privacy's ``epsilon_one_run`` when it is installed."""

from __future__ import annotations

import importlib.util
import logging
import math
import re

import numpy as np
import pytest
from legacy_placement import StdForVariance
from log_records import package_records
from scipy import integrate, stats

from dpfedavg.privacy.canary import (
    CanaryAudit,
    CanaryScores,
    CanarySet,
    GaussianFit,
    epsilon_two_gaussians,
    gaussian_fit_band,
    gaussian_fit_epsilon,
    gaussian_fit_mu,
    guess_counts,
    one_run_lower_bound,
    one_run_p_value,
    round_log_likelihood_ratio,
)

DELTA = 1e-5


def gdp_delta(mu: float, eps: float) -> float:
    """Dong, Roth, Su 2019 Cor. 2.13: the delta(eps) of mu-GDP (N(0, 1) vs N(mu, 1))."""
    return math.exp(stats.norm.logcdf(-eps / mu + mu / 2)) - math.exp(eps + stats.norm.logcdf(-eps / mu - mu / 2))


# ---------------------------------------------------------------- Andrew et al.: the Gaussian-fit epsilon
@pytest.mark.parametrize("mu", [0.3, 1.0, 2.5, 6.0])
def test_two_gaussians_equal_stds_is_the_gdp_closed_form(mu):
    sigma = 0.07
    eps = epsilon_two_gaussians(GaussianFit(0.01, sigma), GaussianFit(0.01 + mu * sigma, sigma), DELTA)
    assert eps > 0
    assert gdp_delta(mu, eps) == pytest.approx(DELTA, rel=1e-6)


@pytest.mark.parametrize(
    ("null", "canary"), [((0.0, 1.0), (2.0, 1.6)), ((0.0, 1.0), (3.0, 0.6)), ((1.0, 2.0), (0.0, 1.0))]
)
def test_two_gaussians_unequal_stds_match_numerical_integration(null, canary):
    p, q = GaussianFit(*null), GaussianFit(*canary)
    eps = epsilon_two_gaussians(p, q, DELTA)

    def hockey(a: GaussianFit, b: GaussianFit) -> float:  # int max(0, p_a - e^eps p_b) dx, trapezoid rule
        spread = 15 * max(a.std, b.std)
        x = np.linspace(min(a.mean, b.mean) - spread, max(a.mean, b.mean) + spread, 1_000_001)
        y = np.maximum(0.0, stats.norm.pdf(x, a.mean, a.std) - math.exp(eps) * stats.norm.pdf(x, b.mean, b.std))
        return float(integrate.trapezoid(y, x))

    assert max(hockey(p, q), hockey(q, p)) == pytest.approx(DELTA, rel=1e-4)


def test_gaussian_fit_on_synthetic_cosines_recovers_the_gdp_epsilon():
    """Null cosines ~ N(0, 1/d), canary cosines shifted by mu / sqrt(d): the fit gives mu-GDP's epsilon (5%)."""
    d, mu, n = 1000, 2.0, 20_000
    rng = np.random.default_rng(0)
    null = rng.normal(0.0, d**-0.5, n)
    canary = rng.normal(mu * d**-0.5, d**-0.5, n)
    eps = gaussian_fit_epsilon(canary, null, DELTA)
    exact = epsilon_two_gaussians(GaussianFit(0, 1), GaussianFit(mu, 1), DELTA)
    assert gdp_delta(mu, exact) == pytest.approx(DELTA, rel=1e-6)
    assert eps == pytest.approx(exact, rel=0.05)


@pytest.mark.parametrize("canary_std", [1.0, 1.3])
def test_estimate_band_covers_the_true_mu_95_percent_of_the_time(canary_std):
    """400 synthetic audits (100 canary, 100 null scores; shift mu = 2 in units of the null's std, a canary std of 1
    or 1.3): the 95% band of mu covers the true mu in 92% to 98% of them (binomial sd 1.1%); the band in epsilon
    is mu +- 1.96 se through the mu-GDP closed form (bisection here)."""
    rng = np.random.default_rng(11)
    mu, s = 2.0, 0.05
    covered = 0
    for _ in range(400):
        null = rng.normal(0.0, s, 100)
        canary = rng.normal(mu * s, canary_std * s, 100)
        est, se = gaussian_fit_mu(canary, null)
        covered += abs(est - mu) <= 1.96 * se
    assert 0.92 <= covered / 400 <= 0.98
    lo, hi = gaussian_fit_band(canary, null, DELTA, 0.95)
    z = stats.norm.isf(0.025)
    assert lo == pytest.approx(gdp_epsilon(est - z * se, DELTA), abs=1e-6)
    assert hi == pytest.approx(gdp_epsilon(est + z * se, DELTA), abs=1e-6)
    assert lo < gaussian_fit_epsilon(canary, null, DELTA) < hi


def test_identical_score_laws_give_epsilon_near_zero():
    rng = np.random.default_rng(1)
    assert gaussian_fit_epsilon(rng.normal(0, 1, 5000), rng.normal(0, 1, 5000), DELTA) < 0.3


# ---------------------------------------------------------------- Steinke et al.: the one-run lower bound
def exact_p_value(m: int, g: int, v: int, eps: float, delta: float) -> float:
    """Steinke, Nasr, Jagielski 2023, Thm 5.2, written from the paper with exact binomial sums."""
    p = math.exp(eps) / (1 + math.exp(eps))

    def tail(t: int) -> float:  # P[Bin(g, p) >= t]
        return math.fsum(math.comb(g, j) * p**j * (1 - p) ** (g - j) for j in range(max(t, 0), g + 1))

    beta = tail(v)
    alpha = max([(tail(v - i) - beta) / i for i in range(1, v + 1)], default=0.0)
    return min(1.0, beta + 2 * m * delta * alpha)


@pytest.mark.parametrize(
    ("m", "g", "v", "eps", "delta"),
    [(100, 20, 18, 1.0, 0.0), (100, 20, 18, 1.0, 1e-5), (500, 50, 47, 2.0, 1e-6), (1000, 300, 200, 0.5, 1e-3)],
)
def test_one_run_p_value_matches_the_theorem(m, g, v, eps, delta):
    assert one_run_p_value(m, g, v, eps, delta) == pytest.approx(exact_p_value(m, g, v, eps, delta), rel=1e-9)


def test_one_run_bound_matches_an_independent_search():
    """The bound is the largest epsilon the best Bonferroni-corrected guess rejects; found here by bisection."""
    rng = np.random.default_rng(2)
    m = 200
    inserted = rng.random(m) < 0.5
    scores = rng.normal(0, 1, m) + 1.5 * inserted
    bound = one_run_lower_bound(scores, inserted, DELTA, significance=0.05)
    order = np.argsort(-scores)
    counts = guess_counts(m)
    best = 0.0
    for g in counts:
        v = int(inserted[order[:g]].sum())
        lo, hi = 0.0, 20.0  # the p-value grows with eps: bisect for where it crosses the corrected level
        if exact_p_value(m, g, v, lo, DELTA) >= 0.05 / len(counts):
            continue
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if exact_p_value(m, g, v, mid, DELTA) < 0.05 / len(counts) else (lo, mid)
        best = max(best, lo)
    assert bound > 0.5
    assert bound == pytest.approx(best, abs=1e-6)


def test_one_run_bound_is_valid_for_randomized_response():
    """A canary's score is its true membership flipped with probability 1/(1+e^eps0): (eps0, 0)-DP per canary.
    Over 100 seeded trials the 95% lower bound exceeds eps0 in at most 12 (P[Bin(100, 0.05) > 12] < 0.002)."""
    eps0, m = 1.0, 500
    rng = np.random.default_rng(3)
    above = 0
    for _ in range(100):
        inserted = rng.random(m) < 0.5
        keep = rng.random(m) < math.exp(eps0) / (1 + math.exp(eps0))
        scores = np.where(keep, inserted, ~inserted).astype(float) + 1e-6 * rng.random(m)
        above += one_run_lower_bound(scores, inserted, 0.0, significance=0.05) > eps0
    assert above <= 12


@pytest.mark.skipif(importlib.util.find_spec("jax_privacy") is None, reason="jax-privacy not installed (optional)")
def test_one_run_p_value_matches_jax_privacy():
    from jax_privacy import auditing

    for m, g, v, eps, delta in [(100, 20, 18, 1.0, 1e-5), (500, 50, 47, 2.0, 1e-6)]:
        ours = one_run_p_value(m, g, v, eps, delta)
        assert ours == pytest.approx(auditing._one_run_p_value(m, g, v, eps, delta), rel=1e-9)


@pytest.mark.skipif(importlib.util.find_spec("jax_privacy") is None, reason="jax-privacy not installed (optional)")
def test_one_run_lower_bound_matches_jax_privacy_epsilon_one_run():
    """The run's bound through jax-privacy's public API: `CanaryScoreAuditor.epsilon_one_run` with an explicit
    threshold at each of our guess counts (the top g scores), each at significance / len(counts); ours is the max.
    Synthetic scores, a shift of 3 between 60 inserted and 60 null canaries (continuous: no ties)."""
    from jax_privacy import auditing

    rng = np.random.default_rng(3)
    inserted = rng.random(120) < 0.5
    scores = rng.standard_normal(120) + 3.0 * inserted
    significance, delta = 0.05, 1e-5
    counts = guess_counts(len(scores))
    auditor = auditing.CanaryScoreAuditor(scores[inserted], scores[~inserted])
    top = np.sort(scores)[::-1]
    theirs = [
        auditor.epsilon_one_run(
            significance / len(counts), delta, threshold_strategy=auditing.Explicit(float(top[g - 1]))
        )
        for g in counts
    ]
    ours = one_run_lower_bound(scores, inserted, delta, significance)
    assert max(theirs) > 0.5  # the comparison is not between two zeros
    assert ours == pytest.approx(max(theirs), abs=1e-5)


# ---------------------------------------------------------------- canaries and scores
def test_canary_set_is_seeded_unit_and_inserted_with_probability_half():
    a = CanarySet.draw(5, 4000, 30)
    b = CanarySet.draw(5, 4000, 30)
    np.testing.assert_array_equal(a.directions, b.directions)
    np.testing.assert_allclose(np.linalg.norm(a.directions, axis=1), 1.0, rtol=1e-12)
    assert abs(a.num_inserted - 2000) < 4 * math.sqrt(1000)  # Bin(4000, 1/2): 4 standard deviations


def test_scores_final_all_iterates_and_max_cosine():
    directions = np.eye(3)
    canaries = CanarySet(directions, np.array([True, False, True]))
    scores = CanaryScores(canaries, np.zeros(3), sampling_rate=1.0, noise_multiplier=2.0)
    sampled = CanaryScores(canaries, np.zeros(3), sampling_rate=0.25, noise_multiplier=2.0)
    no_noise = CanaryScores(canaries, np.zeros(3), sampling_rate=0.25, noise_multiplier=0.0)
    for s in (scores, sampled, no_noise):
        s.observe(np.array([-1.0, 0.0, 0.0]))  # moved along -e0: w_{k-1} - w_k = e0
        s.observe(np.array([-1.0, 0.0, -1.0]))  # then along e2
    np.testing.assert_allclose(scores.max_cosine, [1.0, 0.0, 1.0])
    np.testing.assert_allclose(scores.final, [2**-0.5, 0.0, 2**-0.5])
    # z_jk = sqrt(3) cos; at q = 1 the ratio is sum_k (z_jk / 2 - 1 / 8) (mu = 1/2)
    np.testing.assert_allclose(scores.all_iterates, [3**0.5 / 2 - 0.25, -0.25, 3**0.5 / 2 - 0.25])
    moved = np.log(0.75 + 0.25 * np.exp(3**0.5 / 2 - 0.125))  # log(1 - q + q exp(mu z - mu^2 / 2)), z = sqrt(3)
    still = np.log(0.75 + 0.25 * np.exp(-0.125))  # z = 0
    np.testing.assert_allclose(sampled.all_iterates, [moved + still, 2 * still, moved + still], rtol=1e-14)
    np.testing.assert_allclose(no_noise.all_iterates, [3**0.5, 0.0, 3**0.5])  # no noise, q < 1: the largest z_jk
    audit = CanaryAudit.of(scores, DELTA)
    assert audit.inserted == 2 and math.isnan(audit.epsilon_final)  # one null canary: no fit


@pytest.mark.parametrize(("q", "z"), [(1.0, 3.0), (0.1, 1.1), (0.01, 0.5)])
def test_round_ratio_is_the_mixture_density_over_the_null_density(q, z):
    """One round's evidence is ``log(((1 - q) phi(x) + q phi(x - 1/z)) / phi(x))``, densities from scipy."""
    x = np.linspace(-8, 8, 161)
    mixture = (1 - q) * stats.norm.pdf(x) + q * stats.norm.pdf(x, loc=1 / z)
    np.testing.assert_allclose(round_log_likelihood_ratio(x, q, z), np.log(mixture / stats.norm.pdf(x)), rtol=1e-12)
    with pytest.raises(ValueError, match="sampling_rate = 0"):
        round_log_likelihood_ratio(x, 0.0, z)


def _pld_epsilon(q: float, z: float, rounds: int, delta: float) -> float:
    """dp-accounting's PLD accountant called directly (not the project's): K Poisson-sampled Gaussian rounds."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    event = dp_accounting.GaussianDpEvent(z)
    if q < 1:
        event = dp_accounting.PoissonSampledDpEvent(q, event)
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize(("q", "rounds", "z"), [(1.0, 10, 3.1), (0.1, 50, 1.1), (0.1, 50, 0.775)])
def test_all_iterates_fit_of_the_ideal_release_is_the_clt_mu_and_below_the_pld_epsilon(q, rounds, z):
    """The canary game exactly as the accountant models it, in the standardised units the scores use: each round a
    never-inserted direction sees ``N(0, 1)``, an inserted one ``N(0, 1)`` shifted by ``1/z`` with probability ``q``.
    The ratio's Gaussian fit is the central limit theorem's ``mu`` (Dong, Roth, Su 2022, Thm 3.5:
    ``q sqrt(K (e^{1/z^2} - 1))``; ``sqrt(K) / z`` at ``q = 1``, exact), within 4 standard errors plus 0.03 of
    finite-K bias; its epsilon is at most dp-accounting's PLD epsilon (equal at ``q = 1``, below it at ``q < 1``: the
    shift fit cannot show the sampled loss's skew). The largest one-round cosine's fit is weaker at each setting."""
    rng = np.random.default_rng(11)
    n = 4000
    null = rng.standard_normal((rounds, n))
    inserted = rng.standard_normal((rounds, n)) + (rng.random((rounds, n)) < q) / z
    ratio = [round_log_likelihood_ratio(x, q, z).sum(axis=0) for x in (inserted, null)]
    mu, se = gaussian_fit_mu(*ratio)
    mu0 = 1 / z
    clt = math.sqrt(rounds) * mu0 if q == 1 else q * math.sqrt(rounds * (math.exp(mu0**2) - 1))
    assert abs(mu - clt) < 4 * se + 0.03, (mu, clt, se)
    pld = _pld_epsilon(q, z, rounds, DELTA)
    assert gdp_epsilon(mu - 3 * se, DELTA) <= pld
    if q == 1:
        assert gdp_epsilon(clt, DELTA) == pytest.approx(pld, rel=0.01)
    largest, _ = gaussian_fit_mu(inserted.max(axis=0), null.max(axis=0))
    assert largest < mu - 3 * se


# ---------------------------------------------------------------- canaries in a run (batched engine)
def _run_cfg(tmp_path, **changes):
    from dpfedavg import RunConfig

    base = dict(
        task="quadratic",
        algorithm="norm",
        dim=200,
        num_clients=10,
        clients_per_round=10.0,
        num_rounds=10,
        epsilon=1.0,
        canary_clients=200,
        output_dir=str(tmp_path),
        checkpoint_every=0,
        eval_every=1000,
        seed=0,
    )
    return RunConfig(**{**base, **changes})


def gdp_epsilon(mu: float, delta: float) -> float:
    """The epsilon of mu-GDP at delta, by bisection on the closed form."""
    lo, hi = 0.0, 100.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gdp_delta(mu, mid) > delta else (lo, mid)
    return hi


def test_audit_of_a_correct_run_is_consistent_with_the_accountant(tmp_path, monkeypatch):
    """The command of docs/privacy/auditing-a-run.md, run as written (in-process, from an empty folder).

    q = 1, every canary in every round, K rounds: the canary game is K Gaussian releases with shift C/r' and std
    zC/r', i.e. mu-GDP with mu = sqrt(K)/z (closed form, checked against the PLD accountant's epsilon). The
    final-model estimate's mu is below that plus 3 standard errors (sqrt(1/in + 1/out)) and its 95% band holds the
    accountant's epsilon; the 95% one-run lower bound does not exceed it. The page shows this run's real output."""
    import json
    import shlex

    from doc_blocks import ROOT, page_blocks

    from dpfedavg.config import RunConfig
    from dpfedavg.io.results import read_metrics
    from dpfedavg.__main__ import main
    from dpfedavg.config import parse_run_config

    blocks = page_blocks(ROOT / "docs/privacy/auditing-a-run.md")
    (block,) = [b for b in blocks if b.kind == "run-by"]
    argv = shlex.split(block.source.strip())
    assert argv[:3] == ["python", "-m", "dpfedavg"]
    monkeypatch.chdir(tmp_path)
    with package_records(logging.INFO) as records:
        assert main(argv[3:]) == 0
    cfg = RunConfig.from_run_config(parse_run_config(argv[argv.index("--run-config") + 1]))
    directory = tmp_path / "outputs" / "audited"
    saved = json.loads((directory / "config.json").read_text())
    audit, epsilon = saved["final"]["audit"], saved["final"]["epsilon"]
    z = saved["privacy"]["noise_multiplier"]
    mu = math.sqrt(cfg.num_rounds) / z
    assert gdp_epsilon(mu, cfg.delta) == pytest.approx(epsilon, rel=0.02)
    assert audit["epsilon_accountant"] == pytest.approx(epsilon)
    assert audit["federation_clients"] == cfg.num_clients + audit["inserted"] and audit["q"] == 1.0
    assert audit["epsilon_lower_bound"] <= epsilon
    se = math.sqrt(1 / audit["inserted"] + 1 / (audit["canaries"] - audit["inserted"]))
    assert audit["epsilon_final"] <= gdp_epsilon(mu + 3 * se, cfg.delta)
    for key in ("epsilon_final", "epsilon_all_iterates"):  # q = 1: the final model and the ratio (a sum) agree
        low, high = audit[f"{key}_band"]
        assert low <= epsilon <= high, key
    assert (directory / "audit.png").stat().st_size > 0
    assert np.load(directory / "audit.npz")["inserted"].sum() == audit["inserted"]
    # the page shows this run's real output: its last line (the run's folder as <path>) and config.json's audit
    (last_line,) = [b.source.strip() for b in blocks if b.language == "text"]
    done = [r.getMessage() for r in records if r.getMessage().startswith("Done after")]
    assert [re.sub(r"\S*outputs/audited", "<path>", m) for m in done] == [last_line]
    (shown,) = [json.loads("{" + b.source + "}")["audit"] for b in blocks if b.language == "json"]
    assert shown.keys() == audit.keys()
    for key, value in audit.items():
        assert shown[key] == (pytest.approx(value, rel=1e-6) if not isinstance(value, str) else value), key
    # the canaries are sampled like every client: at q = 1 all n + inserted, every round
    rows = [r for r in read_metrics(directory / "metrics.csv") if r["round"] >= 1]
    assert all(r["num_sampled"] == cfg.num_clients + audit["inserted"] for r in rows)


def test_audit_flags_a_broken_mechanism_in_the_same_run(tmp_path, monkeypatch):
    """Clients add std zC/|S_k| instead of zC/sqrt(|S_k|): the accountant still reports epsilon = 1; in the same
    run the one-run lower bound (95% confidence) is above it (by 25%) and both estimates above 5 epsilon."""
    from dpfedavg import run
    from dpfedavg.core import mechanism

    base = mechanism.PLACEMENTS["client-calibrated"]
    monkeypatch.setitem(mechanism.PLACEMENTS, "client-calibrated", StdForVariance(base))
    with package_records(logging.INFO) as records:
        result = run(_run_cfg(tmp_path, dim=600, canary_clients=300, checkpoint_every=5), progress=False)
    audit = result.audit
    messages = [r.getMessage() for r in records]
    assert any(m.startswith("Round 5: canary audit so far: estimated epsilon") for m in messages)  # checkpoint-every
    assert "one-run lower bound" in messages[-1]  # the run's last line
    assert result.epsilon <= 1.0
    assert audit["epsilon_lower_bound"] > 1.25 * result.epsilon  # 1.58 with this seed
    assert min(audit["epsilon_final"], audit["epsilon_all_iterates"]) > 5 * result.epsilon


# ---------------------------------------------------------------- the key: validated, refused where it cannot work
@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"canary_clients": -1}, "'canary-clients' = -1: expected an integer in [0,"),
        ({"canary_clients": 2.5}, "'canary-clients' = 2.5 (float)"),
        (
            {"canary_clients": 10, "secure_aggregation": True, "noise_placement": "client-calibrated"},
            "SecAgg+'s discrete noise",
        ),
        ({"canary_clients": 10, "noise_mechanism": "banded-mf", "noise_placement": "server"}, "banded-MF"),
        ({"canary_clients": 10, "resume": True, "run_name": "x"}, "every round's release from round 1"),
    ],
)
def test_canary_clients_key_is_validated(changes, words):
    from dpfedavg.config import ConfigError, RunConfig

    with pytest.raises(ConfigError) as err:
        RunConfig(**changes)
    assert words in str(err.value)


class _UntouchableGrid:
    """A grid that fails the test if the ServerApp asks it anything: the refusal comes before any start-up."""

    def __getattr__(self, name):
        raise AssertionError(f"the ServerApp touched the grid ({name}) before refusing the config")


def test_secure_aggregation_with_canaries_is_one_error_before_start_up(tmp_path, dpfedavg_log, capsys):
    """flwr run's ServerApp and python -m dpfedavg: one error naming both keys and SecAgg+'s discrete noise as the
    reason, the grid never touched, nothing written."""
    from flwr.app import Context, RecordDict

    from dpfedavg.config import RunConfig
    from dpfedavg.flower import server_app
    from dpfedavg.__main__ import main

    values = {"secure-aggregation": True, "noise-placement": "client-calibrated", "canary-clients": 10}
    run_config = RunConfig(output_dir=str(tmp_path)).to_run_config() | values
    server_app.main(_UntouchableGrid(), Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                                                run_config=run_config))  # fmt: skip
    errors = [r.getMessage() for r in dpfedavg_log if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    reason = "'canary-clients' = 10 with 'secure-aggregation' = True"
    assert reason in errors[0] and "SecAgg+'s discrete noise" in errors[0]
    overrides = " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else repr(v)}" for k, v in values.items())
    assert main(["--run-config", f"{overrides} output-dir='{tmp_path}'"]) == 2
    assert reason in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_flower_engine_refuses_canaries_before_any_start_up(tmp_path):
    from dpfedavg.config import ConfigError
    from dpfedavg.server.run import prepare_run

    with pytest.raises(ConfigError, match="does not insert canary clients"):
        prepare_run(_run_cfg(tmp_path), engine="flower")
    assert list(tmp_path.iterdir()) == []


def test_canaries_leave_q_z_and_epsilon_unchanged(tmp_path):
    from dpfedavg.privacy.setup import FederationSize
    from dpfedavg.server.run import plan_for

    cfg = _run_cfg(tmp_path, num_clients=100, clients_per_round=10.0)
    n, r = FederationSize(cfg.num_clients, cfg.clients_per_round, 37).sampled
    fed = cfg.replace(num_clients=n, clients_per_round=r)
    assert (fed.num_clients, fed.clients_per_round) == (137, pytest.approx(13.7))
    assert fed.sampling_rate == pytest.approx(cfg.sampling_rate, rel=1e-15)
    assert plan_for(fed).noise_multiplier == pytest.approx(plan_for(cfg).noise_multiplier, rel=1e-9)


def test_flower_engine_inserts_the_same_canaries_as_the_batched_engine(tmp_path):
    """One seed, q < 1, both engines (the real ClientApp and strategy on an in-process grid): the server computes
    the sampled canaries' g + zeta, the nodes the real clients'; same trajectory, same audit."""
    import json

    from dpfedavg.config import RunConfig
    from dpfedavg.engines.batched import run_batched
    from dpfedavg.flower import server_app
    from dpfedavg.flower.client_app import app as client_app
    from dpfedavg.flower.testing import InProcessGrid

    values = {"task": "quadratic", "dim": 60, "num-clients": 12, "clients-per-round": 6.0, "num-rounds": 5,
              "epsilon": 5.0, "canary-clients": 30, "seed": 4, "output-dir": str(tmp_path), "checkpoint-every": 0,
              "save-trajectory": True}  # fmt: skip
    cfg_b = RunConfig.from_run_config({**values, "run-name": "batched"})
    cfg_f = RunConfig.from_run_config({**values, "run-name": "flower"})
    out_b = run_batched(cfg_b).directory
    result_f = server_app.run(InProcessGrid(client_app, cfg_f.num_clients, cfg_f.to_run_config()), cfg_f)
    np.testing.assert_allclose(
        np.load(out_b / "trajectory.npy"), np.load(result_f.directory / "trajectory.npy"), rtol=1e-6, atol=1e-7
    )
    audit_b = json.loads((out_b / "config.json").read_text())["final"]["audit"]
    audit_f = result_f.audit
    assert audit_f["federation_clients"] == audit_b["federation_clients"] > 12
    for key in ("epsilon_final", "epsilon_all_iterates", "epsilon_lower_bound", "epsilon_accountant"):
        assert audit_f[key] == pytest.approx(audit_b[key], rel=1e-5, abs=1e-9), key
    sampled = [r["num_sampled"] for r in result_f.history if r["round"] >= 1]
    assert sum(sampled) > 5 * 6.0  # canaries were sampled too (q n' per round in expectation)
    assert (result_f.directory / "audit.png").exists()
