"""Fault tests of a deployment across simulated hosts (issue 47 items 3 and 8): one network namespace per host.

A SuperLink host (which also runs the ServerApp and the ``flwr`` CLI) and one host per SuperNode, on a private
bridge (`dpfedavg.deploy.netns.NetnsHosts`), with TLS, SuperNode authentication and a privacy ledger on every
node (`dpfedavg.deploy.loopback.LoopbackFederation`). Each test injects one fault:

* the SuperLink killed (SIGKILL, with its SuperExec and ServerApp) in round 3, restarted on its database, the
  run resumed with ``resume=true``: the final model is bit-identical to an uninterrupted run of the same seed;
* the ServerApp killed in round 3 (the SuperLink stays up), the run resumed;
* a SuperNode killed and restarted at once (its supervisor retries while the SuperLink still holds the dead node);
* a SuperNode's host cut off the network for `PARTITION_S` seconds;
* a SuperNode whose ledger lies on a full disk (a tiny tmpfs): it refuses rounds, the run goes on;
* every SuperNode behind a TCP proxy that delays each chunk and "loses" some (a retransmission timeout more).

Each asserts that the run's final epsilon equals the exact epsilon of the releases made (q = 1: K composed
Gaussians are mu-GDP with mu = sqrt(K)/z; Balle and Wang 2018, solved with scipy, not the project's accountant)
and that every node's ledger charges what that node released: one plan of K rounds plus every round it answered
more than once (mu = sqrt(K + redone)/z).

Marked ``faults`` (and ``deployment``, ``slow``): not in the default suite. ``.ci/run`` runs them after it
(``pytest -m faults -p no:randomly -n 0``); they need root and iproute2 and skip elsewhere with the reason.
Every test is bounded in time (`pytest.mark.timeout`); every process is stopped by PID and every namespace
deleted, pass or fail.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from dpfedavg.deploy.loopback import LoopbackFederation
from dpfedavg.deploy.netns import NetnsHosts, namespaces_unavailable
from dpfedavg.privacy.ledger import NodeLedger
from test_multihost import exact_gaussian_epsilon  # Balle and Wang's exact epsilon of mu-GDP, by scipy

pytestmark = [pytest.mark.faults, pytest.mark.deployment, pytest.mark.slow]

N = 2  #: SuperNode hosts
K = 5  #: rounds (a fault in round 3 leaves rounds before and after it)
DELTA = 1e-6  #: the run's and the nodes' delta
#: Seconds a partitioned host is cut off (the issue's 30 s, shortened: the SuperLink marks it offline either way).
PARTITION_S = 20.0


class _Stop(Exception):
    """Raised from an ``on_poll`` callback: stop waiting for ``flwr run`` (the fault was injected)."""


@pytest.fixture(autouse=True, scope="module")
def _only_when_selected(request: pytest.FixtureRequest) -> None:
    """Not part of the default suite (it would add minutes): these run only when ``-m`` names ``faults``."""
    if "faults" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("fault tests run only with -m faults (see docs/development/testing.md)")


@pytest.fixture
def hosts() -> Iterator[NetnsHosts]:
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(f"no simulated hosts: {reason}")
    net = NetnsHosts(["superlink", "proxy", *(f"node-{i}" for i in range(N))])
    with net:
        yield net
    assert net.left() == [], net.left()


def _values(out: Path, name: str, extra: str = "", round_timeout: float = 60.0, rounds: int = K) -> str:
    return (
        f"num-clients={N} clients-per-round={float(N)} num-rounds={rounds} dim=10 seed=7 round-timeout={round_timeout} "
        f"node-wait-timeout=120.0 checkpoint-every=1 delta={DELTA} output-dir='{out}' run-name='{name}' {extra}"
    )


def _federation(tmp_path: Path, net: NetnsHosts, **kwargs) -> LoopbackFederation:
    ledgers = tmp_path / "ledgers"
    for i in range(N):  # a folder per node: a disk can be mounted under one
        (ledgers / f"node-{i}").mkdir(parents=True, exist_ok=True)
    # a ledger at the nodes' delta, and no noise floor (a floor makes the node draw its own noise from the OS:
    # the seeded runs could not be compared bit for bit)
    config = f"max-epsilon-delta={DELTA} privacy-ledger='{ledgers}/node-{{i}}/ledger.json'"
    # SuperNodes retry their SuperLink for minutes (a restarted SuperLink takes seconds to come back)
    return LoopbackFederation(tmp_path / "fed", N, hosts=net, node_config=config, max_retries=100, **kwargs)


def _after_round(k: int, fault: Callable[[], None]) -> Callable[[str], None]:
    """An ``on_poll`` that injects ``fault`` once round ``k`` is recorded, and then stops waiting for the run."""

    def poll(log: str) -> None:
        if f"round {k}/{K}" in log:
            fault()
            raise _Stop

    return poll


def _run_until_fault(fed: LoopbackFederation, values: str, poll: Callable[[str], None]) -> None:
    with pytest.raises(_Stop):
        fed.run(values, timeout=400, on_poll=poll)


def _wait_finished(directory: Path, timeout: float = 120) -> dict:
    """``config.json``'s ``final`` record (``flwr run --stream`` can return before the run's last write)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            final = json.loads((directory / "config.json").read_text()).get("final")
        except (OSError, ValueError):
            final = None
        if final:
            return final
        time.sleep(1)
    raise AssertionError(f"{directory} has no final record after {timeout} s")


def _z(directory: Path) -> float:
    rows = list(csv.DictReader((directory / "metrics.csv").open()))[1:]
    zs = {float(r["noise_multiplier"]) for r in rows}
    assert len(zs) == 1, zs
    return zs.pop()


def _check_epsilon(directory: Path, releases: int, rounds: int = K) -> None:
    """The run's epsilon against ``releases`` composed Gaussians (q = 1)."""
    final = _wait_finished(directory)
    assert final["rounds_completed"] == rounds, final
    exact = exact_gaussian_epsilon(math.sqrt(releases) / _z(directory), DELTA)
    # 1e-4 below for z as written in metrics.csv, 0.01 above for the PLD accountant's pessimistic discretization
    assert exact - 1e-4 <= final["epsilon"] <= exact + 0.01, (final["epsilon"], exact, releases)


def _check_ledgers(
    tmp_path: Path, z: float, nodes: range = range(N), max_redone: int = 2, plan: int = K
) -> dict[int, Counter]:
    """Every node's ledger: one plan of ``plan`` rounds plus its redone rounds, against the exact composition."""
    from dpfedavg.privacy.policy import NodePolicy

    answered: dict[int, Counter] = {}
    for i in nodes:
        path = tmp_path / "ledgers" / f"node-{i}" / "ledger.json"
        releases = NodeLedger(path).read()
        rounds = Counter(r.server_round for r in releases)
        answered[i] = rounds
        assert set(rounds) <= set(range(1, plan + 1)), rounds
        assert all(r.noise_multiplier == pytest.approx(z, rel=1e-6) for r in releases), (z, releases)
        redone = sum(rounds.values()) - len(rounds)
        assert redone <= max_redone, rounds
        policy = NodePolicy.from_node_config(
            {"max-epsilon-delta": DELTA, "privacy-ledger": str(path)}
        )
        spent = NodeLedger(path).spent(policy)
        exact = exact_gaussian_epsilon(math.sqrt(plan + redone) / z, DELTA) if releases else 0.0
        assert exact - 1e-4 <= spent <= exact + 0.01, (i, spent, exact, rounds)
    return answered


def _model(directory: Path) -> dict[str, np.ndarray]:
    with np.load(directory / "model.npz") as data:
        return {name: data[name].copy() for name in data.files}


@pytest.mark.timeout(600)
def test_superlink_killed_in_round_3_restarted_on_its_database_and_resumed(hosts, tmp_path) -> None:
    out = tmp_path / "out"
    fed = _federation(tmp_path, hosts)
    with fed:
        reference = fed.run(_values(out, "reference"), timeout=300)
        assert reference.returncode == 0, reference.stdout[-3000:]
        _wait_finished(out / "reference")
        # the ledgers so far belong to the reference run; keep them apart from the interrupted run's
        for i in range(N):  # the ledger and its side files (lock, state)
            (tmp_path / "ledgers" / f"node-{i}").rename(tmp_path / "ledgers" / f"reference-{i}")
            (tmp_path / "ledgers" / f"node-{i}").mkdir()
        _run_until_fault(fed, _values(out, "crashed"), _after_round(2, fed.kill_superlink))
        assert fed.serverapp_pids() == []
        fed.restart_superlink()
        resumed = fed.run(_values(out, "crashed", "resume=true"), timeout=300)
    assert fed.leftover_pids() == []
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "Resuming after round 2" in resumed.stdout or "Resuming after round 3" in resumed.stdout, resumed.stdout
    # seeded: a redone round repeats the same replies (the same final model), but a Flower server charges it all the
    # same (a node's policy noise would be fresh whatever the seed; issue 46): its record says how many it sent
    redone = _wait_finished(out / "crashed")["releases"] - K
    _check_epsilon(out / "crashed", K + redone)
    ref, got = _model(out / "reference"), _model(out / "crashed")
    assert ref.keys() == got.keys() and all(np.array_equal(ref[k], got[k]) for k in ref)
    answered = _check_ledgers(tmp_path, _z(out / "crashed"), max_redone=1)
    assert all(set(rounds) == set(range(1, K + 1)) for rounds in answered.values()), answered
    assert max(sum(c.values()) - len(c) for c in answered.values()) <= redone <= 1, (redone, answered)


@pytest.mark.timeout(600)
def test_serverapp_killed_in_round_3_and_resumed_with_secure_noise(hosts, tmp_path) -> None:
    """With ``secure-noise`` a round in flight when the ServerApp died is a release, redone as a fresh one:
    the run's epsilon and every ledger charge it."""
    out = tmp_path / "out"
    fed = _federation(tmp_path, hosts)
    killed: list[int] = []
    with fed:
        kill = _after_round(2, lambda: killed.append(fed.kill_serverapp()))
        _run_until_fault(fed, _values(out, "crashed", "secure-noise=true"), kill)
        resumed = fed.run(_values(out, "crashed", "secure-noise=true resume=true"), timeout=300)
    assert fed.leftover_pids() == []
    assert killed == [1], killed
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    final = _wait_finished(out / "crashed")
    redone = final["releases"] - K  # the server's count, from its write-ahead record (one line per round sent)
    answered = _check_ledgers(tmp_path, _z(out / "crashed"), max_redone=1)
    assert all(set(rounds) == set(range(1, K + 1)) for rounds in answered.values()), answered
    node_redone = max(sum(c.values()) - len(c) for c in answered.values())
    # the server sent at most the round in flight again (checkpoint-every = 1); no node answered a round twice that
    # the server did not send twice
    assert node_redone <= redone <= 1, (redone, answered)
    _check_epsilon(out / "crashed", K + redone)


@pytest.mark.timeout(600)
def test_supernode_killed_and_restarted_comes_back(hosts, tmp_path) -> None:
    from dpfedavg.deploy.app_hash import build_fab, fab_app_hash
    from dpfedavg.engines.local_superlink import copy_app

    out = tmp_path / "out"
    app = copy_app(tmp_path / "app")  # the app `flwr run` ships, and its hash the nodes approve
    # through the supervisor (`deploy supernode`): it retries while the SuperLink still holds the dead node (305)
    fed = _federation(tmp_path, hosts, approved_app_hashes=[fab_app_hash(build_fab(app))])
    restarted: list[bool] = []

    rounds = 12  # a round takes a few seconds; the SuperLink holds the dead node ~45 s, then the supervisor is back

    def poll(log: str) -> None:
        if not restarted and f"round 1/{rounds}" in log:
            fed.kill_supernode(1)
            fed.restart_supernode(1)
            restarted.append(True)

    with fed:
        result = fed.run(_values(out, "node-restart", rounds=rounds), timeout=500, on_poll=poll, app=app)
    assert fed.leftover_pids() == []
    assert restarted and result.returncode == 0, result.stdout[-3000:]
    # the server tops up a missing reply's noise: every round is nominal
    _check_epsilon(out / "node-restart", rounds, rounds=rounds)
    rows = list(csv.DictReader((out / "node-restart" / "metrics.csv").open()))[1:]
    assert rows[-1]["num_received"] == str(N), rows  # the restarted node is back by the last round
    _check_ledgers(tmp_path, _z(out / "node-restart"), max_redone=0, plan=rounds)


@pytest.mark.timeout(600)
def test_a_partitioned_supernode_host_is_a_dropout_and_rejoins(hosts, tmp_path) -> None:
    out = tmp_path / "out"
    fed = _federation(tmp_path, hosts)
    cut: list[float] = []

    def poll(log: str) -> None:
        if not cut and f"round 1/{K}" in log:
            hosts.partition("node-1")
            cut.append(time.monotonic())
        elif len(cut) == 1 and time.monotonic() - cut[0] > PARTITION_S:
            hosts.heal("node-1")
            cut.append(time.monotonic())

    with fed:
        result = fed.run(_values(out, "partition", round_timeout=30.0), timeout=500, on_poll=poll)
    assert fed.leftover_pids() == []
    assert len(cut) >= 1 and result.returncode == 0, result.stdout[-3000:]
    _check_epsilon(out / "partition", K)
    _check_ledgers(tmp_path, _z(out / "partition"), max_redone=0)


@pytest.mark.timeout(600)
def test_a_full_disk_under_a_ledger_refuses_rounds_and_loses_nothing(hosts, tmp_path) -> None:
    out, disk = tmp_path / "out", tmp_path / "ledgers" / "node-1"
    disk.mkdir(parents=True)
    # node 1's ledger on a disk of its own (1 MiB), filled once round 1 is recorded: later releases cannot be
    # recorded, and node 1 refuses those rounds; node 0's ledger is on the ordinary disk
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        fed = _federation(tmp_path, hosts)
        with fed:

            def poll(log: str) -> None:
                filler = disk / "filler"
                if f"round 1/{K}" in log and not filler.exists():
                    subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=4k"], capture_output=True)

            result = fed.run(_values(out, "full-disk"), timeout=500, on_poll=poll)
        assert fed.leftover_pids() == []
        assert result.returncode == 0, result.stdout[-3000:]
        # space freed: reading a ledger refreshes its state cache, which needs a few pages of disk
        (disk / "filler").unlink()
        _check_epsilon(out / "full-disk", K)
        # what each node recorded is intact and charged exactly; a node that could not record a release refused it
        answered = _check_ledgers(tmp_path, _z(out / "full-disk"), max_redone=0)
        rows = list(csv.DictReader((out / "full-disk" / "metrics.csv").open()))[1:]
        received = sum(int(r["num_received"]) for r in rows)
        assert received == sum(sum(c.values()) for c in answered.values()), (rows, answered)
        assert set(answered[0]) == set(range(1, K + 1)) and len(answered[1]) < K, answered
        assert "refused the round: privacy-ledger" in result.stdout, result.stdout[-3000:]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.timeout(600)
def test_delay_and_loss_through_a_proxy(hosts, tmp_path) -> None:
    out = tmp_path / "out"
    fed = _federation(tmp_path, hosts, superlink_via=hosts.address("proxy"))
    # the proxy first (the SuperNodes dial it as they start), on the SuperLink's port, to the SuperLink
    proxy = subprocess.Popen(
        [*hosts.prefix("proxy"), sys.executable, "-m", "dpfedavg.deploy.netns", "proxy",
         f"{hosts.address('proxy')}:{fed.port}", f"{hosts.address('superlink')}:{fed.port}", "0.1", "0.05", "7"],
    )  # fmt: skip
    try:
        with fed:
            result = fed.run(_values(out, "proxy"), timeout=500)
    finally:
        proxy.kill()
        proxy.wait()
    assert fed.leftover_pids() == []
    assert result.returncode == 0, result.stdout[-3000:]
    _check_epsilon(out / "proxy", K)
    rows = list(csv.DictReader((out / "proxy" / "metrics.csv").open()))[1:]
    assert all(r["num_received"] == str(N) for r in rows), rows  # a slow link is not a dropout
    _check_ledgers(tmp_path, _z(out / "proxy"), max_redone=0)
