"""The node's privacy ledger against a server that runs it again and again (issue 36, part 4).

Every test drives the real ClientApp (or ``dp_mod`` in a user's app) through ``InProcessGrid``, a new run id per
run, with the node's ``--node-config``. The composed epsilon is checked against independent computations: the exact
(epsilon, delta) curve of the Gaussian mechanism (Balle & Wang 2018, solved with scipy) where ``q = 1`` (``K``
Gaussian rounds of ``z`` are exactly one Gaussian of ``z / sqrt(K)``), and dp-accounting's own PLD and RDP
accountants where ``q < 1``.
"""

from __future__ import annotations

import errno
import json
import math
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from scipy.optimize import brentq
from scipy.stats import norm

from dpfedavg.config import RunConfig
from dpfedavg.core.types import RoundInstructions
from dpfedavg.flower import client_app as client_app_module
from dpfedavg.flower.client_app import app as client_app
from dpfedavg.flower.mod import dp_mod, public_parameters
from dpfedavg.flower.protocol import ARRAYS, CONFIG, instructions_to_config_record, to_array_record
from dpfedavg.flower.testing import InProcessGrid
from dpfedavg.privacy import ledger as ledger_module
from dpfedavg.privacy import node_guard as guard_module
from dpfedavg.privacy import policy as policy_module
from dpfedavg.privacy.ledger import NodeLedger, Release, ledger_path, record_release
from dpfedavg.privacy.policy import NodePolicy, PolicyError
from dpfedavg.server.dp_server import DPServer

DIM = 20
#: q = 1 (r = n = 4), z = 2.5, K = 5, delta = 1e-5: one run is one Gaussian of std 2.5 / sqrt(5); R runs of
#: std 2.5 / sqrt(5 R). Exact epsilon: 3 runs 7.33, 4 runs 8.72: the crossing of 8 is 0.67 / 0.72 away.
EXACT_RUNS = {
    "task": "quadratic",
    "dim": DIM,
    "num-clients": 4,
    "clients-per-round": 4.0,
    "num-rounds": 5,
    "epsilon": 0.0,
    "noise-multiplier": 2.5,
    "delta": 1e-5,
    "algorithm": "clip",
    "clip": 3.0,
    "seed": 1,
    "checkpoint-every": 0,
}
#: q = 1/2: a Poisson-sampled run.
SAMPLED_RUN = {**EXACT_RUNS, "num-clients": 8, "clients-per-round": 4.0, "noise-multiplier": 1.0}


def gaussian_epsilon(sigma: float, delta: float) -> float:
    """Exact epsilon of the Gaussian mechanism with std ``sigma`` (sensitivity 1) at ``delta`` (Balle & Wang 2018)."""

    def delta_of(eps: float) -> float:
        return norm.cdf(-eps * sigma + 1 / (2 * sigma)) - math.exp(eps) * norm.cdf(-eps * sigma - 1 / (2 * sigma))

    return brentq(lambda eps: delta_of(eps) - delta, 0.0, 500.0, xtol=1e-10)


def _cfg(values: dict) -> RunConfig:
    return RunConfig.from_run_config(values)


class Node:
    """One SuperNode (partition 0) of a fresh in-process federation per run: a new Context, a new run id."""

    def __init__(self, node_config: dict, client=client_app) -> None:
        self.node_config = node_config
        self.client = client

    def send(self, cfg: RunConfig, run_id: int, server_round: int, *, content: RecordDict | None = None) -> Message:
        grid = InProcessGrid(self.client, cfg.num_clients, cfg.to_run_config(), node_config=self.node_config)
        for context in grid.contexts.values():
            context.run_id = run_id
        node = next(nid for nid, c in grid.contexts.items() if c.node_config["partition-id"] == 0)
        if content is None:
            ins = DPServer(cfg, DIM).instructions(server_round, round(cfg.clients_per_round))
            content = RecordDict({ARRAYS: to_array_record(np.zeros(DIM)), CONFIG: instructions_to_config_record(ins)})
        (reply,) = grid.send_and_receive([Message(content, dst_node_id=node, message_type=MessageType.TRAIN)])
        return reply

    def run(self, cfg: RunConfig, run_id: int) -> list[Message]:
        """Every round of one run; stops at the first refusal."""
        replies = []
        for k in range(1, cfg.num_rounds + 1):
            replies.append(self.send(cfg, run_id, k))
            if replies[-1].has_error():
                break
        return replies


def _answered(replies: list[Message]) -> bool:
    return all(not r.has_error() and ARRAYS in r.content for r in replies)


def _restart() -> None:
    """Forget every process-level cache a restarted ClientApp process would not have."""
    guard_module._policy.cache_clear()
    client_app_module._config.cache_clear()
    policy_module._run_epsilon.cache_clear()


def _numbers(reason: str) -> dict[str, float]:
    spent = re.search(r"has spent epsilon ([0-9.e+-]+)", reason)
    total = re.search(r"composed epsilon to ([0-9.e+-]+) > max-epsilon(?:-released)? = ([0-9.e+-]+)", reason)
    assert spent and total, reason
    return {"spent": float(spent[1]), "total": float(total[1]), "budget": float(total[2])}


# ------------------------------------------------------------------ the budget across runs
def test_five_runs_against_max_epsilon_8_are_refused_once_the_composed_epsilon_would_pass_it(tmp_path) -> None:
    """Each run alone (epsilon 3.85) passes the node's max-epsilon = 8; composed, runs 4 and 5 are refused."""
    cfg = _cfg(EXACT_RUNS)
    path = tmp_path / "ledger.json"
    node = Node({"max-epsilon-released": 8.0, "max-epsilon-delta": 1e-5, "privacy-ledger": str(path)})
    answered = [_answered(node.run(cfg, run_id)) for run_id in range(1, 6)]
    assert answered == [True, True, True, False, False]

    exact = {runs: gaussian_epsilon(2.5 / math.sqrt(5 * runs), 1e-5) for runs in (1, 3, 4)}
    assert exact[1] < 8 and exact[3] < 8 - 0.5 and exact[4] > 8 + 0.5  # the crossing is unambiguous
    spent = NodeLedger(path).spent(NodePolicy(max_epsilon=8.0, max_epsilon_delta=1e-5))
    assert spent == pytest.approx(exact[3], rel=2e-3)  # PLD at discretization 1e-3, pessimistic
    refusal = node.send(cfg, 6, 1)
    reason = refusal.error.reason
    assert "max-epsilon" in reason and str(path) in reason
    numbers = _numbers(reason)
    assert numbers["spent"] == pytest.approx(exact[3], rel=2e-3)
    assert numbers["total"] == pytest.approx(exact[4], rel=2e-3) and numbers["budget"] == 8.0
    alone = re.search(r"costs ([0-9.]+) on its own", reason)
    assert alone and float(alone[1]) == pytest.approx(exact[1], rel=2e-3)  # one run's plan
    assert len(NodeLedger(path).read()) == 3 * cfg.num_rounds  # every release, none of the refused


def test_through_the_client_app_max_epsilon_bounds_what_the_server_sees(tmp_path) -> None:
    """The same runs with max-epsilon = 8 alone: the server account (the node's own share z / sqrt(4) = 1.25, every
    release, unamplified) passes 8 at the fifth release: four answered, exactly as the Gaussian of 1.25 / sqrt(n)."""
    cfg = _cfg(EXACT_RUNS)
    assert gaussian_epsilon(1.25 / 2, 1e-5) < 8 - 0.3 and gaussian_epsilon(1.25 / math.sqrt(5), 1e-5) > 8 + 0.3
    node = Node({"max-epsilon": 8.0, "max-epsilon-delta": 1e-5, "privacy-ledger": str(tmp_path / "ledger.json")})
    replies = node.run(cfg, 1)
    assert [r.has_error() for r in replies] == [False] * 4 + [True]
    reason = replies[-1].error.reason
    assert "(max-epsilon)" in reason and "server account" in reason
    assert _numbers(reason)["total"] == pytest.approx(gaussian_epsilon(1.25 / math.sqrt(5), 1e-5), rel=1e-3)  # 4 digits


def test_a_redone_round_is_charged_one_more_sampled_round(tmp_path) -> None:
    """q = 1/2: rounds 1..5, then round 3 again (a resume after a crash): K + 1 sampled Gaussians, not K."""
    import dp_accounting

    cfg = _cfg(SAMPLED_RUN)
    path = tmp_path / "ledger.json"
    node = Node({"privacy-ledger": str(path)})
    assert _answered(node.run(cfg, 1))
    policy = NodePolicy(max_epsilon_delta=1e-5)
    before = NodeLedger(path).spent(policy)
    assert _answered([node.send(cfg, 1, 3)])
    after = NodeLedger(path).spent(policy)

    def pld(rounds: int) -> float:
        acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
        acc.compose(dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(1.0)), rounds)
        return acc.get_epsilon(1e-5)

    def rdp(rounds: int) -> float:
        acc = dp_accounting.rdp.RdpAccountant()
        acc.compose(dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(1.0)), rounds)
        return acc.get_epsilon(1e-5)

    assert before == pytest.approx(pld(5), rel=5e-3) and before <= rdp(5)
    assert after == pytest.approx(pld(6), rel=5e-3) and after <= rdp(6)
    assert after > before * 1.05
    assert [r.server_round for r in NodeLedger(path).read()] == [1, 2, 3, 4, 5, 3]


def test_a_server_declaring_delta_0_1_does_not_choose_the_delta_of_the_nodes_budget(tmp_path) -> None:
    """Runs at delta = 0.1 (the largest a run config takes): read at 0.1, ten runs compose to 6.81 < 8. A node
    with max-epsilon = 8 and no max-epsilon-delta reads its budget at 1e-6: two runs 6.40, three 8.11 (exact)."""
    exact = {runs: gaussian_epsilon(2.5 / math.sqrt(5 * runs), 1e-6) for runs in (2, 3)}
    assert exact[2] < 8 - 1 and exact[3] > 8 + 0.1 and gaussian_epsilon(2.5 / math.sqrt(50), 0.1) < 8
    cfg = _cfg({**EXACT_RUNS, "delta": 0.1})
    node = Node({"max-epsilon-released": 8.0, "privacy-ledger": str(tmp_path / "ledger.json")})
    assert [_answered(node.run(cfg, run_id)) for run_id in (1, 2)] == [True, True]
    refused = node.send(cfg, 3, 1)
    assert refused.has_error() and "max-epsilon" in refused.error.reason
    assert _numbers(refused.error.reason)["total"] == pytest.approx(exact[3], rel=2e-3)
    assert "delta = 1e-06" in refused.error.reason


def test_a_redone_round_past_the_budget_is_refused(tmp_path) -> None:
    """q = 1: the run's 5 rounds are exactly a Gaussian of 2.5 / sqrt(5) (3.85), one more round of 2.5 / sqrt(6)
    (4.28): a node with max-epsilon = 4.05 answers the run and refuses the redone round."""
    cfg = _cfg(EXACT_RUNS)
    five, six = (gaussian_epsilon(2.5 / math.sqrt(k), 1e-5) for k in (5, 6))
    assert five < 4.05 - 0.15 and six > 4.05 + 0.15
    ledger = str(tmp_path / "ledger.json")
    node = Node({"max-epsilon-released": 4.05, "max-epsilon-delta": 1e-5, "privacy-ledger": ledger})
    assert _answered(node.run(cfg, 7))
    redone = node.send(cfg, 7, 4)
    assert redone.has_error() and "max-epsilon" in redone.error.reason
    assert _numbers(redone.error.reason)["total"] == pytest.approx(six, rel=2e-3)


def test_a_round_beyond_the_declared_plan_is_charged_a_whole_plan_again(tmp_path) -> None:
    """q = 1, K = 5: the run is a Gaussian of 2.5 / sqrt(5); a server asking round 6 and then 7 of its 5-round plan
    is charged the whole plan each time: Gaussians of 2.5 / sqrt(10), then 2.5 / sqrt(15) (exact), not nothing."""
    import dataclasses

    cfg = _cfg(EXACT_RUNS)
    path = tmp_path / "ledger.json"
    assert _answered(Node({"privacy-ledger": str(path)}).run(cfg, 1))
    policy = NodePolicy(max_epsilon_delta=1e-5)
    ledger = NodeLedger(path)
    last = ledger.read()[-1]
    spent = [ledger.spent(policy)]
    for k in (6, 7):
        ledger.charge(dataclasses.replace(last, server_round=k), policy)
        spent.append(NodeLedger(path).spent(policy))
    exact = [gaussian_epsilon(2.5 / math.sqrt(5 * plans), 1e-5) for plans in (1, 2, 3)]
    assert spent == pytest.approx(exact, rel=2e-3)
    assert exact[1] > exact[0] * 1.2


def test_a_restarted_node_keeps_its_spent_budget(tmp_path) -> None:
    """Three runs, a restart (no process-level state, a new federation), and the fourth run is refused."""
    cfg = _cfg(EXACT_RUNS)
    # the default ledger
    node_config = {"max-epsilon-released": 8.0, "max-epsilon-delta": 1e-5, "min-noise-multiplier": 1.0}
    for run_id in (11, 12, 13):
        assert _answered(Node(node_config).run(cfg, run_id))
    _restart()
    reply = Node(dict(node_config)).send(cfg, 14, 1)
    assert reply.has_error() and "max-epsilon" in reply.error.reason
    assert _numbers(reply.error.reason)["spent"] == pytest.approx(gaussian_epsilon(2.5 / math.sqrt(15), 1e-5), 2e-3)
    path = ledger_module.node_home() / "dpfedavg" / "privacy-ledger-0.json"
    assert str(path) in reply.error.reason
    # a new Python process reads the same spent budget from the file alone
    script = (
        "import sys; from dpfedavg.privacy.ledger import NodeLedger; from dpfedavg.privacy.policy import NodePolicy; "
        "print(NodeLedger(sys.argv[1]).spent(NodePolicy(max_epsilon_delta=1e-5)))"
    )
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True)
    assert float(out.stdout) == pytest.approx(_numbers(reply.error.reason)["spent"], rel=1e-3)


# ------------------------------------------------------------------ the file
DAMAGES = ["garbage", "entry-changed", "entry-removed", "last-entry-removed", "cut-short", "not-a-ledger"]


def _damage(path: Path, damage: str) -> None:
    """Edit the ledger as a careless hand (or a failing disk) would; the file keeps its other bytes."""
    header, *lines = path.read_bytes().splitlines(keepends=True)
    if damage == "garbage":
        lines[2] = b"{not json\n"
    elif damage == "entry-changed":  # a valid line with a lower z: the chain no longer matches
        item = json.loads(lines[2])
        item["entry"]["noise_multiplier"] = 100.0
        lines[2] = (json.dumps(item) + "\n").encode()
    elif damage == "entry-removed":
        del lines[2]
    elif damage == "last-entry-removed":  # the chain of what is left is valid: only the state knows
        del lines[-1]
    elif damage == "cut-short":
        lines[-1] = lines[-1][:-40]
    else:
        header, lines = json.dumps({"entries": []}).encode(), []
    path.write_bytes(header + b"".join(lines))


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_corrupt_ledger_is_one_clear_error_never_an_empty_ledger(tmp_path, damage: str) -> None:
    cfg = _cfg(EXACT_RUNS)
    path = tmp_path / "ledger.json"
    node = Node({"privacy-ledger": str(path)})
    assert _answered(node.run(cfg, 1))
    _damage(path, damage)
    damaged = path.read_bytes()
    reply = node.send(cfg, 2, 1)
    assert reply.has_error()
    expected = {"garbage": "is corrupt", "not-a-ledger": "is not a"}.get(damage, "was edited")
    assert f"privacy-ledger {path} {expected}" in reply.error.reason
    assert path.read_bytes() == damaged  # left as it was, not reset
    if damage in ("last-entry-removed", "cut-short"):
        assert "this node had recorded 5" in reply.error.reason


def test_the_state_is_a_cache_the_file_alone_gives_the_same_budget(tmp_path) -> None:
    """Deleted, or garbage, ``<ledger>.state`` is rebuilt from the file: the same spent epsilon, to the bit."""
    path = tmp_path / "ledger.json"
    node = Node({"privacy-ledger": str(path)})
    for run_id in (1, 2):
        assert _answered(node.run(_cfg(SAMPLED_RUN), run_id))
    policy = NodePolicy(max_epsilon_delta=1e-5)
    spent = NodeLedger(path).spent(policy)
    state = path.with_name(path.name + ".state")
    assert state.exists()
    for damage in ("delete", "garbage"):
        for suffix in ("", "-wal", "-shm"):
            state.with_name(state.name + suffix).unlink(missing_ok=True)
        if damage == "garbage":
            state.write_bytes(b"not a database" * 100)
        assert NodeLedger(path).spent(policy) == spent


def _v1_ledger(path: Path, releases: list[Release]) -> None:
    """A ledger as the format-1 code wrote it: one JSON object, a SHA-256 of all entries."""
    entries = [r.to_json() for r in releases]
    digest = ledger_module._checksum(entries)
    data = {"format": "dpfedavg-node-privacy-ledger/1", "entries": entries, "sha256": digest}
    path.write_text(json.dumps(data, indent=1) + "\n")


def test_a_format_1_ledger_is_read_and_converted_by_its_next_release(tmp_path) -> None:
    cfg = _cfg(SAMPLED_RUN)
    new = tmp_path / "new.json"
    node = Node({"privacy-ledger": str(new)})
    assert _answered(node.run(cfg, 1))
    releases = NodeLedger(new).read()
    old = tmp_path / "old.json"
    _v1_ledger(old, releases)
    policy = NodePolicy(max_epsilon_delta=1e-5)
    assert NodeLedger(old).read() == releases
    assert NodeLedger(old).spent(policy) == NodeLedger(new).spent(policy)
    assert json.loads(old.read_text().splitlines()[0]) == {"format": "dpfedavg-node-privacy-ledger/2"}  # converted
    for path in (old, new):
        assert _answered([Node({"privacy-ledger": str(path)}).send(cfg, 2, 1)])
    assert NodeLedger(old).spent(policy) == NodeLedger(new).spent(policy)
    assert len(NodeLedger(old).read()) == len(releases) + 1
    edited = tmp_path / "edited.json"
    _v1_ledger(edited, releases)
    edited.write_text(edited.read_text().replace('"noise_multiplier": 1.0', '"noise_multiplier": 9.0', 1))
    with pytest.raises(ledger_module.LedgerError, match="was edited: its checksum"):
        NodeLedger(edited).read()


def test_the_running_composition_equals_dp_accountings_from_scratch(tmp_path) -> None:
    """Runs of varying q and z, redone rounds and dp_mod releases, charged one by one into the running composition
    (a new ClientApp process each time: no process-level cache): the node's epsilon equals dp-accounting's
    PLDAccountant composing the same charges from scratch (a plan is K self-composed sampled Gaussians)."""
    import dp_accounting

    path = tmp_path / "ledger.json"
    policy = NodePolicy(max_epsilon_delta=1e-5)
    plans = [(1, 0.5, 1.0, 5), (2, 0.25, 1.5, 8), (3, 0.5, 1.0, 5), (4, 1.0, 3.0, 4)]
    expected = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    ledger = NodeLedger(path)

    def release(run_id: int, k: int, q: float | None, z: float, rounds: int | None) -> Release:
        return Release(run_id, k, "train", "poisson-sampled-gaussian" if q else "gaussian", z, q, rounds,
                       1e-5 if q else None, 1.0, None, z, "2026-11-28T00:00:00+00:00")  # fmt: skip

    def gaussian(q: float, z: float) -> dp_accounting.DpEvent:
        event = dp_accounting.GaussianDpEvent(z)
        return event if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, event)

    for run_id, q, z, rounds in plans:
        for k in (1, 2):
            ledger.charge(release(run_id, k, q, z, rounds), policy)
        expected.compose(dp_accounting.SelfComposedDpEvent(gaussian(q, z), rounds))
    ledger.charge(release(2, 1, 0.25, 1.5, 8), policy)  # round 1 of run 2 again: one more round
    expected.compose(gaussian(0.25, 1.5))
    ledger.charge(release(9, 1, None, 4.0, None), policy)  # dp_mod: one unamplified Gaussian
    expected.compose(dp_accounting.GaussianDpEvent(4.0))
    spent = NodeLedger(path).spent(policy)
    assert spent == pytest.approx(expected.get_epsilon(1e-5), rel=1e-9)
    ledger_module._State.remove(ledger.state_path)  # and composing the file from scratch gives it again
    assert NodeLedger(path).spent(policy) == pytest.approx(spent, rel=1e-12)


def test_a_run_declaring_a_tiny_delta_does_not_move_the_nodes_reading_delta(tmp_path) -> None:
    """Issue 46: one cheap run at delta = 1e-12 moved the delta every later run is read at (spent 4.31 -> 6.42).
    The node's budget is read at its own delta (10^-6 without max-epsilon-delta): exactly the Gaussian's."""
    path = tmp_path / "ledger.json"
    node = Node({"max-epsilon": 100.0, "privacy-ledger": str(path)})
    assert _answered(node.run(_cfg(EXACT_RUNS), 1))
    before = NodeLedger(path).spent(NodePolicy())
    assert _answered(node.run(_cfg({**EXACT_RUNS, "delta": 1e-12, "noise-multiplier": 50.0}), 2))
    after = NodeLedger(path).spent(NodePolicy())
    exact = gaussian_epsilon(1 / math.sqrt(5 / 2.5**2 + 5 / 50.0**2), 1e-6)
    assert after == pytest.approx(exact, rel=2e-3) and after < before + 0.1
    assert gaussian_epsilon(1 / math.sqrt(5 / 2.5**2 + 5 / 50.0**2), 1e-12) > after + 2  # what it was read at


def test_the_ledger_entry_is_on_disk_before_the_update_is_computed(tmp_path, monkeypatch) -> None:
    path = tmp_path / "ledger.json"
    seen: list[int] = []
    original = client_app_module.client_round_update

    def training(*args, **kwargs):
        seen.append(len(NodeLedger(path).read()))
        return original(*args, **kwargs)

    monkeypatch.setattr(client_app_module, "client_round_update", training)
    assert _answered(Node({"privacy-ledger": str(path)}).run(_cfg(EXACT_RUNS), 1))
    assert seen == [1, 2, 3, 4, 5]


def test_a_failed_ledger_write_sends_no_update(tmp_path, monkeypatch) -> None:
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    path = tmp_path / "ledger.json"
    node = Node({"privacy-ledger": str(path)})
    assert _answered([node.send(_cfg(EXACT_RUNS), 1, 1)])
    before = path.read_bytes()
    monkeypatch.setattr(ledger_module, "_write_at", full_disk)
    for run_id, ledger in ((2, path), (1, tmp_path / "new.json")):  # an append, and a new file's first entry
        reply = Node({"privacy-ledger": str(ledger)}).send(_cfg(EXACT_RUNS), run_id, 1)
        assert reply.has_error() and f"privacy-ledger {ledger} cannot be written" in reply.error.reason
        assert "nothing is sent" in reply.error.reason
    assert path.read_bytes() == before  # no half line
    monkeypatch.undo()
    assert _answered([node.send(_cfg(EXACT_RUNS), 2, 1)])  # space again: the next release is appended
    assert [r.run_id for r in NodeLedger(path).read()] == [1, 2]


def test_concurrent_client_processes_lose_no_entry(tmp_path) -> None:
    """Four writers (separate lock descriptors, as separate ClientApp processes) append 5 releases each."""
    path = tmp_path / "ledger.json"
    node_config = {"privacy-ledger": str(path)}
    ins = RoundInstructions(1, 0.1, 1, "clip", 1.0, 1.0, 0, False, noise_multiplier=2.0, cohort_size=1)

    def writer(run_id: int) -> None:
        for _ in range(5):
            record_release(node_config, run_id, ins, None, message_type="train")

    threads = [threading.Thread(target=writer, args=(run_id,)) for run_id in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.run_id for r in NodeLedger(path).read()) == sorted(list(range(4)) * 5)


# ------------------------------------------------------------------ dp_mod
def _dp_mod_app() -> ClientApp:
    app = ClientApp()

    @app.train(mods=[dp_mod])
    def train(msg: Message, context) -> Message:
        arrays = msg.content.array_records["arrays"]
        w = arrays["w"].numpy() - 0.1
        return Message(RecordDict({"arrays": ArrayRecord({"w": to_array_record(w)["w"]})}), reply_to=msg)

    return app


def test_dp_mod_charges_each_release_as_an_unamplified_gaussian(tmp_path) -> None:
    """dp_mod has no q: n releases of z = sqrt(1.25) are one Gaussian of sqrt(1.25 / n), exactly: 3 releases
    7.33, 4 releases 8.72 at delta = 1e-5. A node with max-epsilon = 8 answers 3 and refuses the 4th."""
    z = math.sqrt(1.25)
    exact = {n: gaussian_epsilon(z / math.sqrt(n), 1e-5) for n in (3, 4)}
    assert exact[3] < 8 - 0.5 and exact[4] > 8 + 0.5
    path = tmp_path / "ledger.json"
    node = Node({"max-epsilon-released": 8.0, "max-epsilon-delta": 1e-5, "privacy-ledger": str(path)}, _dp_mod_app())
    cfg = _cfg(EXACT_RUNS)
    replies = []
    for k in (1, 2, 3, 4):
        ins = RoundInstructions(k, 0.1, 1, "clip", 1.0, z / 2, 0, False, noise_multiplier=z, cohort_size=4)
        config = instructions_to_config_record(ins)
        for key, value in public_parameters(cfg).items():  # client-calibrated, r = 4: the share z C / sqrt(4)
            config[key] = value
        content = RecordDict({"arrays": ArrayRecord({"w": to_array_record(np.zeros(3))["w"]}), "config": config})
        replies.append(node.send(cfg, 21, k, content=content))
    assert [r.has_error() for r in replies] == [False, False, False, True]
    reason = replies[-1].error.reason
    assert reason.startswith("dp_mod: ") and "max-epsilon" in reason
    assert _numbers(reason)["spent"] == pytest.approx(exact[3], rel=2e-3)
    assert _numbers(reason)["total"] == pytest.approx(exact[4], rel=2e-3)
    assert {r.mechanism for r in NodeLedger(path).read()} == {"gaussian"}
    # the server account: each release at the node's own share z / 2, unamplified (3 answered)
    server = NodeLedger(path).spent(NodePolicy(max_epsilon_delta=1e-5), "server")
    assert server == pytest.approx(gaussian_epsilon(z / 2 / math.sqrt(3), 1e-5), rel=1e-8)


# ------------------------------------------------------------------ the keys
def test_the_default_ledger_is_one_file_per_partition_in_the_nodes_home() -> None:
    home = ledger_module.node_home()
    assert ledger_path({"partition-id": 3, "secure-noise": True}, NodePolicy()) == home / "dpfedavg" / (
        "privacy-ledger-3.json"
    )
    assert (
        ledger_path({"privacy-ledger": "~/l.json"}, NodePolicy(privacy_ledger="~/l.json"))
        == Path("~/l.json").expanduser()
    )


def test_a_node_without_a_policy_keeps_no_ledger(tmp_path) -> None:
    """The README's research simulation: partition-id and num-partitions only, no file written, nothing charged."""
    assert _answered(Node({}).run(_cfg(EXACT_RUNS), 1))
    assert not (ledger_module.node_home() / "dpfedavg").exists()


@pytest.mark.parametrize(
    ("node_config", "fragments"),
    [
        ({"privacy-ledger": "ledger.json"}, ["'privacy-ledger' = 'ledger.json'", "an absolute file path"]),
        ({"privacy-ledger": "/tmp/a\nb"}, ["'privacy-ledger'", "one line"]),
        ({"max-epsilon-delta": 1.5}, ["'max-epsilon-delta' = 1.5", "a number in (0, 1)"]),
    ],
)
def test_bad_ledger_keys_are_one_clear_error(node_config: dict, fragments: list[str]) -> None:
    with pytest.raises(PolicyError) as err:
        NodePolicy.from_node_config(node_config)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_a_release_is_recorded_with_what_the_node_did(tmp_path) -> None:
    path = tmp_path / "ledger.json"
    assert _answered([Node({"privacy-ledger": str(path)}).send(_cfg(SAMPLED_RUN), 5, 2)])
    (entry,) = NodeLedger(path).read()
    assert isinstance(entry, Release)
    assert (entry.run_id, entry.server_round, entry.message_type, entry.mechanism) == (
        5, 2, "train", "poisson-sampled-gaussian"
    )  # fmt: skip
    assert (entry.noise_multiplier, entry.sampling_rate, entry.num_rounds, entry.delta) == (1.0, 0.5, 5, 1e-5)
    assert entry.clip == 3.0 and entry.placement == "client-calibrated"
    assert entry.noise_std == pytest.approx(1.0 * 3.0 / math.sqrt(4))


def test_a_secure_aggregation_round_is_charged_once_per_node(tmp_path) -> None:
    """SecAgg+: the round is checked (and charged) before the masked vector leaves, not again inside the protocol."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

    from dpfedavg.flower import server_app
    from dpfedavg.privacy.setup import PrivacySetup

    values = {"num-clients": 6, "clients-per-round": 4.0, "num-rounds": 2, "dim": 8, "seed": 5, "epsilon": 0.0,
              "noise-multiplier": 1.0, "clip": 20.0, "secure-aggregation": True, "checkpoint-every": 0,
              "output-dir": str(tmp_path), "run-name": "secagg"}  # fmt: skip
    cfg = _cfg(values)
    grid = InProcessGrid(client_app, cfg.num_clients, cfg.to_run_config(), node_config={"secure-noise": True})
    server_app.run(grid, cfg, setup=PrivacySetup.resolve(cfg))
    masked = [
        m
        for m in grid.sent
        if RECORD_KEY_CONFIGS in m.content.config_records
        and m.content.config_records[RECORD_KEY_CONFIGS].get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS
    ]
    files = sorted((ledger_module.node_home() / "dpfedavg").glob("privacy-ledger-*.json"))
    rounds = [[r.server_round for r in NodeLedger(f).read()] for f in files]
    assert masked and sum(map(len, rounds)) == len(masked)
    assert all(len(set(r)) == len(r) for r in rounds)  # no round charged twice


# ------------------------------------------------------------------ the approved app's tasks
def test_a_policy_node_runs_only_the_tasks_the_approved_app_declares(tmp_path, monkeypatch) -> None:
    """A run config naming ``module:factory`` would have the node import code the approval does not cover: a
    policy node refuses it (naming the key, the value, what is allowed) before the module is imported; a
    registered task is answered."""
    (tmp_path / "planted_task_46.py").write_text("import os\nos.environ['PLANTED_TASK_46'] = 'ran'\nx = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PLANTED_TASK_46", raising=False)
    node = Node({"max-epsilon": 100.0, "privacy-ledger": str(tmp_path / "ledger.json")})
    refused = node.send(_cfg({**EXACT_RUNS, "task": "planted_task_46:x"}), 1, 1)
    assert refused.has_error()
    reason = refused.error.reason
    assert "task = 'planted_task_46:x'" in reason and "'quadratic'" in reason and "approved app" in reason
    assert "PLANTED_TASK_46" not in __import__("os").environ and "planted_task_46" not in sys.modules
    assert _answered([node.send(_cfg(EXACT_RUNS), 2, 1)])


def test_a_state_cache_that_cannot_be_written_is_one_clear_ledger_error(tmp_path, monkeypatch) -> None:
    """A full disk under the ledger's SQLite cache (``database or disk is full``) is one `LedgerError` naming the
    files, not a raw ``sqlite3.OperationalError`` (what `deploy ledger` printed on a full disk)."""
    import sqlite3

    from dpfedavg.privacy import ledger as ledger_module
    from dpfedavg.privacy.ledger import LedgerError

    path = tmp_path / "ledger.json"
    ledger = NodeLedger(path)

    def full(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(ledger_module._State, "epsilon", full)
    with pytest.raises(LedgerError, match=r"cannot be read or written \(database or disk is full\).*ledger file"):
        ledger.spent(NodePolicy(max_epsilon=8.0, max_epsilon_delta=1e-5))
