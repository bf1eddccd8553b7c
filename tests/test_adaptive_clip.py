"""adaptive-clip (Andrew, Thakkar, McMahan, Ramaswamy 2021): the update rule, the private count, the noise split's
privacy (closed form and scipy, not the project's accountant), config errors, resume, both engines, SecAgg+."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import optimize, stats

from dpfedavg import epsilon_for
from dpfedavg.config import ConfigError, RunConfig
from dpfedavg.core import noise_rng, private_block_update
from dpfedavg.core.adaptive_clip import (
    AdaptiveClip,
    augmented_bound,
    count_scale,
    count_stddev_for_inflation,
    next_clip,
    update_noise_multiplier,
)
from dpfedavg.core.noise import round_noise_law
from dpfedavg.core.types import ClientResult
from dpfedavg.engines.batched import run_batched
from dpfedavg.flower import server_app
from dpfedavg.flower.client_app import app as client_app
from dpfedavg.flower.testing import InProcessGrid
from dpfedavg.io.checkpoint import load_checkpoint
from dpfedavg.server.dp_server import DPServer
from dpfedavg.server.round import RoundReplies
from dpfedavg.server.run import plan_for


def _cfg(**overrides) -> RunConfig:
    base = {"algorithm": "adaptive-clip", "task": "quadratic", "dim": 12, "num-clients": 20,
            "clients-per-round": 20.0, "num-rounds": 10, "epsilon": 0.0, "noise-multiplier": 1.0,
            "clip-count-stddev": 2.0, "clip": 5.0, "seed": 1, "checkpoint-every": 0}  # fmt: skip
    return RunConfig.from_run_config({**base, **overrides})


def _rows(run_dir: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((run_dir / "metrics.csv").open()))


# ---------------------------------------------------------------- the update rule
def test_geometric_update_rule() -> None:
    """C_{k+1} = C_k exp(-eta_C (b_k - gamma)), b_k = 1/2 + T_k / r (Andrew et al. 2021, Algorithm 1)."""
    assert next_clip(2.0, 0.5, 0.5, 0.2) == 2.0  # at the target quantile C stays
    assert next_clip(2.0, 0.9, 0.5, 0.2) == pytest.approx(2.0 * math.exp(-0.2 * 0.4), rel=1e-15)  # too few clipped
    assert next_clip(2.0, 0.1, 0.5, 0.2) == pytest.approx(2.0 * math.exp(0.2 * 0.4), rel=1e-15)  # too many clipped
    state = AdaptiveClip(clip=3.0, target_quantile=0.3, clip_lr=0.5, count_stddev=4.0, noise_multiplier=1.0)
    used, b = state.step(released_count=2.5, clients_per_round=10.0)  # 7.5 of 10 unclipped, noise-free
    assert (used, b) == (3.0, 0.75)
    assert state.clip == pytest.approx(3.0 * math.exp(-0.5 * (0.75 - 0.3)), rel=1e-15)


def test_client_sends_a_shifted_indicator_as_one_extra_coordinate() -> None:
    """Each client's vector is (clip(u, C), s (1[||u|| <= C] - 1/2)), norm <= C_aug; in count units +-1/2."""
    c, s = 2.0, 3.0
    u = np.array([[0.3, 0.4, 0.0], [3.0, 4.0, 0.0], [0.0, 0.0, 2.0]])  # norms 0.5, 5, 2 (= C: unclipped)
    out = private_block_update(u, algorithm="adaptive-clip", clip=c, noise_std=0.0,
                               rngs=[np.random.default_rng(0)] * 3, count_scale=s)  # fmt: skip
    rows = np.stack([o.noisy for o in out])
    assert rows.shape == (3, 4)
    np.testing.assert_allclose(rows[:, -1] / s, [0.5, -0.5, 0.5])
    np.testing.assert_allclose(rows[1, :3], [1.2, 1.6, 0.0])  # clipped to C
    assert np.all(np.linalg.norm(rows, axis=1) <= augmented_bound(c, s) * (1 + 1e-12))
    with pytest.raises(ValueError, match="count_scale"):
        private_block_update(u, algorithm="adaptive-clip", clip=c, noise_std=0.0, rngs=[np.random.default_rng(0)] * 3)


# ------------------------------------------------------- the released statistics
def _released(placement: str, secagg: bool, rounds: int) -> tuple[np.ndarray, np.ndarray, DPServer, int]:
    """``rounds`` rounds of the server with fixed C (clip-lr 0): released b_k and the update sums' noise."""
    r, dim = 20, 3
    cfg = _cfg(
        **{
            "noise-placement": placement,
            "secure-aggregation": secagg,
            "clip-lr": 0.0,
            "dim": dim,
            "num-rounds": rounds,
            "clip-count-stddev": 1.5,
            "noise-multiplier": 2.0,
            "secagg-clip-stds": 40.0,
        }
    )  # fmt: skip (1500 rounds at z = 2: no clipping slack at epsilon ~ 1e2
    server = DPServer(cfg, dim, epsilon_each_round=False)
    rng = np.random.default_rng(0)
    directions = rng.standard_normal((r, dim))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    norms = np.where(np.arange(r) < 13, 0.5 * cfg.clip, 3.0 * cfg.clip)  # 13 of 20 unclipped
    u = directions * norms[:, None]
    clean_sum = (directions * np.minimum(norms, cfg.clip)[:, None]).sum(axis=0)
    b, noise = [], []
    for k in range(1, rounds + 1):
        clients, ins, _ = server.begin_round(k, np.zeros(dim))
        assert len(clients) == r and ins.clip == cfg.clip
        updates = private_block_update(u, algorithm="adaptive-clip", clip=ins.clip, noise_std=ins.noise_std,
                                       rngs=[noise_rng(ins.noise_seed, i) for i in range(r)],
                                       law=round_noise_law(ins), count_scale=ins.count_scale)  # fmt: skip
        results = [ClientResult(i, up.noisy, up.update_norm, None) for i, up in enumerate(updates)]
        w_new = server.close_round(k, RoundReplies(tuple(results))).w
        b.append(server.history[k].frac_unclipped)
        noise.append(-w_new * r / server.history[k].beta - clean_sum)  # w_1 = 0 - beta (sum / r)
    return np.array(b), np.concatenate(noise), server, 13


@pytest.mark.parametrize(("placement", "secagg"), [("client-calibrated", False), ("server", False),
                                                   ("client-calibrated", True)])  # fmt: skip
def test_released_fraction_has_the_stated_mean_and_std(placement: str, secagg: bool) -> None:
    """Over 1500 seeded rounds: b_k has mean 1/2 + (m_unclipped - m/2)/r and std sigma_b / r; the update sum's
    noise has std z_u C per coordinate (Theorem 1's split), in every noise placement and under the SecAgg encoding.

    Tolerances: means within 4 standard errors; stds within 6% (the std of a sample std of 1500 (4500)
    Gaussians is 1.8% (1.1%) of it). With secure aggregation the rounding to the grid adds < 1e-3 relative.
    """
    rounds = 1500
    b, noise, server, unclipped = _released(placement, secagg, rounds)
    r, sigma_b, z = 20.0, 1.5, 2.0
    assert np.all(server.history[rounds].clip == 5.0)  # clip-lr = 0: C stays
    expected = 0.5 + (unclipped - 20 / 2) / r  # 0.65 (a {0, 1} count would give 1/2 + 13/20 = 1.15)
    assert abs(b.mean() - expected) < 4 * sigma_b / r / math.sqrt(rounds)
    assert b.std(ddof=1) == pytest.approx(sigma_b / r, rel=0.06)
    z_u = (z**-2 - (2 * sigma_b) ** -2) ** -0.5
    assert noise.std(ddof=1) == pytest.approx(z_u * 5.0, rel=0.06)
    assert abs(noise.mean()) < 4 * z_u * 5.0 / math.sqrt(noise.size) + (1e-3 if secagg else 0.0)


# ------------------------------------------------ the noise split's privacy, independently
def _exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact epsilon of the Gaussian mechanism with ``mu`` = sensitivity / std (Balle and Wang 2018), scipy."""

    def excess(eps: float) -> float:
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2) - delta

    return float(optimize.brentq(excess, 0.0, 200.0, xtol=1e-10))


@pytest.mark.parametrize(("z", "sigma_b", "rounds"), [(1.0, 5.0, 50), (2.6, 2.0, 200), (21.9, 13.2, 500)])
def test_joint_release_is_one_gaussian_mechanism_with_z(z: float, sigma_b: float, rounds: int) -> None:
    """The update sum (std z_u C, sensitivity C) and the count (std sigma_b, sensitivity 1/2) together have the
    privacy loss of ONE Gaussian mechanism with noise multiplier z: mu^2 = (C/(z_u C))^2 + ((1/2)/sigma_b)^2
    = 1/z^2 exactly, and the reported epsilon (q = 1, K rounds) is that mechanism's exact epsilon (scipy).
    The sensitivities and stds are read off what the server and a client actually produce."""
    delta, c, n = 1e-5, 7.0, 10
    cfg = _cfg(**{"noise-multiplier": z, "clip-count-stddev": sigma_b, "clip": c, "num-clients": n,
                  "clients-per-round": float(n), "num-rounds": rounds, "noise-placement": "server"})  # fmt: skip
    server = DPServer(cfg, 3)
    s = server.adaptive.scale
    # sensitivities: one client's extreme contributions (clipped, with its indicator) in update / count units
    big = private_block_update(np.array([[30.0, 0.0, 0.0]]), algorithm="adaptive-clip", clip=c, noise_std=0.0,
                               rngs=[np.random.default_rng(0)], count_scale=s)[0].noisy  # fmt: skip
    small = private_block_update(np.array([[0.1, 0.0, 0.0]]), algorithm="adaptive-clip", clip=c, noise_std=0.0,
                                 rngs=[np.random.default_rng(0)], count_scale=s)[0].noisy  # fmt: skip
    sens_update = max(np.linalg.norm(big[:-1]), np.linalg.norm(small[:-1]))
    sens_count = max(abs(big[-1]), abs(small[-1])) / s
    assert sens_update == pytest.approx(c, rel=1e-12) and sens_count == 0.5
    # stds: what the server adds to the released (d + 1)-sum, per coordinate, in update / count units
    std = server.noise_stds(n)[1]
    std_update, std_count = std, std / s
    assert std_count == pytest.approx(sigma_b, rel=1e-12)
    z_u = (z**-2 - (2 * sigma_b) ** -2) ** -0.5  # Theorem 1, computed here
    assert std_update == pytest.approx(z_u * c, rel=1e-12)
    assert update_noise_multiplier(z, sigma_b) == pytest.approx(z_u, rel=1e-14)
    mu = math.hypot(sens_update / std_update, sens_count / std_count)
    assert mu == pytest.approx(1 / z, rel=1e-12)
    reported = epsilon_for(z, 1.0, rounds, delta, "pld")  # the unchanged accountant: PoissonSampled(1, Gaussian(z))
    true = _exact_gaussian_epsilon(math.sqrt(rounds) * mu, delta)  # K Gaussians compose to sqrt(K) mu
    assert true * (1 - 1e-4) <= reported <= true * 1.01
    # the trap: a {0, 1} indicator (sensitivity 1) with the same split leaks more than reported
    mu_01 = math.hypot(sens_update / std_update, 1.0 / std_count)
    assert _exact_gaussian_epsilon(math.sqrt(rounds) * mu_01, delta) > 1.02 * reported


def test_noise_split_helpers() -> None:
    assert update_noise_multiplier(0.0, 1.0) == 0.0 and count_scale(0.0, 3.0, 1.0) == 3.0  # no noise: exact count
    sigma_b = count_stddev_for_inflation(2.0, 1.1)
    assert update_noise_multiplier(2.0, sigma_b) == pytest.approx(2.2, rel=1e-12)
    with pytest.raises(ValueError, match="undefined"):
        update_noise_multiplier(2.0, 1.0)


# ------------------------------------------------------------------ config errors
def test_config_keys_defaults_and_errors() -> None:
    cfg = RunConfig.from_run_config({"algorithm": "adaptive-clip", "clients-per-round": 100.0, "epsilon": 0.0,
                                     "noise-multiplier": 1.0})  # fmt: skip
    assert (cfg.target_quantile, cfg.clip_lr, cfg.clip_count_stddev) == (0.5, 0.2, None)
    assert cfg.to_run_config()["clip-count-stddev"] == "auto"
    assert plan_for(cfg).count_stddev == 5.0  # auto: r/20 = 5 > z/2, and above the sigma_b of z_u = 1.1 z (1.2)
    for bad, fragment in (({"target-quantile": 1.5}, "'target-quantile' = 1.5"), ({"clip-lr": -0.1}, "'clip-lr'"),
                          ({"clip-count-stddev": 0.0}, "'clip-count-stddev' = 0.0")):  # fmt: skip
        with pytest.raises(ConfigError, match=fragment):
            RunConfig.from_run_config({"algorithm": "adaptive-clip", **bad})


def test_count_noise_too_small_for_the_split_is_one_clear_error() -> None:
    fixed = _cfg(**{"noise-multiplier": 3.0, "clip-count-stddev": 1.5})
    with pytest.raises(ConfigError) as err:
        plan_for(fixed)
    text = str(err.value)
    assert "'clip-count-stddev' = 1.5" in text and "'adaptive-clip'" in text and "clip-count-stddev > 1.5" in text
    # with noise-multiplier auto, z is calibrated first; sigma_b = 1 is too small here
    auto = RunConfig.from_run_config({"algorithm": "adaptive-clip", "num-clients": 100, "clients-per-round": 20.0,
                                      "num-rounds": 200, "epsilon": 5.0, "delta": 1e-5,
                                      "clip-count-stddev": 1.0})  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"'clip-count-stddev' = 1 .*calibrated for epsilon = 5.*clip-count-stddev > 1\.3"
    ):
        plan_for(auto)
    with pytest.raises(ConfigError, match="clip-count-stddev"):
        run_batched(auto)  # before any task or output is built


# ------------------------------------------------------------- resume and engines
def test_resume_is_bit_identical_and_restores_c(tmp_path: Path) -> None:
    class Crash(BaseException):
        pass

    def crash(server_round: int, w: np.ndarray) -> None:
        if server_round == 7:
            raise Crash

    values = {"num-clients": 12, "clients-per-round": 5.0, "server-momentum": 0.5, "checkpoint-every": 5,
              "save-trajectory": True, "run-name": "run"}  # fmt: skip
    full = run_batched(_cfg(**values, **{"output-dir": str(tmp_path / "full")})).directory
    cut = _cfg(**values, **{"output-dir": str(tmp_path / "cut")})
    with pytest.raises(Crash):
        run_batched(cut, on_round=crash)
    ckpt = load_checkpoint(tmp_path / "cut" / "run")
    assert ckpt.round == 5 and ckpt.server.adaptive_clip is not None and ckpt.server.adaptive_clip != 5.0
    resumed = run_batched(cut.replace(resume=True)).directory
    for key in ("w_final", "w_random_iterate"):
        np.testing.assert_array_equal(np.load(full / "model.npz")[key], np.load(resumed / "model.npz")[key])
    strip = [{k: v for k, v in r.items() if k != "elapsed_s"} for r in _rows(full)]
    assert strip == [{k: v for k, v in r.items() if k != "elapsed_s"} for r in _rows(resumed)]
    clips = [float(r["clip"]) for r in _rows(full)[1:]]
    assert clips[0] == 5.0 and len(set(clips)) == len(clips)  # C_k moves every round


ENGINE_CASES = {
    "noise": {"num-clients": 12, "clients-per-round": 5.0, "server-momentum": 0.5, "diagnostics": True},
    "no-noise": {"noise-multiplier": 0.0, "clip": 1.0, "target-quantile": 0.8},
    "server-noise": {"noise-placement": "server", "clip": 50.0, "clip-lr": 0.5},
}


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_both_engines_give_the_same_trajectory_and_c(case: str, tmp_path: Path) -> None:
    """The real ClientApp and strategy (in process) against the batched engine: 1e-6, C_k and b_k included."""
    values = {"num-rounds": 8, "seed": 4, "output-dir": str(tmp_path), "save-trajectory": True, **ENGINE_CASES[case]}
    cfg_b, cfg_f = _cfg(**values, **{"run-name": "batched"}), _cfg(**values, **{"run-name": "flower"})
    out_b = run_batched(cfg_b).directory
    out_f = server_app.run(InProcessGrid(client_app, cfg_f.num_clients, cfg_f.to_run_config()), cfg_f).directory
    np.testing.assert_allclose(np.load(out_b / "trajectory.npy"), np.load(out_f / "trajectory.npy"), rtol=1e-6,
                               atol=1e-7)  # fmt: skip
    rows_b, rows_f = _rows(out_b)[1:], _rows(out_f)[1:]
    for col in ("clip", "frac_unclipped"):
        np.testing.assert_allclose([float(r[col]) for r in rows_b], [float(r[col]) for r in rows_f], rtol=1e-9)
    assert all(r["frac_clipped"] == "" for r in rows_b + rows_f)  # not computed for adaptive-clip
    assert len({r["clip"] for r in rows_b}) > 1  # C_k moved
    described = json.loads((out_f / "config.json").read_text())["privacy"]["adaptive_clipping"]
    assert described["count_stddev"] == 2.0


def test_secure_aggregation_carries_the_count(tmp_path: Path) -> None:
    """Flower's SecAgg+ round sums the d+1 encoded coordinates: exactly the batched engine's plain sum of them."""
    cfg = _cfg(**{"num-clients": 10, "clients-per-round": 6.0, "num-rounds": 3, "secure-aggregation": True,
                  "clip": 20.0, "seed": 5, "output-dir": str(tmp_path)})  # fmt: skip
    out = server_app.run(InProcessGrid(client_app, 10, cfg.replace(run_name="secure").to_run_config()),
                         cfg.replace(run_name="secure")).directory  # fmt: skip
    plain = run_batched(cfg.replace(run_name="batched"), threads=1).directory
    np.testing.assert_allclose(np.load(out / "model.npz")["w_final"], np.load(plain / "model.npz")["w_final"],
                               rtol=1e-12, atol=1e-12)  # fmt: skip
    assert [r["clip"] for r in _rows(out)] == [r["clip"] for r in _rows(plain)]
    assert all(r["mean_update_norm"] == "" for r in _rows(out))  # the server saw no individual update


def test_auto_count_noise_is_valid_at_any_noise_and_costs_the_update_at_most_ten_percent() -> None:
    """'auto' picks max(r/20, the sigma_b with z_u = 1.1 z): never refused, and z_u <= 1.1 z (closed form)."""
    for z, r in ((0.5, 100.0), (2.7, 20.0), (21.9, 100.0), (13.86, 5.0)):
        cfg = RunConfig(
            algorithm="adaptive-clip",
            epsilon=0.0,
            noise_multiplier=z,
            num_clients=100,
            clients_per_round=r,
            accountant="rdp",
        )  # fmt: skip  (PLD refuses z = 0.5 at q = 1, K = 200)
        sigma_b = plan_for(cfg).count_stddev
        assert sigma_b == pytest.approx(max(r / 20, z / (2 * math.sqrt(1 - 1 / 1.1**2))), rel=1e-12)
        z_u = (z**-2 - (2 * sigma_b) ** -2) ** -0.5  # Andrew et al. 2021, Theorem 1, written out here
        assert z < z_u <= 1.1 * z * (1 + 1e-12)
    # the case: digits, adaptive-clip, epsilon 5 with the default auto is a valid run (it was refused)
    digits = RunConfig(task="digits", algorithm="adaptive-clip", epsilon=5.0, num_clients=100, clients_per_round=20.0,
                       delta=1e-5)  # fmt: skip
    assert plan_for(digits).count_stddev > plan_for(digits).noise_multiplier / 2


def test_the_quickstart_adaptive_clip_line_trains_the_digits(tmp_path: Path) -> None:
    """docs/getting-started/quickstart.md's line with the defaults (batched engine: the same trajectory as flwr run)."""
    cfg = RunConfig(task="digits", algorithm="adaptive-clip", epsilon=5.0, output_dir=str(tmp_path), run_name="qs")
    result = run_batched(cfg, threads=1)
    clips = [row["clip"] for row in result.history[1:]]
    assert result.epsilon <= 5.0 and result.history[-1]["test_accuracy"] > 0.75
    assert clips[0] == 50.0 and clips[-1] < 25.0 and len(set(clips)) == len(clips)  # C_0 = 50, then C_k moves
