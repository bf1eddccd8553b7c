"""Private hyperparameter selection (Papernot & Steinke 2022): the calibration's end-to-end epsilon, the
distribution of the number of trials, the plan, and a tiny end-to-end run on digits.

The end-to-end epsilon is checked against an independent computation: Papernot & Steinke's RDP bounds
written out here in closed form (Theorem 2 for the truncated negative binomial, Theorem 6 for Poisson),
applied to the per-trial RDP curve (closed form ``lambda K / (2 z^2)`` for q = 1; dp-accounting's
subsampled-Gaussian RDP on a fine grid of orders for q < 1), converted to (epsilon, delta) with the
conversion of Canonne, Kamath & Steinke 2020 (Prop. 12), never with dp-accounting's RepeatAndSelectDpEvent.
The distribution of T is checked against scipy's negative binomial, logarithmic and Poisson laws.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import optimize, stats

from dpfedavg.config import ConfigError
from dpfedavg.experiments.private_tuning import (
    PRIVATE_TUNING_COLUMNS,
    TrialCount,
    calibrate_tuning_noise,
    plan_trials,
    run_private_tuning,
    tuning_epsilon,
)

ROOT = Path(__file__).resolve().parents[1]
DELTA = 1e-5


# ------------------------------------------------------------- independent math
def _gamma_for_mean(eta: float, mean: float) -> float:
    """gamma of the truncated negative binomial with E[T] = mean, from scipy's (untruncated) laws."""

    def truncated_mean(gamma: float) -> float:
        if eta == 0:
            return float(stats.logser(1.0 - gamma).mean())
        nb = stats.nbinom(eta, gamma)
        return float(nb.mean() / nb.sf(0))  # E[T | T >= 1] = E[T] / P[T >= 1]

    return optimize.brentq(lambda g: truncated_mean(g) - mean, 1e-9, 1 - 1e-9, xtol=1e-14)


def _rdp_to_epsilon(orders: np.ndarray, rdp: np.ndarray, delta: float) -> float:
    """Canonne, Kamath & Steinke 2020, Prop. 12: eps = rdp + log(1 - 1/a) - log(delta a) / (a - 1), min over a."""
    ok = orders > 1.01
    a, r = orders[ok], rdp[ok]
    return float(max(0.0, np.min(r + np.log1p(-1.0 / a) - np.log(delta * a) / (a - 1.0))))


def _theorem2(orders: np.ndarray, rdp: np.ndarray, eta: float, gamma: float, mean: float, inner) -> np.ndarray:
    """Papernot & Steinke, Theorem 2: eps'(l) = eps(l) + (1+eta) min_lh [(1 - 1/lh) eps(lh) + log(1/gamma)/lh]
    + log(E[T]) / (l - 1); ``inner`` is that minimum over lh >= 1."""
    return rdp + (1.0 + eta) * inner + math.log(mean) / (orders - 1.0)


def _gaussian_delta(sigma: float, eps: np.ndarray) -> np.ndarray:
    """Exact delta(eps) of the Gaussian mechanism with sensitivity 1 and std sigma (Balle & Wang 2018, Thm. 8)."""
    return stats.norm.cdf(0.5 / sigma - eps * sigma) - np.exp(eps) * stats.norm.cdf(-0.5 / sigma - eps * sigma)


def _rdp_to_delta(orders: np.ndarray, rdp: np.ndarray, eps: np.ndarray) -> np.ndarray:
    """The same conversion, solved for delta: log delta = (a - 1)(rdp - eps + log(1 - 1/a)) - log a, min over a,
    and delta <= sqrt(1 - exp(-rdp)) (the KL bound)."""
    a, r = orders[None, :], rdp[None, :]
    log_delta = (a - 1.0) * (r - eps[:, None] + np.log1p(-1.0 / a)) - np.log(a)
    log_delta = np.minimum(log_delta, 0.5 * np.log1p(-np.exp(-r)))
    return np.exp(log_delta.min(axis=1))


ORDERS = np.concatenate([np.linspace(1.02, 20.0, 4000), np.geomspace(20.0, 5000.0, 2000)])


def _independent_epsilon_q1(z: float, rounds: int, count: TrialCount, exact_delta: bool = False) -> float:
    """End-to-end epsilon of the best of T trials, each K rounds of the Gaussian mechanism (q = 1): closed form.

    Poisson (Theorem 6) needs the trial's delta^ at eps^ = log(1 + 1/(l - 1)): from the RDP curve by the same
    conversion, or (``exact_delta``) the exact Gaussian delta, which is tighter.
    """
    rho = rounds / (2.0 * z**2)  # per-trial RDP: eps(l) = rho l (add/remove one client, sensitivity C, std z C)
    rdp = rho * ORDERS
    if count.distribution == "poisson":
        mu = count.mean
        eps_hat = np.log1p(1.0 / (ORDERS - 1.0))
        if exact_delta:
            delta_hat = _gaussian_delta(z / math.sqrt(rounds), eps_hat)
        else:
            coarse = ORDERS[::10]
            delta_hat = _rdp_to_delta(coarse, rho * coarse, eps_hat)
        total = rdp + mu * delta_hat + math.log(mu) / (ORDERS - 1.0)
    else:
        eta = count.shape
        gamma = 1.0 / count.mean if eta == 1 else _gamma_for_mean(eta, count.mean)
        log_inv_gamma = math.log(1.0 / gamma)
        # min over lh >= 1 of (lh - 1) rho + log(1/gamma) / lh: at lh = sqrt(log(1/gamma) / rho)
        lh = max(1.0, math.sqrt(log_inv_gamma / rho))
        inner = (lh - 1.0) * rho + log_inv_gamma / lh
        total = _theorem2(ORDERS, rdp, eta, gamma, count.mean, inner)
    return _rdp_to_epsilon(ORDERS, total, DELTA)


@pytest.mark.parametrize(
    "count",
    [
        TrialCount("negative-binomial", 10.0, 1.0),
        TrialCount("negative-binomial", 10.0, 0.0),
        TrialCount("negative-binomial", 5.0, 2.0),
        TrialCount("negative-binomial", 20.0, 0.5),
        TrialCount("poisson", 10.0),
    ],
    ids=lambda c: f"{c.distribution}-mean{c.mean:g}-shape{c.shape:g}",
)
def test_calibrated_noise_is_dp_end_to_end_by_papernot_steinke_in_closed_form(count: TrialCount) -> None:
    """q = 1, K = 50 rounds: the calibrated z, put through Theorem 2/6 computed here, gives at most the target.

    Tolerance: the closed form optimizes over (almost) continuous orders, so it may only be *smaller* than the
    accountant's; it must be within 3% of the target (the calibration is not needlessly conservative: bisection
    to 0.1% in z and dp-accounting's order grid).
    """
    epsilon, rounds = 5.0, 50
    z = calibrate_tuning_noise(epsilon, DELTA, 1.0, rounds, count)
    independent = _independent_epsilon_q1(z, rounds, count)
    assert independent <= epsilon * (1 + 1e-9)
    assert independent >= 0.97 * epsilon, (independent, z)
    if count.distribution == "poisson":  # with the exact Gaussian delta^ the bound only gets smaller
        assert _independent_epsilon_q1(z, rounds, count, exact_delta=True) <= independent
    # one step less noise is over the target, by the accountant the calibration used
    assert tuning_epsilon(z * 0.99, 1.0, rounds, DELTA, count) > epsilon


def test_digits_setting_is_dp_end_to_end_with_subsampling() -> None:
    """The measured setting (q = 0.2, K = 200, geometric mean 10): Theorem 2 on the subsampled-Gaussian RDP curve."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    count = TrialCount("negative-binomial", 10.0, 1.0)
    q, rounds, epsilon = 0.2, 200, 5.0
    z = calibrate_tuning_noise(epsilon, DELTA, q, rounds, count)
    orders = np.concatenate([np.arange(1.1, 12.0, 0.1), np.arange(12.0, 64.0, 1.0), [128.0, 256.0]])
    accountant = rdp_privacy_accountant.RdpAccountant(orders=orders)
    accountant.compose(
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), rounds)
    )
    rdp = np.asarray(accountant._rdp)  # the per-trial RDP curve on this grid of orders
    gamma = 1.0 / count.mean
    inner = float(np.min((1.0 - 1.0 / orders) * rdp + math.log(1.0 / gamma) / orders))
    total = _theorem2(orders, rdp, 1.0, gamma, count.mean, inner)
    independent = _rdp_to_epsilon(orders, total, DELTA)
    assert independent <= epsilon * (1 + 1e-9)
    assert independent >= 0.97 * epsilon, (independent, z)


# ------------------------------------------------------------------ T's law
@pytest.mark.parametrize(
    "count",
    [
        TrialCount("negative-binomial", 10.0, 1.0),
        TrialCount("negative-binomial", 10.0, 0.0),
        TrialCount("negative-binomial", 10.0, 2.0),
        TrialCount("negative-binomial", 4.0, 0.5),
        TrialCount("poisson", 10.0),
    ],
    ids=lambda c: f"{c.distribution}-mean{c.mean:g}-shape{c.shape:g}",
)
def test_number_of_trials_has_the_stated_law_mean_and_truncation(count: TrialCount) -> None:
    """pmf against scipy's law; 20,000 seeded draws: T >= 1 (negative binomial), mean within 4 standard errors,
    P[T = 1] and P[T <= mean] within 4 standard errors of the pmf."""
    ks = np.arange(0, 2000)
    if count.distribution == "poisson":
        law = stats.poisson(count.mean).pmf(ks)
    elif count.shape == 0:
        law = np.concatenate([[0.0], stats.logser(1.0 - count.gamma).pmf(ks[1:])])
    else:
        nb = stats.nbinom(count.shape, count.gamma)
        law = np.where(ks >= 1, nb.pmf(ks) / nb.sf(0), 0.0)
    ours = np.array([count.pmf(int(k)) for k in ks[:200]])
    np.testing.assert_allclose(ours, law[:200], rtol=1e-9, atol=1e-15)
    assert law.sum() == pytest.approx(1.0, abs=1e-9)
    exact_mean = float((ks * law).sum())
    assert exact_mean <= count.mean + 1e-9  # never more trials on average than the accountant charges
    assert exact_mean == pytest.approx(count.mean, rel=1e-6)

    n = 20_000
    rng = np.random.default_rng(20)
    draws = np.array([count.sample(rng) for _ in range(n)])
    std = math.sqrt(float((ks**2 * law).sum()) - exact_mean**2)
    assert abs(draws.mean() - exact_mean) < 4 * std / math.sqrt(n)
    if count.distribution == "negative-binomial":
        assert draws.min() >= 1
    else:
        assert draws.min() == 0 or law[0] < 1e-3
    for event, p in (((draws == 1), law[1]), ((draws <= count.mean), law[: int(count.mean) + 1].sum())):
        assert abs(event.mean() - p) < 4 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("geometric", 10.0, 1.0), "'trials-distribution' = 'geometric'"),
        (("negative-binomial", 1.0, 1.0), "'trials-mean' = 1.0"),
        (("negative-binomial", 10.0, -0.5), "'trials-shape' = -0.5"),
        (("negative-binomial", 10.0, math.inf), "'trials-shape' = inf"),
        (("poisson", 0.5, 1.0), "'trials-mean' = 0.5"),
    ],
)
def test_bad_trial_count_is_one_clear_error(args: tuple, fragment: str) -> None:
    with pytest.raises(ConfigError, match="invalid private tuning") as err:
        TrialCount(*args)
    assert fragment in str(err.value)


# ---------------------------------------------------------------------- plan
GRID = {"clips": [62.5, 15.625], "lrs": [0.032, 0.008], "rounds": 5, "data_dir": "", "cache_dir": ""}
COUNT = TrialCount("negative-binomial", 2.0, 1.0)  # one calibration (cached) for the plan and the run below


def test_plan_is_seeded_shares_draws_across_algorithms_and_keeps_each_federation(tmp_path: Path) -> None:
    plan = dict(epsilons=[5.0], count=COUNT, repetitions=4, **GRID)
    trials, calibration = plan_trials(tmp_path, "digits", tuning_seed=3, **plan)
    again, _ = plan_trials(tmp_path, "digits", tuning_seed=3, **plan)
    other, _ = plan_trials(tmp_path, "digits", tuning_seed=4, **plan)
    assert [t.cell for t in trials] == [t.cell for t in again]
    assert [(t.seed, t.clip, t.lr) for t in trials] != [(t.seed, t.clip, t.lr) for t in other]
    z = calibration[5.0]["noise_multiplier"]
    assert calibration[5.0]["end_to_end_epsilon"] <= 5.0
    assert {t.algorithm for t in trials} == {"clip", "norm"}
    by_alg = {alg: [t for t in trials if t.algorithm == alg] for alg in ("clip", "norm")}
    assert [(t.repetition, t.num_trials, t.index, t.clip, t.lr, t.seed) for t in by_alg["clip"]] == [
        (t.repetition, t.num_trials, t.index, t.clip, t.lr, t.seed) for t in by_alg["norm"]
    ]
    for t in trials:
        cfg = t.cell.cfg
        assert (cfg.clip, cfg.local_lr) in {(c, lr) for c in GRID["clips"] for lr in GRID["lrs"]}
        assert cfg.epsilon == 0 and cfg.noise_multiplier == z and cfg.seed == t.seed
        assert cfg.data_seed == t.repetition  # one federation per repetition, whatever the trial
        assert cfg.num_rounds == 5 and cfg.delta == DELTA and cfg.sampling_rate == pytest.approx(0.2)
    per_rep = {}
    for t in by_alg["clip"]:
        per_rep.setdefault(t.repetition, []).append(t.index)
    assert all(idx == list(range(len(idx))) and len(idx) >= 1 for idx in per_rep.values())
    with pytest.raises(ConfigError, match="'repetitions' = 0"):
        plan_trials(tmp_path, "digits", tuning_seed=3, **{**plan, "repetitions": 0})


def test_data_seed_fixes_the_federation_whatever_the_run_seed(tmp_path: Path) -> None:
    """Trials of a repetition differ in seed (sampling, noise) but train on one shard split: data-seed's."""
    from dpfedavg.config import RunConfig
    from dpfedavg.tasks import build_task

    def split(**kw) -> np.ndarray:
        return np.asarray(build_task(RunConfig(task="digits", cache_dir=str(tmp_path), **kw)).partition)

    fixed = split(seed=0)
    np.testing.assert_array_equal(split(seed=12345, data_seed=0), fixed)
    assert not np.array_equal(split(seed=12345), fixed)  # without data-seed the split follows seed
    with pytest.raises(ConfigError, match="'data-seed' = -2"):
        RunConfig.from_run_config({"data-seed": -2})


def test_private_tuning_end_to_end_on_digits(tmp_path: Path) -> None:
    """A tiny grid and K = 5: the per-run table, the trials, the released best per repetition, both tables."""
    out = tmp_path / "t1"
    grid = {**GRID, "clips": [15.625], "lrs": [0.032], "cache_dir": str(tmp_path / "cache")}
    outputs = run_private_tuning(
        out, "digits", epsilons=[5.0], seeds=1, count=COUNT, repetitions=1, tuning_seed=0, jobs=1, progress=False,
        **grid,
    )  # fmt: skip
    with outputs["private_tuning_csv"].open() as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
    assert tuple(reader.fieldnames) == PRIVATE_TUNING_COLUMNS
    for alg in ("clip", "norm"):
        for rep in (0,):  # one repetition keeps it fast: the plan test above covers several
            group = [r for r in rows if r["algorithm"] == alg and r["repetition"] == str(rep)]
            assert len(group) == int(group[0]["num_trials"]) >= 1
            released = [r for r in group if r["released"] == "1"]
            assert len(released) == 1
            assert float(released[0]["last5_test_accuracy"]) == max(float(r["last5_test_accuracy"]) for r in group)
    report = json.loads(outputs["private_tuning_json"].read_text())
    assert report["selection_metric"] == "last5_test_accuracy"
    assert {s["algorithm"] for s in report["summary"]} == {"clip", "norm"}
    assert all(
        s["grid_runs"] == 1 and s["grid_end_to_end_epsilon"] == pytest.approx(5.0, rel=1e-2) for s in report["summary"]
    )
    table = outputs["private_tuning_table"].read_text()
    assert "| Clipping | 5 |" in table and "| Normalization | 5 |" in table
    assert (out / "table1.md").exists() and outputs["private_tuning_plot"].stat().st_size > 0


def test_run_sim_rejects_bad_private_tuning_flags_before_running(tmp_path: Path, capsys) -> None:
    spec = importlib.util.spec_from_file_location("run_sim", ROOT / "run_sim.py")
    run_sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_sim)
    base = ["table1", "--dataset", "digits", "--private-tuning", "--out", str(tmp_path / "x")]
    for flags, fragment in (
        (["--trials-distribution", "uniform"], "--trials-distribution = 'uniform'"),
        (["--trials-mean", "0.5"], "--trials-mean = 0.5"),
        (["--repetitions", "0"], "--repetitions = 0"),
        (["--tuning-seed", "-1"], "--tuning-seed = -1"),
    ):
        with pytest.raises(SystemExit) as exit_:
            run_sim.main(base + flags)
        assert exit_.value.code == 2
        assert fragment in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
