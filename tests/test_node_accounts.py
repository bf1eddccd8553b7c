"""The node ledger's two accounts, every release charged as what it is, and a resume that is not a new run.

Issue 46 items 2 and 4, issue 47 item 4. Every round goes through the node's one guard
(`dpfedavg.privacy.node_guard.guard`, the path both ClientApps take) with the instructions the server would send. Every
epsilon is checked against an independent computation: the exact (epsilon, delta) curve of the Gaussian mechanism
(Balle & Wang 2018, Theorem 8, solved here with scipy; ``k`` releases of a Gaussian with multiplier ``z`` compose to
one of ``z / sqrt(k)``, and of ``z_1 .. z_k`` to one of ``(sum z_i^-2)^-1/2``), dp-accounting's PLD accountant
composing the dp-accounting events directly, and, for banded MF, the strategy matrix built here with numpy.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.special import comb
from scipy.stats import norm

from dpfedavg.config import RunConfig
from dpfedavg.flower.protocol import CLIENT_IDS, instructions_to_config_record
from dpfedavg.privacy.ledger import NodeLedger, Release
from dpfedavg.privacy.node_accounts import RELEASED, SERVER
from dpfedavg.privacy.node_guard import CLIENT_APP, Route, TrainRequest, guard
from dpfedavg.privacy.policy import NodePolicy, PolicyError
from dpfedavg.server.dp_server import DPServer

DIM = 8
DELTA = 1e-6


def exact_gaussian_epsilon(sigma: float, delta: float) -> float:
    """Epsilon of the Gaussian mechanism with noise std ``sigma`` over sensitivity 1 at ``delta`` (Balle & Wang)."""

    def delta_of(eps: float) -> float:
        return norm.cdf(-eps * sigma + 1 / (2 * sigma)) - math.exp(eps) * norm.cdf(-eps * sigma - 1 / (2 * sigma))

    return brentq(lambda eps: delta_of(eps) - delta, 0.0, 500.0, xtol=1e-12)


def pld_epsilon(event, count: int, delta: float) -> float:
    """dp-accounting's PLD accountant composing ``count`` times the dp-accounting ``event``, read at ``delta``."""
    from dp_accounting.pld import pld_privacy_accountant

    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    accountant.compose(event, count)
    return float(accountant.get_epsilon(delta))


def _cfg(**values) -> RunConfig:
    base = {"task": "quadratic", "dim": DIM, "num-clients": 4, "clients-per-round": 4.0, "num-rounds": 8,
            "epsilon": 0.0, "noise-multiplier": 2.0, "delta": 1e-5, "algorithm": "clip", "clip": 1.0, "seed": 1,
            "checkpoint-every": 0}  # fmt: skip
    return RunConfig.from_run_config({**base, **values})


def _ask(node_config: dict, cfg: RunConfig, run_id: int, k: int, cohort: int | None = None, ids=None):
    """Round ``k`` of run ``run_id`` as the server sends it, through the node's guard: the verdict."""
    ins = DPServer(cfg, DIM).instructions(k, cohort if cohort is not None else max(1, round(cfg.clients_per_round)))
    record = instructions_to_config_record(ins)
    if ids is not None:
        record[CLIENT_IDS] = list(ids)
    return guard(CLIENT_APP, "train", node_config, train=TrainRequest(record, run_id, cfg))


def _accounts(path, delta: float = DELTA) -> dict[str, float]:
    return NodeLedger(path).accounts(NodePolicy(max_epsilon_delta=delta))


# ------------------------------------------------------------------ issue 46 item 2: the two accounts
def test_a_server_declaring_q_1e_minus_6_gets_only_the_answers_max_epsilon_allows_for_the_nodes_own_noise(tmp_path):
    """The issue's attack: q = 1e-6 declared, the node asked in every round. Before, account (a) alone held the
    budget (1,504 answers, ledger 0.006). Now max-epsilon = 8 bounds what the server saw: the node's own noise
    share (z_own = s / C = 3 with |S_k| = 1), unamplified: N answers with epsilon(3 / sqrt(N)) <= 8 < epsilon(3 /
    sqrt(N + 1))."""
    cfg = _cfg(**{"num-clients": 1_000_000, "clients-per-round": 1.0, "num-rounds": 1000, "noise-multiplier": 3.0})
    assert cfg.sampling_rate == pytest.approx(1e-6)
    path = tmp_path / "ledger.json"
    node = {"max-epsilon": 8.0, "privacy-ledger": str(path)}
    answered = 0
    for k in range(1, cfg.num_rounds + 1):
        verdict = _ask(node, cfg, 1, k)
        if verdict.route is Route.REFUSE:
            assert "max-epsilon" in verdict.reason and "server account" in verdict.reason
            break
        answered += 1
    # independent: the exact Gaussian curve, and dp-accounting's PLD of N Gaussians of z = 3
    import dp_accounting

    n = answered
    assert exact_gaussian_epsilon(3.0 / math.sqrt(n), DELTA) <= 8.0
    assert exact_gaussian_epsilon(3.0 / math.sqrt(n + 1), DELTA) > 8.0
    assert 20 < n < 200  # what 8 allows, not 1,000 (or the 1,504 of the issue)
    assert pld_epsilon(dp_accounting.GaussianDpEvent(3.0), n, DELTA) <= 8.0 + 1e-3
    assert pld_epsilon(dp_accounting.GaussianDpEvent(3.0), n + 1, DELTA) > 8.0
    spent = _accounts(path)
    assert spent[SERVER] == pytest.approx(exact_gaussian_epsilon(3.0 / math.sqrt(n), DELTA), rel=1e-8)
    assert spent[RELEASED] < 0.1  # the declared q: what the released model's viewers can learn, amplified
    assert len(NodeLedger(path).read()) == n


def test_account_b_charges_the_nodes_own_share_not_the_sums_noise(tmp_path) -> None:
    """|S_k| = 4 with the default placement: the node's own noise is z / 2; the server sees it alone (no SecAgg+):
    account (b) after 5 rounds is the Gaussian of (z / 2) / sqrt(5); account (a) is the run's plan (q = 1)."""
    cfg = _cfg(**{"num-rounds": 5, "noise-multiplier": 4.0})
    path = tmp_path / "ledger.json"
    node = {"privacy-ledger": str(path)}
    for k in range(1, 6):
        assert _ask(node, cfg, 1, k).route is Route.TRAIN
    spent = _accounts(path, 1e-5)
    assert spent[SERVER] == pytest.approx(exact_gaussian_epsilon(2.0 / math.sqrt(5), 1e-5), rel=1e-8)
    assert spent[RELEASED] == pytest.approx(exact_gaussian_epsilon(4.0 / math.sqrt(5), 1e-5), rel=2e-3)


def test_secure_aggregation_earns_no_credit_in_account_b(tmp_path) -> None:
    """A release through SecAgg+, stages checked or not: the server can declare honest nodes dropped and read a
    threshold-sized subset's sum (or, with different unmask lists per node, a smaller one:
    tests/test_secagg_stages.py), so account (b) charges the node's own share (z / 2 with |S_k| = 4) either way.
    The ledger entry still says whether the stages were checked."""
    import json

    from dpfedavg.privacy.ledger import record_release
    from dpfedavg.privacy.policy import check_round

    cfg = _cfg(**{"num-rounds": 5, "noise-multiplier": 4.0})
    ins = check_round(NodePolicy(), DPServer(cfg, DIM).instructions(1, 4), secure_round=False, cfg=cfg)
    for secure in (False, True):
        path = tmp_path / f"ledger-{secure}.json"
        for k in (1, 2, 3):
            record_release({"privacy-ledger": str(path)}, 1, dataclasses.replace(ins, server_round=k), cfg,
                           message_type="train", secure_aggregation=secure)  # fmt: skip
        assert _accounts(path)[SERVER] == pytest.approx(exact_gaussian_epsilon(2.0 / math.sqrt(3), DELTA), rel=1e-8)
        entries = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
        assert [e["entry"].get("secure_aggregation", False) for e in entries if "entry" in e] == [secure] * 3, entries


def test_max_epsilon_released_bounds_account_a_and_max_epsilon_account_b(tmp_path) -> None:
    """q = 1, z = 4, |S_k| = 4: each round costs (b) a Gaussian of 2 and the run costs (a) eight Gaussians of 4.
    max-epsilon = 100 and max-epsilon-released = 2.5: a run whose plan alone exceeds 2.5 is refused at its first round,
    naming max-epsilon-released; with max-epsilon-released = 100 and max-epsilon = 3, (b) refuses once it would
    pass 3."""
    cfg = _cfg(**{"noise-multiplier": 4.0})
    plan = exact_gaussian_epsilon(4.0 / math.sqrt(8), DELTA)
    assert plan > 2.5 + 0.5
    node = {"max-epsilon": 100.0, "max-epsilon-released": 2.5, "privacy-ledger": str(tmp_path / "a.json")}
    verdict = _ask(node, cfg, 1, 1)
    assert verdict.route is Route.REFUSE and "(max-epsilon-released)" in verdict.reason
    node = {"max-epsilon": 3.0, "max-epsilon-released": 100.0, "privacy-ledger": str(tmp_path / "b.json")}
    answered = sum(_ask(node, cfg, 1, k).route is Route.TRAIN for k in range(1, 9))
    assert exact_gaussian_epsilon(2.0 / math.sqrt(answered), DELTA) <= 3.0
    assert exact_gaussian_epsilon(2.0 / math.sqrt(answered + 1), DELTA) > 3.0


def test_allow_server_noise_leaves_account_b_unbounded_and_max_epsilon_bounds_account_a(tmp_path) -> None:
    """With the server placement the node adds no noise: account (b) is infinite. An operator who set
    allow-server-noise = true trusts the server with the clean update: max-epsilon then bounds account (a) only."""
    cfg = _cfg(**{"noise-placement": "server", "noise-multiplier": 4.0})
    path = tmp_path / "ledger.json"
    node = {"max-epsilon": 8.0, "allow-server-noise": True, "privacy-ledger": str(path)}
    assert all(_ask(node, cfg, 1, k).route is Route.TRAIN for k in range(1, 9))
    spent = _accounts(path)
    assert spent[SERVER] == math.inf
    assert spent[RELEASED] == pytest.approx(exact_gaussian_epsilon(4.0 / math.sqrt(8), DELTA), rel=2e-3)


@pytest.mark.parametrize(
    ("node_config", "fragment"),
    [
        ({"max-epsilon-released": 0}, "'max-epsilon-released' = 0: expected a number > 0"),
        ({"max-epsilon-released": "inf"}, "'max-epsilon-released' = 'inf'"),
        ({"max-epsilon-released": True}, "'max-epsilon-released' = True"),
        ({"allow-virtual-clients": "yes"}, "'allow-virtual-clients' = 'yes': expected true or false"),
        ({"max-epsilon-releasd": 3.0}, "did you mean 'max-epsilon-released'"),
    ],
)
def test_bad_account_keys_are_one_clear_error(node_config: dict, fragment: str) -> None:
    with pytest.raises(PolicyError, match="invalid") as err:
        NodePolicy.from_node_config(node_config)
    assert fragment in str(err.value)


def test_an_entry_written_before_the_accounts_reads_and_chains_as_it_was(tmp_path) -> None:
    """Format /2 entries without the new fields: read, charged to (b) at noise_std / C, and appended after."""
    old = {"run_id": 1, "server_round": 1, "message_type": "train", "mechanism": "gaussian", "noise_multiplier": 2.0,
           "sampling_rate": None, "num_rounds": None, "delta": None, "clip": 1.0, "placement": None,
           "noise_std": 2.0, "time": "2026-11-26T18:47:02+00:00"}  # fmt: skip
    path = tmp_path / "ledger.json"
    ledger = NodeLedger(path)
    ledger.write([Release.from_json(old, "test")])
    (line,) = path.read_text().splitlines()[1:]
    assert json.loads(line)["entry"] == old  # the chain is over the entry as written
    assert _accounts(path)[SERVER] == pytest.approx(exact_gaussian_epsilon(2.0, DELTA), rel=1e-8)
    ledger.charge(Release.from_json({**old, "server_round": 2}, "test"), NodePolicy())
    assert len(NodeLedger(path).read()) == 2
    assert _accounts(path)[SERVER] == pytest.approx(exact_gaussian_epsilon(2.0 / math.sqrt(2), DELTA), rel=1e-8)


# ------------------------------------------------------------------ issue 46 item 4: every release as what it is
def _sqrt_prefix(b: int) -> np.ndarray:
    return np.array([comb(2 * j, j) / 4**j for j in range(b)])


def _banded_sensitivity(coefficients: np.ndarray, rounds: int, bands: int, participations: int) -> float:
    """max over cyclic participation patterns of ||C e_pattern||, C the b-banded lower-triangular Toeplitz matrix
    of ``coefficients``, built here; every pattern of ``participations`` rounds ``bands`` apart is tried."""
    c = np.zeros((rounds, rounds))
    for j, value in enumerate(coefficients):
        c += np.diag(np.full(rounds - j, value), -j)
    best = 0.0
    for start in range(bands):
        pattern = np.zeros(rounds)
        pattern[start::bands][:participations] = 1.0
        best = max(best, float(np.linalg.norm(c @ pattern)))
    return best


def test_a_banded_mf_run_is_charged_its_own_epsilon(tmp_path) -> None:
    """Cyclic banded MF, n = 4, r = 1 (b = 4), K = 8, z = 1.5: the run is one Gaussian mechanism with sensitivity
    ||C (e_0 + e_4)||: the node's account (a) is that Gaussian's exact epsilon (the strategy matrix built here),
    and the run's own reported epsilon; the independent plan it charged before (K x PoissonSampled(1/4, 1.5)) is
    far below it."""
    from dpfedavg.privacy.noise_mechanisms import NOISE_MECHANISMS
    from dpfedavg.privacy.params import DpParams

    cfg = _cfg(**{"noise-mechanism": "banded-mf", "noise-placement": "server", "clients-per-round": 1.0,
                  "noise-multiplier": 1.5, "delta": DELTA, "accountant": "pld"})  # fmt: skip
    path = tmp_path / "ledger.json"
    node = {"allow-server-noise": True, "max-epsilon-released": 50.0, "privacy-ledger": str(path)}
    for k in (1, 5):  # this node's group: rounds 1 and 5
        verdict = _ask(node, cfg, 1, k, cohort=1)
        assert verdict.route is Route.TRAIN, verdict.reason
    sensitivity = _banded_sensitivity(_sqrt_prefix(4), 8, 4, 2)
    exact = exact_gaussian_epsilon(1.5 / sensitivity, DELTA)
    spent = _accounts(path)[RELEASED]
    assert spent == pytest.approx(exact, rel=2e-3)
    run_reports = NOISE_MECHANISMS["banded-mf"].epsilon(DpParams.from_config(cfg), 1.5, 8)
    assert spent == pytest.approx(run_reports, rel=2e-3)
    import dp_accounting

    before = pld_epsilon(dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(1.5)), 8, DELTA)
    assert spent > 1.5 * before
    redone = _ask(node, cfg, 1, 5, cohort=1)  # a round released twice: not covered by the banded analysis
    assert redone.route is Route.REFUSE and "(participation)" in redone.reason and "twice" in redone.reason
    assert _ask(node, cfg, 1, 8, cohort=1).route is Route.REFUSE  # a third participation (k = 2)


@pytest.mark.parametrize(
    ("participation", "rounds", "refused"),
    [
        ("cyclic", [1, 2], 2),  # every round: 1 apart, b = 4
        ("cyclic", [1, 4], 4),  # 3 apart
        ("min-separation", [2, 6], None),  # 4 apart, k = 2
        ("cyclic-poisson", [1, 6], 6),  # 5 apart but another cyclic group
    ],
)
def test_a_banded_mf_node_answers_only_the_participation_pattern_its_epsilon_covers(
    tmp_path, participation: str, rounds: list[int], refused: int | None
) -> None:
    """A server that asks a banded-MF node more often than the rule says (the run's epsilon covers k = 2
    participations b = 4 apart, one cyclic group with cyclic-poisson) is refused at the first round that breaks it."""
    cfg = _cfg(**{"noise-mechanism": "banded-mf", "noise-placement": "server", "clients-per-round": 1.0,
                  "noise-multiplier": 1.5, "participation": participation})  # fmt: skip
    node = {"allow-server-noise": True, "max-epsilon-released": 50.0, "privacy-ledger": str(tmp_path / "l.json")}
    for k in rounds:
        verdict = _ask(node, cfg, 1, k, cohort=1)
        assert (verdict.route is Route.REFUSE) == (k == refused), verdict.reason
        if k == refused:
            assert "(participation)" in verdict.reason


def test_an_amplified_banded_mf_run_is_charged_its_sampled_steps(tmp_path) -> None:
    """cyclic-poisson, n = 8, r = 1, b = 4: each client of the round's group is sampled with p = r b / n = 1/2, and
    the run is ceil(K / b) = 2 Poisson-sampled Gaussians of sigma / (C ||c||_2) (Choquette-Choo et al. 2023,
    Theorems 4-5), composed here by dp-accounting from the coefficients computed here."""
    import dp_accounting

    cfg = _cfg(**{"noise-mechanism": "banded-mf", "noise-placement": "server", "num-clients": 8,
                  "clients-per-round": 1.0, "noise-multiplier": 1.5, "participation": "cyclic-poisson",
                  "delta": DELTA})  # fmt: skip
    path = tmp_path / "ledger.json"
    node = {"allow-server-noise": True, "max-epsilon-released": 50.0, "privacy-ledger": str(path)}
    assert _ask(node, cfg, 1, 2, cohort=1).route is Route.TRAIN
    z_step = 1.5 / np.linalg.norm(_sqrt_prefix(4))
    step = dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(z_step))
    assert _accounts(path)[RELEASED] == pytest.approx(pld_epsilon(step, 2, DELTA), rel=5e-3)


def test_a_banded_mf_run_above_the_nodes_budget_is_refused_at_its_first_round(tmp_path) -> None:
    cfg = _cfg(**{"noise-mechanism": "banded-mf", "noise-placement": "server", "clients-per-round": 1.0,
                  "noise-multiplier": 1.5, "delta": DELTA})  # fmt: skip
    exact = exact_gaussian_epsilon(1.5 / _banded_sensitivity(_sqrt_prefix(4), 8, 4, 2), DELTA)
    node = {"allow-server-noise": True, "max-epsilon": exact - 0.3, "privacy-ledger": str(tmp_path / "l.json")}
    verdict = _ask(node, cfg, 1, 1, cohort=1)
    assert verdict.route is Route.REFUSE and "max-epsilon" in verdict.reason and "banded-mf" in verdict.reason


def test_virtual_clients_on_a_policy_node_are_refused_unless_allowed_then_each_update_is_charged(tmp_path) -> None:
    """clients-per-node = 4 (one owner's four updates per round): refused under a policy; with
    allow-virtual-clients = true, account (b) charges each update asked (own share z / 2 each: 4 + 4 + 1 Gaussians
    of 2) and account (a) the sum's sensitivity 4 C: K x PoissonSampled(1 - (1 - q)^4, Gaussian(z / 4))."""
    import dp_accounting

    cfg = _cfg(**{"num-clients": 16, "clients-per-round": 4.0, "clients-per-node": 4, "noise-multiplier": 4.0})
    path = tmp_path / "ledger.json"
    refused = _ask({"max-epsilon": 50.0, "privacy-ledger": str(path)}, cfg, 1, 1, ids=[0, 1, 2, 3])
    assert refused.route is Route.REFUSE and "allow-virtual-clients" in refused.reason
    node = {"max-epsilon": 50.0, "allow-virtual-clients": True, "privacy-ledger": str(path)}
    for k, ids in ((1, [0, 1, 2, 3]), (2, [0, 1, 2, 3]), (3, [2])):  # round 3 asks one of them: the same plan
        assert _ask(node, cfg, 1, k, ids=ids).route is Route.TRAIN
    spent = _accounts(path)
    assert spent[SERVER] == pytest.approx(exact_gaussian_epsilon(2.0 / math.sqrt(9), DELTA), rel=1e-8)
    group_q = 1 - (1 - 0.25) ** 4
    event = dp_accounting.PoissonSampledDpEvent(group_q, dp_accounting.GaussianDpEvent(1.0))
    assert spent[RELEASED] == pytest.approx(pld_epsilon(event, 8, DELTA), rel=5e-3)


# ------------------------------------------------------------------ issue 47 item 4: a resume is not a new run
def _named(**values) -> RunConfig:
    return _cfg(**{"run-name": "exp1", "noise-multiplier": 6.0, **values})


def test_an_honest_resume_is_charged_one_plan_and_the_redone_rounds(tmp_path) -> None:
    """Run 'exp1' (Flower run id 1) answers rounds 1..5, the server dies, the resume (a new run id, resume = true)
    redoes round 5 and goes on to 8: account (a) is one plan of 8 Gaussians of z (q = 1) and one redone round, 9
    Gaussians: the exact Gaussian of z / 3, not two plans (16)."""
    path = tmp_path / "ledger.json"
    node = {"privacy-ledger": str(path)}
    for k in range(1, 6):
        assert _ask(node, _named(), 1, k).route is Route.TRAIN
    for k in range(5, 9):
        assert _ask(node, _named(resume=True), 2, k).route is Route.TRAIN
    assert _accounts(path)[RELEASED] == pytest.approx(exact_gaussian_epsilon(6.0 / 3.0, DELTA), rel=2e-3)
    # a second crash and resume: continues the same plan again
    assert _ask(node, _named(resume=True), 3, 8).route is Route.TRAIN
    assert _accounts(path)[RELEASED] == pytest.approx(exact_gaussian_epsilon(6.0 / math.sqrt(10), DELTA), rel=2e-3)
    from dpfedavg.deploy.node import ledger_report

    lines, _, _ = ledger_report(node)
    assert lines[1].startswith("run 1: 5 releases (rounds 1-5)") and lines[1].count("run-name 'exp1'") == 1
    assert lines[2].startswith("run 2: 4 releases (rounds 5-8)") and "run-name 'exp1', resumed" in lines[2]


@pytest.mark.parametrize(
    "claim",
    [
        {"noise-multiplier": 5.0},  # another plan under the same name
        {"delta": 1e-7},
        {"run-name": "exp2"},  # a name this node never charged
    ],
)
def test_a_claimed_resume_of_another_plan_is_charged_as_a_new_run(tmp_path, claim: dict) -> None:
    path = tmp_path / "ledger.json"
    node = {"privacy-ledger": str(path)}
    for k in range(1, 6):
        assert _ask(node, _named(), 1, k).route is Route.TRAIN
    other = _named(resume=True, **claim)
    assert _ask(node, other, 2, 6).route is Route.TRAIN
    z = other.noise_multiplier
    mu = math.sqrt(8 / 6.0**2 + 8 / z**2)  # two plans of 8 Gaussians: one of z = 6, one of the claimed z
    assert _accounts(path)[RELEASED] == pytest.approx(exact_gaussian_epsilon(1 / mu, DELTA), rel=2e-3)


def test_a_claimed_resume_that_asks_answered_rounds_again_pays_each_and_is_refused_past_the_budget(tmp_path) -> None:
    """A server that claims 'resume' to ask rounds 1..8 of a finished run again: each is one more Gaussian (q = 1);
    with max-epsilon-released between 8 + 3 and 8 + 4 rounds' epsilon, three are answered and the fourth refused."""
    path = tmp_path / "ledger.json"
    eleven, twelve = (exact_gaussian_epsilon(6.0 / math.sqrt(n), DELTA) for n in (11, 12))
    budget = (eleven + twelve) / 2
    assert twelve - eleven > 0.1
    node = {"max-epsilon": 1e3, "max-epsilon-released": budget, "privacy-ledger": str(path)}
    for k in range(1, 9):
        assert _ask(node, _named(), 1, k).route is Route.TRAIN
    verdicts = [_ask(node, _named(resume=True), 2, k) for k in range(1, 9)]
    assert [v.route for v in verdicts[:3]] == [Route.TRAIN] * 3
    assert all(v.route is Route.REFUSE and "max-epsilon-released" in v.reason for v in verdicts[3:])
    assert _accounts(path)[RELEASED] == pytest.approx(eleven, rel=2e-3)


def test_the_resume_charges_are_the_same_from_the_file_alone(tmp_path) -> None:
    """The state is a cache: the charges of a resume, recomputed from the file (state deleted), are the same."""
    path = tmp_path / "ledger.json"
    node = {"privacy-ledger": str(path)}
    for k in range(1, 4):
        _ask(node, _named(), 1, k)
    for k in range(3, 9):
        _ask(node, _named(resume=True), 2, k)
    before = _accounts(path)
    for suffix in (".state", ".state-wal", ".state-shm"):
        path.with_name(path.name + suffix).unlink(missing_ok=True)
    assert _accounts(path) == pytest.approx(before, rel=1e-9)


@pytest.mark.parametrize("virtual", [False, True], ids=["one-client", "virtual-clients"])
def test_a_state_behind_the_file_catches_up_on_a_resume_as_composing_from_scratch(tmp_path, virtual: bool) -> None:
    """The state saw run 'exp1' (rounds 1-3); the file then got the resume's rounds 3-8 (another writer, or a crash
    between the append and the state's commit): bringing the state up to date finds the earlier plan in it (with
    virtual clients, a plan of its own), and gives what the file alone gives."""
    import shutil

    path = tmp_path / "ledger.json"
    node = {"privacy-ledger": str(path), "allow-virtual-clients": True}
    extra = {"num-clients": 8, "clients-per-node": 2} if virtual else {}
    ids = [0, 1] if virtual else None
    for k in range(1, 4):
        assert _ask(node, _named(**extra), 1, k, ids=ids).route is Route.TRAIN
    saved = tmp_path / "saved"
    saved.mkdir()
    states = [path.with_name(path.name + suffix) for suffix in (".state", ".state-wal", ".state-shm")]
    for state in states:
        if state.exists():
            shutil.copy2(state, saved / state.name)
    for k in range(3, 9):
        assert _ask(node, _named(resume=True, **extra), 2, k, ids=ids).route is Route.TRAIN
    for state in states:
        state.unlink(missing_ok=True)
        if (saved / state.name).exists():
            shutil.copy2(saved / state.name, state)
    caught_up = _accounts(path)  # the old state, brought up to date from the file
    for state in states:
        state.unlink(missing_ok=True)
    assert caught_up == pytest.approx(_accounts(path), rel=1e-9)
    if not virtual:  # one plan of 8 rounds and one redone round, q = 1
        assert caught_up[RELEASED] == pytest.approx(exact_gaussian_epsilon(6.0 / 3.0, DELTA), rel=2e-3)
