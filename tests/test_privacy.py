"""Privacy accounting, calibration, noise placement, the budget stop and the privacy CLI."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict

from dpfedavg.config import ConfigError, RunConfig
from dpfedavg.core import SECURE_NOISE_SEED
from dpfedavg.flower import server_app
from dpfedavg.flower.client_app import app as client_app
from dpfedavg.flower.strategy import DPFedAvg
from dpfedavg.flower.testing import InProcessGrid
from dpfedavg.privacy.accounting import (
    RoundAccountant,
    RoundEvent,
    calibrate_noise_multiplier,
    epsilon_for,
    plan_privacy,
    realized_noise_multiplier,
)
from dpfedavg.server.dp_server import DPServer

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- calibration
@pytest.mark.parametrize(
    ("epsilon", "delta", "q", "rounds", "kind"),
    [
        (5.0, 1e-6, 1.0, 200, "pld"),  # the default quadratic run
        (5.0, 1e-5, 0.2, 100, "pld"),  # FMNIST-like, eps = 5
        (1.5, 1e-5, 0.2, 100, "rdp"),  # FMNIST-like, eps = 1.5
        (2.0, 1e-5, 0.05, 50, "rdp"),
    ],
)
def test_calibration_round_trip(epsilon: float, delta: float, q: float, rounds: int, kind: str) -> None:
    z = calibrate_noise_multiplier(epsilon, delta, q, rounds, kind)
    assert epsilon_for(z, q, rounds, delta, kind) <= epsilon
    assert epsilon_for(0.99 * z, q, rounds, delta, kind) > epsilon


def test_epsilon_is_monotone_in_rounds_and_in_q() -> None:
    for kind in ("rdp", "pld"):
        acc = RoundAccountant(kind, 1e-5)
        eps = [acc.compose(RoundEvent(0.2, 1.5)) for _ in range(30)]
        assert all(b > a for a, b in zip(eps, eps[1:], strict=False)), kind
        by_q = [epsilon_for(1.5, q, 20, 1e-5, kind) for q in (0.01, 0.05, 0.2, 0.5, 1.0)]
        assert all(b > a for a, b in zip(by_q, by_q[1:], strict=False)), kind


def test_pld_is_tighter_than_rdp() -> None:
    for q, z, k in [(0.2, 1.0, 100), (1.0, 13.86, 200), (0.01, 0.8, 1000)]:
        assert epsilon_for(z, q, k, 1e-5, "pld") < epsilon_for(z, q, k, 1e-5, "rdp")


@pytest.mark.parametrize(
    ("q", "z", "steps", "delta"), [(0.2, 1.0, 100, 1e-5), (0.01, 1.1, 1000, 1e-5), (1.0, 13.86, 200, 1e-6)]
)
def test_rdp_agrees_with_opacus_within_5_percent(q: float, z: float, steps: int, delta: float) -> None:
    """An independent implementation: Opacus' RDP accountant (same orders as dp-accounting's default)."""
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
    eps_opacus, _ = get_privacy_spent(
        orders=orders, rdp=compute_rdp(q=q, noise_multiplier=z, steps=steps, orders=orders), delta=delta
    )
    ours = epsilon_for(z, q, steps, delta, "rdp")
    assert ours == pytest.approx(float(eps_opacus), rel=0.05)


def test_accountant_rebuilds_from_history_and_peeks_without_composing() -> None:
    for kind in ("rdp", "pld"):
        acc = RoundAccountant(kind, 1e-5)
        events = [RoundEvent(0.3, z) for z in (1.0, 1.0, 0.8, None, 1.0, 1.2)]
        for e in events:
            acc.compose(e)
        peek = acc.epsilon_after(RoundEvent(0.3, 1.0))
        assert acc.rounds == 6 and peek > acc.epsilon
        rebuilt = RoundAccountant(kind, 1e-5, history=list(acc.history))
        assert rebuilt.epsilon == pytest.approx(acc.epsilon, rel=1e-12)
        assert acc.compose(RoundEvent(0.3, 1.0)) == pytest.approx(peek, rel=1e-12)


def test_no_noise_is_infinite_epsilon_and_empty_rounds_are_free() -> None:
    acc = RoundAccountant("pld", 1e-5)
    acc.compose(RoundEvent(0.5, None))
    assert acc.epsilon == 0.0
    acc.compose(RoundEvent(0.5, 0.0))
    assert math.isinf(acc.epsilon)


def test_bad_privacy_parameters() -> None:
    with pytest.raises(ValueError, match=r"q must be in \[0, 1\]"):
        RoundEvent(1.2, 1.0)
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        RoundAccountant("pld", 0.0)
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        calibrate_noise_multiplier(0.0, 1e-5, 0.1, 10, "pld")
    with pytest.raises(ConfigError, match="exceeded by the first round"):
        plan_privacy(RunConfig(epsilon=0.0, noise_multiplier=0.5, max_epsilon=0.1))
    with pytest.raises(ConfigError, match="adds no noise"):
        plan_privacy(RunConfig(algorithm="none", max_epsilon=3.0))


# ------------------------------------------------ the noise never depends on who took part
def test_every_placement_charges_the_nominal_z_whoever_replies() -> None:
    z, r = 2.0, 10.0
    for placement in ("client", "client-calibrated", "server"):
        for sampled, included in ((10, 10), (7, 5), (3, 0), (0, 0)):
            assert realized_noise_multiplier(placement, z, r, sampled, included) == z
    # the old `client` accounting (kept for the auditor's tests only) charged z sqrt(m / r) and nothing for m = 0
    assert realized_noise_multiplier("legacy-client", z, r, 7, 5) == pytest.approx(z * math.sqrt(0.5))
    assert realized_noise_multiplier("legacy-client", z, r, 3, 0) is None


@pytest.mark.parametrize("placement", ["client-calibrated", "client", "server"])
def test_top_up_makes_the_released_sum_carry_zc_for_any_count(placement: str) -> None:
    """m of |S_k| included: m client shares + the server's top-up = (zC)^2 exactly (variance bookkeeping)."""
    from dpfedavg.core.mechanism import get_placement

    p, z, c, r = get_placement(placement), 1.7, 3.0, 8.0
    for sampled in (8,) if placement == "client" else (0, 1, 5, 8, 13):
        for included in range(sampled + 1):
            variance = included * p.client_std(z, c, r, sampled) ** 2 + p.server_std(z, c, r, sampled, included) ** 2
            assert variance == pytest.approx((z * c) ** 2, rel=1e-12)


def test_client_placement_needs_full_participation() -> None:
    with pytest.raises(ConfigError, match=r"'noise-placement' = 'client' with 'clients-per-round' = 5 < 'num-clients'"):
        RunConfig.from_run_config({"noise-placement": "client", "num-clients": 10, "clients-per-round": 5.0})
    assert RunConfig.from_run_config({"noise-placement": "client", "num-clients": 10, "clients-per-round": 10.0})


def _run(tmp_path: Path, name: str, values: dict, client_fn=client_app):
    cfg = RunConfig.from_run_config(
        {"num-clients": 10, "dim": 20, "num-rounds": 5, "output-dir": str(tmp_path), "run-name": name, **values}
    )
    out = server_app.run(InProcessGrid(client_fn, cfg.num_clients, cfg.to_run_config()), cfg)
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    return cfg, out, rows


def _dropping(dropped: set[int]):
    def fn(msg: Message, context: Context):
        if msg.metadata.message_type == "train" and int(context.node_config["partition-id"]) in dropped:
            return None
        return client_app(msg, context)

    return fn


@pytest.mark.parametrize("placement", ["client", "client-calibrated", "server"])
def test_dropouts_spend_exactly_the_nominal_epsilon(tmp_path: Path, placement: str) -> None:
    """3 of 10 clients drop out every round: the server tops up their noise, so epsilon is the planned one."""
    values = {"clients-per-round": 10.0, "epsilon": 0.0, "noise-multiplier": 3.0, "noise-placement": placement}
    cfg, out, rows = _run(tmp_path, placement, values, _dropping({1, 4, 7}))
    nominal = epsilon_for(3.0, 1.0, cfg.num_rounds, cfg.delta, "pld")
    spent = float(rows[-1]["epsilon"])
    assert all(int(r["num_dropped"]) == 3 for r in rows[1:])
    assert all(float(r["noise_multiplier"]) == 3.0 for r in rows[1:])
    assert spent == pytest.approx(nominal, rel=1e-9)
    assert json.loads((out / "config.json").read_text())["final"]["epsilon"] == pytest.approx(spent)


def test_poisson_rounds_are_charged_the_same_event_whatever_the_count(tmp_path: Path) -> None:
    values = {"clients-per-round": 5.0, "epsilon": 0.0, "noise-multiplier": 2.0, "num-rounds": 8}
    cfg, _, rows = _run(tmp_path, "poisson", values)
    counts = [int(r["num_received"]) for r in rows[1:]]
    assert len(set(counts)) > 1  # the seed gives rounds of different sizes ...
    for k, row in enumerate(rows[1:], start=1):  # ... and every round costs the same
        assert float(row["epsilon"]) == pytest.approx(epsilon_for(2.0, 0.5, k, cfg.delta, "pld"), rel=1e-9)


def _aggregate_noise(placement: str, rounds: int, seed: int, dropped: frozenset[int] = frozenset()) -> np.ndarray:
    """Noise in the average a_k: a_k - (1/r) sum g_i over the included clients, over several rounds."""
    cfg = RunConfig.from_run_config(
        {
            "num-clients": 10,
            "clients-per-round": 10.0,
            "dim": 200,
            "num-rounds": rounds,
            "seed": seed,
            "epsilon": 0.0,
            "noise-multiplier": 1.5,
            "noise-placement": placement,
            "diagnostics": True,
        }
    )
    grid = InProcessGrid(client_app, 10, cfg.to_run_config())
    strategy = DPFedAvg(cfg, dim=200)
    strategy.discover_clients(grid)
    from flwr.app import ConfigRecord

    from dpfedavg.flower.protocol import ARRAYS, to_array_record

    samples = []
    w = np.zeros(200)
    for k in range(1, rounds + 1):
        messages = list(strategy.configure_train(k, to_array_record(w), ConfigRecord(), grid))
        replies = [
            m for m in grid.send_and_receive(messages) if strategy.client_of_node[m.metadata.src_node_id] not in dropped
        ]
        arrays, _ = strategy.aggregate_train(k, replies)
        clean = sum(r.content["diagnostics"]["clean-update"].numpy() for r in replies) / 10.0
        a = (w - arrays["w"].numpy()) / strategy.history[k].beta  # w_{k+1} = w_k - beta a_k (mu = 0)
        samples.append(a - clean)
        assert ARRAYS in replies[0].content
    return np.concatenate(samples)


def test_server_and_client_calibrated_noise_have_the_same_distribution() -> None:
    """Both put N(0, (zC/r)^2 I) in the average; KS tests with fixed seeds (p > 0.01)."""
    from scipy import stats

    sigma = 1.5 * 50.0 / 10.0
    server = _aggregate_noise("server", rounds=15, seed=1)
    calibrated = _aggregate_noise("client-calibrated", rounds=15, seed=2)
    assert stats.ks_2samp(server, calibrated).pvalue > 0.01
    for sample in (server, calibrated):
        assert stats.kstest(sample / sigma, "norm").pvalue > 0.01
        assert sample.std() == pytest.approx(sigma, rel=0.05)  # 3000 samples: SE of std ~1.3%


@pytest.mark.parametrize("placement", ["client-calibrated", "client"])
def test_released_noise_has_the_nominal_std_when_clients_drop(placement: str) -> None:
    """Measured, not accounted: with 4 of 10 clients missing, the noise in a_k still has std zC/r.

    Without the server's top-up it would be sqrt(6/10) of it (0.77): the variance would tell how many
    clients took part. 3000 samples; the standard error of the std is about 1.3%, the tolerance 5%.
    """
    from scipy import stats

    sigma = 1.5 * 50.0 / 10.0
    sample = _aggregate_noise(placement, rounds=15, seed=3, dropped=frozenset({0, 2, 5, 9}))
    assert sample.std() == pytest.approx(sigma, rel=0.05)
    assert stats.kstest(sample / sigma, "norm").pvalue > 0.01


# ------------------------------------------------------------------ reporting
def test_quadratic_run_calibrated_to_epsilon_5_ends_at_or_below_5(tmp_path: Path) -> None:
    values = {
        "num-clients": 100,
        "clients-per-round": 100.0,
        "dim": 200,
        "num-rounds": 12,
        "epsilon": 5.0,
        "delta": 1e-6,
    }
    _, out, rows = _run(tmp_path, "eps5", values)
    eps = [float(r["epsilon"]) for r in rows[1:]]
    assert all(b > a for a, b in zip(eps, eps[1:], strict=False))
    assert 4.95 < eps[-1] <= 5.0
    privacy = json.loads((out / "config.json").read_text())["privacy"]
    assert privacy["noise_multiplier_calibrated"] and privacy["accountant"] == "pld" and privacy["delta"] == 1e-6
    assert privacy["sigma"] == pytest.approx(privacy["noise_multiplier"] * 50.0 / 100.0)


def test_budget_stops_cleanly_before_the_exceeding_round(tmp_path: Path) -> None:
    values = {"clients-per-round": 10.0, "epsilon": 0.0, "noise-multiplier": 3.0, "max-epsilon": 4.0, "num-rounds": 20}
    cfg, out, rows = _run(tmp_path, "budget", values)
    eps = [float(r["epsilon"]) for r in rows[1:]]
    completed = len(eps)
    assert 1 <= completed < 20 and eps[-1] <= 4.0
    assert epsilon_for(3.0, 1.0, completed + 1, cfg.delta, "pld") > 4.0  # the next round would have exceeded it
    final = json.loads((out / "config.json").read_text())["final"]
    assert final["stopped_by_budget_before_round"] == completed + 1 and final["rounds_completed"] == completed
    model = np.load(out / "model.npz")
    assert 0 <= int(model["random_iterate_round"]) < completed and model["w_final"].shape == (20,)


def test_no_dp_is_said_loudly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    logger = logging.getLogger("dpfedavg")
    logger.addHandler(caplog.handler)
    try:
        _, _, rows = _run(tmp_path, "nodp", {"clients-per-round": 10.0, "epsilon": 0.0, "noise-multiplier": 0.0})
    finally:
        logger.removeHandler(caplog.handler)
    assert "NO DIFFERENTIAL PRIVACY" in caplog.text
    assert all(math.isinf(float(r["epsilon"])) for r in rows[1:])


# ------------------------------------------------------------------------ CLI
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "run_sim.py"), *args], capture_output=True, text=True, timeout=300
    )


def test_privacy_cli_json() -> None:
    args = [
        "privacy",
        "--epsilon",
        "5",
        "--delta",
        "1e-5",
        "--num-clients",
        "3000",
        "--clients-per-round",
        "600",
        "--rounds",
        "100",
    ]
    result = _cli(*args, "--accountant", "rdp", "--clip", "50", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {"noise_multiplier", "sigma", "epsilon_rdp", "epsilon_pld"} <= set(report)
    z = report["noise_multiplier"]
    assert report["epsilon_rdp"] <= 5.0 < epsilon_for(0.99 * z, 0.2, 100, 1e-5, "rdp")
    assert report["epsilon_pld"] < report["epsilon_rdp"]
    assert report["sigma"] == pytest.approx(z * 50 / 600)
    human = _cli(*args)
    assert human.returncode == 0 and "noise multiplier z" in human.stdout and "paper" in human.stdout


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--delta", "1.5"], "--delta = 1.5"),
        (["--epsilon", "0"], "--epsilon = 0"),
        (["--clients-per-round", "4000"], "exceeds --num-clients"),
    ],
)
def test_privacy_cli_bad_flags(flags: list[str], fragment: str) -> None:
    base = {
        "--epsilon": "5",
        "--delta": "1e-5",
        "--num-clients": "3000",
        "--clients-per-round": "600",
        "--rounds": "10",
    }
    for i in range(0, len(flags), 2):
        base[flags[i]] = flags[i + 1]
    result = _cli("privacy", *[x for kv in base.items() for x in kv])
    assert result.returncode == 2
    assert fragment in result.stderr and "Traceback" not in result.stderr


# ------------------------------------------------------------------ secure mode
def _seeded_train_message(cfg: RunConfig, node: int, dim: int) -> Message:
    from dpfedavg.flower.protocol import ARRAYS, CONFIG, instructions_to_config_record, to_array_record

    ins = DPServer(cfg, dim).instructions(3, cfg.num_clients)
    assert ins.noise_seed != SECURE_NOISE_SEED  # the server sends a replayable seed
    content = RecordDict({ARRAYS: to_array_record(np.zeros(dim)), CONFIG: instructions_to_config_record(ins)})
    return Message(content, dst_node_id=node, message_type="train")


@pytest.mark.parametrize("node_says", [True, False], ids=["node-secure", "node-default"])
def test_the_client_enforces_secure_noise_from_its_own_node_config(node_says: bool) -> None:
    """A SuperNode started with secure-noise=true ignores the server's noise seed; by default it follows it."""
    from dpfedavg.flower.protocol import ARRAYS, METRICS, UPDATE_KEY

    dim = 2000
    cfg = RunConfig.from_run_config({"num-clients": 4, "clients-per-round": 4.0, "dim": dim, "epsilon": 0.0,
                                     "noise-multiplier": 1.0})  # fmt: skip
    grid = InProcessGrid(client_app, 4, cfg.to_run_config(), node_config={"secure-noise": node_says})
    node = next(iter(grid.contexts))
    replies = [grid.send_and_receive([_seeded_train_message(cfg, node, dim)])[0] for _ in range(2)]
    updates = [r.content[ARRAYS][UPDATE_KEY].numpy() for r in replies]
    metrics = dict(replies[0].content[METRICS])
    if node_says:
        assert np.corrcoef(updates[0] - updates[0].mean(), updates[1] - updates[1].mean())[0, 1] < 0.9
        assert "update-norm" not in metrics and "clipped" not in metrics  # no un-noised statistic leaves the node
    else:
        np.testing.assert_array_equal(updates[0], updates[1])  # seeded: replayable by whoever knows the seed
        assert "update-norm" in metrics


def test_secure_mode_draws_the_sampling_from_the_os_not_the_seed() -> None:
    values = {"num-clients": 200, "clients-per-round": 100.0}
    seeded = [DPServer(RunConfig.from_run_config(values), 10).sample_clients(1) for _ in range(2)]
    secure = [DPServer(RunConfig.from_run_config({**values, "secure-noise": True}), 10).sample_clients(1)
              for _ in range(2)]  # fmt: skip
    np.testing.assert_array_equal(seeded[0], seeded[1])
    assert not np.array_equal(secure[0], secure[1])  # P(equal) = 2^-200


@pytest.mark.parametrize(
    ("values", "level"),
    [({}, "seeded"), ({"secure-noise": True}, "dp"), ({"secure-noise": True, "diagnostics": True}, "none")],
)
def test_the_guarantee_is_labelled_and_secure_mode_withholds_training_data_metrics(
    tmp_path: Path, values: dict, level: str, caplog: pytest.LogCaptureFixture
) -> None:
    from dpfedavg.engines.batched import run_batched

    cfg = RunConfig.from_run_config({"num-clients": 10, "clients-per-round": 5.0, "dim": 20, "num-rounds": 3,
                                     "output-dir": str(tmp_path), "run-name": level, **values})  # fmt: skip
    with caplog.at_level("INFO"):
        out = run_batched(cfg)
    described = json.loads((out / "config.json").read_text())
    assert described["privacy"]["guarantee"]["level"] == level
    assert described["final"]["guarantee"] == level
    assert (out / "metrics.png").stat().st_size > 1000  # the headline metric and epsilon over the rounds
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    rows = list(csv.DictReader((out / "metrics.csv").open()))[1:]
    if level == "seeded":
        assert "NONE against anyone who knows seed = 0" in caplog.text
        assert "seeded mode: no protection against anyone who knows the seed" in caplog.text
        assert "suboptimality" in header and rows[0]["mean_update_norm"] != ""
    else:
        assert "suboptimality" not in header  # computed from the clients' data (A_i, w_i*)
        assert all(r["mean_update_norm"] == "" and r["frac_clipped"] == "" for r in rows)
    if level == "none":
        assert "NO privacy guarantee" in caplog.text


def test_budget_is_a_hard_cap_with_dropouts(tmp_path: Path) -> None:
    """Issue 16's case: budget 4, z = 3, 2 of 10 replies in round 6; epsilon never passes the budget."""
    dropped = set(range(2, 10))

    def fn(msg: Message, context: Context):
        if msg.metadata.message_type == "train" and int(context.node_config["partition-id"]) in dropped:
            if int(msg.content["config"]["server-round"]) >= 6:
                return None
        return client_app(msg, context)

    values = {"clients-per-round": 10.0, "epsilon": 0.0, "noise-multiplier": 3.0, "max-epsilon": 4.0,
              "num-rounds": 30}  # fmt: skip
    cfg, out, rows = _run(tmp_path, "budget", values, fn)
    spent = [float(r["epsilon"]) for r in rows[1:]]
    assert max(spent) <= 4.0
    allowed = max(k for k in range(1, 31) if epsilon_for(3.0, 1.0, k, cfg.delta, "pld") <= 4.0)
    assert len(spent) == allowed  # it stops exactly before the first round that would exceed the budget
    assert json.loads((out / "config.json").read_text())["final"]["stopped_by_budget_before_round"] == allowed + 1


# ------------------------------------- reported epsilon against an independent computation
def _pair_variances(placement: str, z: float, c: float, n: int) -> tuple[float, float]:
    """Variances of the released sum's noise per coordinate in the two neighbouring federations (q = 1).

    Add/remove: n - 1 clients vs n (the canary); zero-out: n clients in both. Every sampled client is
    included; the variance is what the placement object says the clients and the server add
    (``AuditSetting.sum_variance``, without the auditor's rounding snap).
    """
    from dpfedavg.core.mechanism import ZERO_OUT
    from dpfedavg.privacy.audit import AuditSetting

    setting = AuditSetting(placement, n, float(n), dim=1, rounds=1, noise_multiplier=z, clip=c, delta=1e-6)
    v1 = setting.sum_variance(n)
    return (v1, v1) if setting.adjacency == ZERO_OUT else (setting.sum_variance(n - 1), v1)


@pytest.mark.parametrize(
    ("n", "dim", "rounds", "epsilon", "delta"),
    [(10, 2000, 3, 2.0, 1e-5), (100, 200, 200, 5.0, 1e-6)],  # a high-dimensional one; the default run
)
def test_reported_epsilon_is_the_true_privacy_loss_of_each_placement(n, dim, rounds, epsilon, delta) -> None:
    """The exact epsilon of what each placement releases (numerical integration with scipy, no accountant).

    At q = 1 a run releases, over K rounds, N(0, v0 I_{Kd}) against N(mu, v1 I_{Kd}) with ||mu||^2 = K C^2.
    Every placement after the fix has v0 = v1 = (zC)^2, and the reported epsilon is that pair's exact one (PLD:
    a slightly pessimistic discretization). The old `client` placement (legacy-client) has v0 != v1, and
    the true epsilon is far above what it reported: 9.4 against 5.0 for the old default run.
    """
    from dpfedavg.privacy.audit import exact_epsilon_gaussian_pair

    c = 50.0
    z = calibrate_noise_multiplier(epsilon, delta, 1.0, rounds, "pld")
    reported = epsilon_for(z, 1.0, rounds, delta, "pld")
    assert reported <= epsilon
    for placement in ("client-calibrated", "server", "client", "legacy-client"):
        v0, v1 = _pair_variances(placement, z, c, n)
        true = exact_epsilon_gaussian_pair(mean_norm=c * math.sqrt(rounds), var0=v0, var1=v1, dim=dim * rounds,
                                           delta=delta)  # fmt: skip
        if placement == "legacy-client":
            assert true > 1.5 * reported, (placement, true, reported)  # what the old code claimed was wrong
        else:
            assert v0 == pytest.approx((z * c) ** 2, rel=1e-12) and v1 == pytest.approx(v0, rel=1e-12)
            assert reported >= true * (1 - 1e-4), (placement, true, reported)  # never optimistic
            assert reported <= true * 1.01, (placement, true, reported)  # and tight


def test_the_server_core_and_the_batched_engine_import_no_flower() -> None:
    code = "import sys, dpfedavg.engines.batched, dpfedavg.server, dpfedavg.privacy; assert 'flwr' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_secure_mode_draws_the_random_iterate_from_the_os_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """begin_round's two secret draws (S_k and the reservoir step for k~) come from secure_rng, not the seed."""
    import dpfedavg.server.dp_server as dp_server

    calls: list[int] = []

    def counting_secure_rng() -> np.random.Generator:
        calls.append(1)
        return np.random.default_rng(len(calls))

    monkeypatch.setattr(dp_server, "secure_rng", counting_secure_rng)
    server = DPServer(RunConfig.from_run_config({"num-clients": 10, "clients-per-round": 5.0, "secure-noise": True}), 4)
    server.begin_round(1, np.zeros(4))
    assert len(calls) == 2  # sampling and k~
    seeded = DPServer(RunConfig.from_run_config({"num-clients": 10, "clients-per-round": 5.0}), 4)
    seeded.begin_round(1, np.zeros(4))
    assert len(calls) == 2  # the seeded run never asks the OS
