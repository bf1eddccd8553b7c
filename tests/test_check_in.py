"""Random check-ins (issue 46 item 3): every node asked, each taking part by its own coin from the OS.

The decision comes from the OS CSPRNG (``os.urandom`` through ``secrets``), never the server's seed; the node's
``q`` is its own ``check-in-rate`` or the run's, a differing one refused with one error naming the key; a node that
sits out sends ``0 + zeta``; under checked SecAgg+ the node ledger's server account (b) is amplified by ``q``. Every
epsilon is checked against an independent computation: dp-accounting's PLD accountant composing dp-accounting's
events directly, Opacus' RDP accountant, and the exact Gaussian curve (Balle and Wang 2018) solved here with scipy.
"""

from __future__ import annotations

import csv
import json
import math
import random

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from dpfedavg.config import RunConfig
from dpfedavg.core.check_in import (
    CHECK_IN,
    CheckInRateMismatch,
    checks_in,
    node_update,
    resolve_rate,
    sat_out_update,
)
from dpfedavg.core.local import ClientUpdate
from dpfedavg.errors import ConfigError
from dpfedavg.privacy.ledger import NodeLedger, record_release
from dpfedavg.privacy.node_accounts import RELEASED, SERVER
from dpfedavg.privacy.policy import NodePolicy, PolicyError, RoundRefused, check_round
from dpfedavg.server.dp_server import DPServer

DIM = 6
DELTA = 1e-6
RUN = {"task": "quadratic", "dim": DIM, "num-clients": 4, "clients-per-round": 2.0, "num-rounds": 3, "epsilon": 0.0,
       "noise-multiplier": 2.0, "delta": 1e-5, "algorithm": "clip", "clip": 3.0, "seed": 1, "checkpoint-every": 0,
       "sampling": "check-in"}  # fmt: skip


def _cfg(**overrides) -> RunConfig:
    return RunConfig.from_run_config({**RUN, **overrides})


def pld_epsilon(q: float, z: float, count: int, delta: float) -> float:
    """dp-accounting's PLD accountant, composing dp-accounting's Poisson-sampled Gaussian event ``count`` times."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), count)
    return float(accountant.get_epsilon(delta))


def opacus_rdp_epsilon(q: float, z: float, count: int, delta: float) -> float:
    """Opacus' RDP accountant (its own orders and conversion) for ``count`` steps of the sampled Gaussian."""
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(z, q, count)]
    return float(accountant.get_epsilon(delta))


def exact_gaussian_epsilon(sigma: float, delta: float) -> float:
    """The Gaussian mechanism's epsilon at ``delta`` (noise std ``sigma`` over sensitivity 1; Balle and Wang)."""

    def delta_of(eps: float) -> float:
        return norm.cdf(-eps * sigma + 1 / (2 * sigma)) - math.exp(eps) * norm.cdf(-eps * sigma - 1 / (2 * sigma))

    return brentq(lambda eps: delta_of(eps) - delta, 0.0, 500.0, xtol=1e-12)


# ------------------------------------------------------------------ the decision
def test_the_decision_is_drawn_from_os_urandom(monkeypatch) -> None:
    """``secrets`` reads ``os.urandom`` (``random._urandom``) at every draw: all-zero bytes take part, all-one bytes
    sit out; nothing else (no seed, no round) enters the draw."""
    monkeypatch.setattr(random, "_urandom", lambda n: b"\x00" * n)
    assert all(checks_in(q) for q in (1e-9, 0.3, 1.0))
    monkeypatch.setattr(random, "_urandom", lambda n: b"\xff" * n)
    assert not any(checks_in(q) for q in (1e-9, 0.3, 1 - 2**-52))
    assert checks_in(1.0) and not checks_in(0.0)


def test_the_decision_takes_part_with_probability_q_whatever_the_seeds() -> None:
    """20,000 draws at q = 0.3 with numpy's and Python's generators seeded the same before each: the fraction that
    takes part is q within 5 standard deviations (P(fail) < 1e-6), and the draws are not all equal."""
    draws = []
    for _ in range(20_000):
        random.seed(7)
        np.random.seed(7)
        draws.append(checks_in(0.3))
    frac, sd = sum(draws) / len(draws), math.sqrt(0.3 * 0.7 / len(draws))
    assert abs(frac - 0.3) < 5 * sd


def test_a_node_that_sits_out_sends_zero_plus_its_noise_share() -> None:
    """The sat-out reply is the zero update noised exactly as the round says (seeded here: the same stream), the
    participating one the trained update itself."""
    cfg = _cfg()
    ins = DPServer(cfg, DIM).instructions(1, 4)
    trained = ClientUpdate(noisy=np.full(DIM, 5.0), clean=np.ones(DIM), update_norm=1.0)
    sat_out = sat_out_update(2, DIM, ins, np.float64)
    assert sat_out.update_norm == 0 and np.all(sat_out.clean == 0)
    np.testing.assert_allclose(np.std(sat_out.noisy), ins.noise_std, rtol=1.0)  # noise, not zero
    assert np.any(sat_out.noisy != 0)
    common = {"q": 0.5, "client_id": 2, "dim": DIM, "ins": ins, "dtype": np.float64}
    out = [node_update(trained, sampling=CHECK_IN, **common) for _ in range(64)]  # P(all alike) = 2^-63
    kinds = {("trained" if u is trained else "sat-out") for u in out}
    assert kinds == {"trained", "sat-out"}
    for u in out:
        if u is not trained:
            np.testing.assert_array_equal(u.noisy, sat_out.noisy)
    assert all(node_update(trained, sampling="poisson", **common) is trained for _ in range(16))


# ------------------------------------------------------------------ q: the node's or the run's
def test_the_nodes_q_is_its_check_in_rate_or_the_runs_and_a_different_one_is_refused() -> None:
    assert resolve_rate(None, 0.25) == 0.25
    assert resolve_rate(0.25, 0.25) == 0.25
    with pytest.raises(CheckInRateMismatch, match=r"check-in-rate = 0\.1 differs from the run's q .* = 0\.25"):
        resolve_rate(0.1, 0.25)
    cfg = _cfg(**{"clients-per-round": 1.0})
    ins = DPServer(cfg, DIM).instructions(1, 4)
    assert check_round(NodePolicy.from_node_config({"check-in-rate": "0.25"}), ins, secure_round=False, cfg=cfg)
    with pytest.raises(RoundRefused, match=r"\(check-in-rate\): this node's check-in-rate = 0\.5 differs") as err:
        check_round(NodePolicy.from_node_config({"check-in-rate": 0.5}), ins, secure_round=False, cfg=cfg)
    assert err.value.rule == "check-in-rate"
    # a Poisson run is the server's sampling: the node's rate does not apply (account (b) is then unamplified)
    poisson = _cfg(sampling="poisson")
    check_round(NodePolicy.from_node_config({"check-in-rate": 0.9}), ins, secure_round=False, cfg=poisson)


@pytest.mark.parametrize("value", [0, "0", 1.5, -0.1, "x", True, "nan"])
def test_a_bad_check_in_rate_is_one_policy_error_naming_the_key(value) -> None:
    with pytest.raises(PolicyError, match=r"'check-in-rate' = .*: expected a number in \(0, 1\]"):
        NodePolicy.from_node_config({"check-in-rate": value})


@pytest.mark.parametrize(
    ("values", "key"),
    [({"noise-placement": "server"}, "noise-placement"), ({"clients-per-node": 2}, "clients-per-node"),
     ({"canary-clients": 2}, "canary-clients"),
     ({"algorithm": "adaptive-clip"}, "algorithm"),
     ({"noise-mechanism": "banded-mf", "noise-placement": "server"}, "noise-mechanism")],
)  # fmt: skip
def test_check_ins_where_they_cannot_replace_the_servers_sampling_are_refused_naming_the_key(values, key) -> None:
    with pytest.raises(ConfigError, match=rf"'sampling' = 'check-in' with '{key}'"):
        _cfg(**values)
    with pytest.raises(ConfigError, match=r"'sampling' = .*: allowed values are 'poisson', 'check-in'"):
        _cfg(sampling="node")


def test_an_in_process_engine_refuses_check_ins_before_anything_is_written(tmp_path) -> None:
    from dpfedavg.server.run import prepare_run

    cfg = _cfg(**{"output-dir": str(tmp_path), "run-name": "x"})
    with pytest.raises(ConfigError, match=r"'sampling' = 'check-in' on the 'batched' engine: .* Flower only"):
        prepare_run(cfg, engine="batched")
    assert not (tmp_path / "x").exists()


def test_the_server_asks_every_client_every_round() -> None:
    server = DPServer(_cfg(**{"num-clients": 50, "clients-per-round": 1.0}), DIM)
    for k in (1, 2, 3):
        np.testing.assert_array_equal(server.sample_clients(k), np.arange(50))


# ------------------------------------------------------------------ the ledger: account (b) amplified by the node's q
def _release(tmp_path, cfg: RunConfig, k: int, *, secure: bool, node: dict | None = None, run_id: int = 1) -> dict:
    node_config = {"privacy-ledger": str(tmp_path / "ledger.jsonl"), "secure-noise": True, **(node or {})}
    policy = NodePolicy.from_node_config(node_config)
    ins = check_round(policy, DPServer(cfg, DIM).instructions(k, cfg.num_clients), secure_round=False, cfg=cfg)
    record_release(node_config, run_id, ins, cfg, message_type="train", secure_aggregation=secure)
    return NodeLedger(tmp_path / "ledger.jsonl").accounts(NodePolicy())


def test_the_ledger_charges_a_checked_secagg_check_in_at_the_nodes_q(tmp_path) -> None:
    """The server account of a check-in run through checked SecAgg+: K rounds of PoissonSampled(q, Gaussian(z_own))
    (z_own = z / sqrt(n) = 1), charged at the first answer, as dp-accounting composes it; a redone round one more;
    the state rebuilt from the file gives the same. Account (a): the run's plan, K rounds at (q, z)."""
    cfg = _cfg(**{"num-rounds": 20, "clients-per-round": 1.0})  # q = 0.25, z = 2, n = 4: z_own = 1
    q, z_own, k = 0.25, 1.0, 20
    first = _release(tmp_path, cfg, 1, secure=True, node={"check-in-rate": 0.25})
    assert first[SERVER] == pytest.approx(pld_epsilon(q, z_own, k, DELTA), rel=5e-3)
    assert first[RELEASED] == pytest.approx(pld_epsilon(q, 2.0, k, DELTA), rel=5e-3)
    assert first[SERVER] < 0.5 * exact_gaussian_epsilon(z_own / math.sqrt(k), DELTA)  # amplified: far below
    assert _release(tmp_path, cfg, 2, secure=True)[SERVER] == first[SERVER]  # another round of the plan: nothing
    redone = _release(tmp_path, cfg, 2, secure=True)
    assert redone[SERVER] == pytest.approx(pld_epsilon(q, z_own, k + 1, DELTA), rel=5e-3)
    entries = [json.loads(line)["entry"] for line in (tmp_path / "ledger.jsonl").read_text().splitlines()[1:]]
    assert [e["check_in"] for e in entries] == [True] * 3
    for suffix in ("", "-wal", "-shm"):  # the state is a cache: rebuilt from the file, the same accounts
        (tmp_path / f"ledger.jsonl.state{suffix}").unlink(missing_ok=True)
    assert NodeLedger(tmp_path / "ledger.jsonl").accounts(NodePolicy()) == pytest.approx(redone, rel=1e-9)


def test_a_check_in_without_secagg_or_a_poisson_run_is_charged_unamplified(tmp_path) -> None:
    """Without checked SecAgg+ the server account charges each release as the Gaussian of the node's own share
    (exact curve, scipy); a Poisson run through SecAgg+ too (the server's sampler). Both compose exactly."""
    cfg = _cfg(**{"num-rounds": 20, "clients-per-round": 1.0})
    assert _release(tmp_path, cfg, 1, secure=False)[SERVER] == pytest.approx(exact_gaussian_epsilon(1.0, DELTA),
                                                                              rel=1e-6)  # fmt: skip
    poisson = _cfg(**{"num-rounds": 20, "clients-per-round": 1.0, "sampling": "poisson"})
    both = _release(tmp_path, poisson, 1, secure=True, run_id=2)[SERVER]
    assert both == pytest.approx(exact_gaussian_epsilon(1 / math.sqrt(2), DELTA), rel=1e-6)


def test_a_gaussian_and_an_amplified_charge_compose(tmp_path) -> None:
    """One unamplified release (mu = 1) then a check-in plan: the server account is their composition (dp-accounting's
    PLD of both events)."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    cfg = _cfg(**{"num-rounds": 10, "clients-per-round": 1.0})
    _release(tmp_path, cfg, 1, secure=False, run_id=1)
    got = _release(tmp_path, cfg, 1, secure=True, run_id=2)[SERVER]
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.GaussianDpEvent(1.0))
    accountant.compose(dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(1.0)), 10)
    assert got == pytest.approx(accountant.get_epsilon(DELTA), rel=5e-3)


def test_the_server_budget_refuses_a_check_in_plan_past_max_epsilon(tmp_path) -> None:
    """max-epsilon holds the amplified account: a plan that would pass it is refused, nothing recorded."""
    cfg = _cfg(**{"num-rounds": 200, "clients-per-round": 1.0})
    need = pld_epsilon(0.25, 1.0, 200, DELTA)
    with pytest.raises(RoundRefused, match=r"\(max-epsilon\): .* server account .* with PLD for check-ins"):
        _release(tmp_path, cfg, 1, secure=True, node={"max-epsilon": need * 0.9})
    assert NodeLedger(tmp_path / "ledger.jsonl").read() == []


# ------------------------------------------------------------------ a seeded run, end to end in process
def test_a_seeded_check_in_run_under_secagg_asks_every_node_and_reports_the_independent_epsilon(tmp_path) -> None:
    """The project's ServerApp (SecAgg+) and ClientApp on four policy nodes, q = 0.5: every node is asked and
    replies every round (the server's metrics cannot say who took part), the run's epsilon is K rounds of
    PoissonSampled(q, Gaussian(z)) as dp-accounting composes them (and at most Opacus' RDP bound), and each node's
    server account is K rounds at (q, z_own = z / 2)."""
    from dpfedavg.flower import client_app as client_app_module
    from dpfedavg.flower import server_app
    from dpfedavg.flower.testing import InProcessGrid

    cfg = _cfg(**{"secure-aggregation": True, "output-dir": str(tmp_path), "run-name": "check-in"})
    nodes = {"require-secure-aggregation": True, "secure-noise": True, "check-in-rate": 0.5}
    ledgers = []

    grid = InProcessGrid(client_app_module.app, 4, cfg.to_run_config(), node_config=nodes)
    for context in grid.contexts.values():  # each node its own ledger
        path = tmp_path / f"ledger-{context.node_config['partition-id']}.jsonl"
        context.node_config["privacy-ledger"] = str(path)
        ledgers.append(path)
    out = server_app.run(grid, cfg).directory
    rows = list(csv.DictReader((out / "metrics.csv").open()))[1:]
    assert [(int(r["num_sampled"]), int(r["num_received"]), int(r["skipped"])) for r in rows] == [(4, 4, 0)] * 3
    epsilon = json.loads((out / "config.json").read_text())["final"]["epsilon"]
    independent = pld_epsilon(0.5, 2.0, 3, cfg.delta)
    assert epsilon == pytest.approx(independent, rel=5e-3)
    assert independent <= opacus_rdp_epsilon(0.5, 2.0, 3, cfg.delta)
    for path in ledgers:
        server = NodeLedger(path).accounts(NodePolicy())[SERVER]
        assert server == pytest.approx(pld_epsilon(0.5, 1.0, 3, DELTA), rel=5e-3)
