"""The deployment guide (docs/how-to/deploy.md) across four simulated hosts: Linux network namespaces.

A SuperLink host (10.231.0.1), two SuperNode hosts (10.231.0.2, .3) and a laptop (10.231.0.4), each a
network namespace with its own loopback and one veth link to a bridge that lives in a fifth namespace:
the hosts reach each other only by their private addresses, and nothing has a route out. Every host
has its own home folder (``HOME``, ``FLWR_HOME``); they share the file system and the installed package,
as machines with the same clone would. The guide's blocks run as written, the way
``tests/test_readme_deploy.py`` runs them on loopback (same block extraction and substitutions), with
``SERVER`` set to the SuperLink's address and ``CLIENTS`` to the SuperNode hosts'; ``ssh HOST CMD`` runs
CMD in HOST's home and ``scp`` copies ``HOST:path`` into HOST's home (stand-ins on ``PATH``).

Then, on the same federation:

* the private run's epsilon equals the exact epsilon of the K-fold composed Gaussian mechanism
  (q = 1: a Gaussian with mu = sqrt(K)/z, Balle and Wang 2018, solved with scipy), up to the PLD
  accountant's pessimistic discretization;
* a SuperNode with a key that was never registered is refused (exit status 1, "No SuperNode found with
  the given public key" in the SuperLink's log);
* just before the guide's run, a run asking for C = 1000 is refused by both nodes (their ``max-clip`` is
  100), naming the rule;
* during the guide's run, SuperNode 1's machine shuts down (SIGTERM) once round 1 is recorded, and the
  last round counts it as a dropout (the run finishes, its epsilon unchanged).

Every process is stopped by PID and every namespace deleted, pass or fail. It needs root and iproute2
(``ip netns``); elsewhere it skips with the reason.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from dpfedavg.deploy.netns import namespaces_unavailable as _namespaces_unavailable
from test_readme_deploy import BIN, Processes, _foreground, _wait_for_the_run, as_script, bash_blocks

pytestmark = [pytest.mark.deployment, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
SUBNET = "10.231.0"
ROLES = {"superlink": 1, "client-0": 2, "client-1": 3, "laptop": 4}  # host -> last octet of its address

#: ``ssh HOST CMD``: CMD in HOST's home folder (HOST's address -> home in $DPF_HOMES).
FAKE_SSH = f"""#!{sys.executable}
import json, os, subprocess, sys
homes = json.load(open(os.environ["DPF_HOMES"]))
home = homes[sys.argv[1]]
sys.exit(subprocess.call(["bash", "-c", " ".join(sys.argv[2:])], cwd=home, env={{**os.environ, "HOME": home}}))
"""

#: ``scp [-r] SRC... DST``: ``HOST:path`` is ``path`` in HOST's home folder.
FAKE_SCP = f"""#!{sys.executable}
import json, os, shutil, sys
homes = json.load(open(os.environ["DPF_HOMES"]))
def local(p):
    if ":" in p and not p.startswith("/"):
        host, p = p.split(":", 1)
        return p if p.startswith("/") else os.path.join(homes[host], p)
    return p
*sources, target = [local(a) for a in sys.argv[1:] if not a.startswith("-")]
for source in sources:
    if not os.path.exists(source):
        sys.exit(f"scp: {{source}}: No such file or directory")
    dest = os.path.join(target, os.path.basename(source.rstrip("/"))) if os.path.isdir(target) else target
    if os.path.isdir(source):
        shutil.copytree(source, dest, dirs_exist_ok=True)
    else:
        shutil.copy2(source, dest)
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Hosts:
    """Four hosts on a private bridge: namespaces ``<tag>-<role>``, the bridge in ``<tag>-br``."""

    def __init__(self) -> None:
        self.tag = f"dpf{uuid.uuid4().hex[:6]}"
        self.made: list[str] = []

    def ns(self, role: str) -> str:
        return f"{self.tag}-{role}"

    def address(self, role: str) -> str:
        return f"{SUBNET}.{ROLES[role]}"

    def prefix(self, role: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.ns(role))

    def _add(self, name: str) -> None:
        _ip("netns", "add", name)
        self.made.append(name)

    def create(self) -> None:
        bridge = self.ns("br")
        self._add(bridge)
        _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge, "link", "set", "br0", "up")
        for i, role in enumerate(ROLES):
            host = self.ns(role)
            self._add(host)
            _ip("-n", host, "link", "set", "lo", "up")
            _ip("-n", bridge, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", host)
            _ip("-n", bridge, "link", "set", f"v{i}", "master", "br0")
            _ip("-n", bridge, "link", "set", f"v{i}", "up")
            _ip("-n", host, "addr", "add", f"{self.address(role)}/24", "dev", "eth0")
            _ip("-n", host, "link", "set", "eth0", "up")

    def delete(self) -> None:
        for name in reversed(self.made):
            _ip("netns", "del", name, check=False)

    def left(self) -> list[str]:
        listing = _ip("netns", "list", check=False).stdout
        return [line.split()[0] for line in listing.splitlines() if line.startswith(self.tag)]


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(f"no simulated hosts: {reason}")
    net = Hosts()
    try:
        net.create()
        yield net
    finally:
        net.delete()
    assert net.left() == [], net.left()


def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """The smallest epsilon of a mu-GDP mechanism at ``delta`` (Balle and Wang 2018, Theorem 8), by root finding."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    def excess(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    return brentq(excess, 0.0, 100.0, xtol=1e-12)


def test_exact_gaussian_epsilon_matches_a_known_value() -> None:
    """mu = 1 (one Gaussian of noise multiplier 1) at delta = 1e-5: dp-accounting's PLD accountant gives 4.37718."""
    from scipy.stats import norm

    eps = exact_gaussian_epsilon(1.0, 1e-5)
    assert norm.cdf(-eps + 0.5) - math.exp(eps) * norm.cdf(-eps - 0.5) == pytest.approx(1e-5, rel=1e-9)
    assert eps == pytest.approx(4.37718, abs=1e-4)


def _listening(net: Hosts, role: str, port: int) -> bool:
    probe = f"exec 3<>/dev/tcp/{net.address(role)}/{port}"
    return subprocess.run([*net.prefix("laptop"), "bash", "-c", probe], capture_output=True, timeout=10).returncode == 0


def test_the_guide_runs_across_four_hosts(hosts: Hosts, tmp_path: Path) -> None:
    net = hosts
    blocks = bash_blocks()
    server_blocks = [b for b in blocks if "flower-superlink " in b]
    client_blocks = [b for b in blocks if "dpfedavg.deploy supernode " in b]
    approval_blocks = [b for b in blocks if "dpfedavg.deploy app-hash " in b]
    run_blocks = [b for b in blocks if "flwr run " in b]
    idempotent = [b for b in blocks if "dpfedavg.deploy credentials" in b or "tomli_w" in b]
    assert len(server_blocks) == len(client_blocks) == len(approval_blocks) == len(run_blocks) == 1, blocks
    assert len(idempotent) == 2, idempotent
    num_clients = int(re.search(r"^N=(\d+)", client_blocks[0], flags=re.M).group(1))
    assert num_clients == 2, "the simulated federation has two SuperNode hosts"
    num_rounds = int(re.search(r"num-rounds=(\d+)", run_blocks[0]).group(1))
    run_name = re.search(r"run-name='([^']+)'", run_blocks[0]).group(1)
    superlink_port = int(re.search(r"--port (\d+)", server_blocks[0]).group(1))
    server = net.address("superlink")
    clients = [net.address(f"client-{i}") for i in range(num_clients)]

    fakes = tmp_path / "bin"
    fakes.mkdir()
    for name, text in (("ssh", FAKE_SSH), ("scp", FAKE_SCP)):
        (fakes / name).write_text(text)
        (fakes / name).chmod(0o755)
    homes = {role: tmp_path / role / "home" for role in ROLES}
    for home in homes.values():
        home.mkdir(parents=True)
    (tmp_path / "homes.json").write_text(json.dumps({net.address(r): str(h) for r, h in homes.items()}))

    def env(role: str) -> dict[str, str]:
        e = dict(os.environ)
        e.update(
            HOME=str(homes[role]),
            FLWR_HOME=str(homes[role] / ".flwr"),
            FLWR_TELEMETRY_ENABLED="0",
            FLWR_DISABLE_UPDATE_CHECK="1",
            PYTHONUNBUFFERED="1",
            DPF_HOMES=str(tmp_path / "homes.json"),
            PATH=f"{fakes}{os.pathsep}{BIN}{os.pathsep}{e.get('PATH', '')}",
        )
        return e

    laptop, on_laptop = env("laptop"), net.prefix("laptop")
    bg = Processes(laptop, tmp_path)
    server_dir = homes["superlink"] / "dpfedavg-server"
    creds = homes["laptop"] / "dpfedavg-creds"
    snapshots: dict[str, bytes] = {}
    outputs: dict[str, str] = {}

    def foreground(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
        t0 = time.monotonic()
        result = _foreground(script, laptop, timeout, bg, on_laptop)
        print(f"{time.monotonic() - t0:6.1f} s  {script.strip().splitlines()[-1][:80]}")
        return result

    def wait(proc: subprocess.Popen, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            bg.remember_descendants()
            time.sleep(0.5)
        return proc.poll()

    def refusals(run_block: str) -> tuple[str, int | None]:
        """A SuperNode with a key nobody registered, beside a run whose C = 1000 breaks the nodes' max-clip = 100."""
        intruder = as_script(client_blocks[0], client=1, server=server, clients=clients)
        intruder = intruder.replace("keys/supernode_$I", "keys/intruder").replace("$((9094 + I))", "9099")
        # the SuperLink refuses it with Flower's 305, which the supervisor retries (a restarted node's SuperLink may
        # still hold its dead process): no retry here, so it exits with Flower's status
        intruder = intruder.replace("dpfedavg.deploy supernode ", "dpfedavg.deploy supernode --activation-timeout 0 ")
        assert "keys/intruder" in intruder and "--activation-timeout 0" in intruder
        intruder = "python -m dpfedavg.deploy supernode-key ~/dpfedavg-creds/keys/intruder\n" + intruder
        bg.start("intruder", intruder, tmp_path / "client-1" / "shell", env("client-1"), net.prefix("client-1"))
        run = re.sub(r"run-name='[^']+'", "run-name='refused'", run_block)
        run = re.sub(r"num-rounds=\d+", "num-rounds=1 clip=1000.0", run)
        run = "\n".join(line for line in run.splitlines() if "deploy check" not in line)
        result = foreground(as_script(run, server=server, clients=clients), 240)
        assert result.returncode == 0, result.stdout[-3000:]
        return result.stdout, wait(bg.procs["intruder"], 60)

    try:
        for block in blocks:
            if block in server_blocks:
                script = as_script(block, server=server, clients=clients)
                bg.start(
                    "superlink", script, tmp_path / "superlink" / "shell", env("superlink"), net.prefix("superlink")
                )
                bg.wait_for_start("superlink", lambda: _listening(net, "superlink", superlink_port), 90, "its port")
            elif block in approval_blocks:  # each client machine approves the app of its own clone
                for i in range(num_clients):
                    role = f"client-{i}"
                    script = as_script(block, client=i, server=server, clients=clients)
                    result = _foreground(script, env(role), 120, bg, net.prefix(role))
                    assert result.returncode == 0, f"{block}\n{result.stdout[-3000:]}"
            elif block in client_blocks:
                for i in range(num_clients):
                    role = f"client-{i}"
                    script = as_script(block, client=i, server=server, clients=clients)
                    bg.start(f"supernode-{i}", script, tmp_path / role / "shell", env(role), net.prefix(role))
                for i in range(num_clients):
                    name = f"supernode-{i}"
                    bg.wait_for_start(name, lambda name=name: "SuperNode ID" in bg.log(name), 90, "'SuperNode ID' line")
            elif block in run_blocks:
                # a SuperExec that could not reach its SuperLink leaves every run pending: fail now, not at a timeout
                assert "CERTIFICATE_VERIFY_FAILED" not in bg.log("superlink"), bg.log("superlink")[-3000:]
                outputs["refused"], intruder_code = refusals(block)
                # the guide's private run; SuperNode 1's machine shuts down (SIGTERM) once round 1 is recorded
                bg.start("private-run", as_script(block, server=server, clients=clients), ROOT, laptop, on_laptop)
                bg.wait_for("private-run", lambda: "round 1/" in bg.log("private-run"), 240, "round 1")
                os.killpg(bg.procs["supernode-1"].pid, signal.SIGTERM)
                code = wait(bg.procs["private-run"], 240)
                outputs["private"] = bg.log("private-run")
                assert code == 0, f"{outputs['private'][-3000:]}\n{bg.log('superlink')[-3000:]}"
                _wait_for_the_run(server_dir, laptop, bg, prefix=on_laptop)
            else:
                for attempt in (1, 2) if block in idempotent else (1,):
                    result = foreground(as_script(block, server=server, clients=clients))
                    assert result.returncode == 0, f"{block}\n{result.stdout[-3000:]}\n{bg.log('superlink')[-3000:]}"
                    if block in idempotent:  # pasting it twice leaves the same files
                        files = [creds / "certificates" / "ca.crt", homes["laptop"] / ".flwr" / "config.toml"]
                        state = b"".join(f.read_bytes() for f in files if f.exists())
                        assert attempt == 1 or snapshots[block] == state, "a second paste changed the files"
                        snapshots[block] = state
    finally:
        bg.stop()
    assert [pid for pid, p in bg.known.items() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []

    # the private run finished, privately, and its results came back to the laptop
    config = json.loads((server_dir / "outputs" / run_name / "config.json").read_text())
    final = config["final"]
    assert final["rounds_completed"] == num_rounds and final["guarantee"] == "dp", final
    fetched = homes["laptop"] / "dpfedavg-results" / run_name
    assert json.loads((fetched / "config.json").read_text())["final"] == final
    rows = list(csv.DictReader((server_dir / "outputs" / run_name / "metrics.csv").open()))[1:]
    counts = [(r["num_sampled"], r["num_received"], r["num_dropped"], r["num_rejected"]) for r in rows]
    assert len(rows) == num_rounds and counts[0] == ("2", "2", "0", "0"), rows
    # the dropout: SuperNode 1 was shut down after round 1, so the last round misses it (round 2 may too)
    assert counts[-1] == ("2", "1", "1", "0"), rows
    # its epsilon against the exact one: q = 1, so K rounds of noise multiplier z are mu-GDP with mu = sqrt(K)/z
    zs = {float(r["noise_multiplier"]) for r in rows}
    assert len(zs) == 1, zs
    assert "clients-per-round=$N.0" in run_blocks[0]  # r = n: q = 1, every client in every round (checked above)
    exact = exact_gaussian_epsilon(math.sqrt(num_rounds) / zs.pop(), final["delta"])
    # tolerances: 1e-4 below for z as written in metrics.csv, 0.01 above for the PLD accountant's pessimistic grid
    assert exact - 1e-4 <= final["epsilon"] <= exact + 0.01, (final["epsilon"], exact)
    assert final["epsilon"] <= 5.0  # the run config's default target

    # the credentials were written under the laptop's HOME, not in the clone; one connection named remote
    assert (creds / "certificates" / "ca.key").exists()
    assert not (ROOT / "creds").exists() and not (ROOT / "dpfedavg-creds").exists()
    assert (homes["laptop"] / ".flwr" / "config.toml").read_text().count("[superlink.remote]") == 1
    # step 5 approved the clone's app hash on each client machine; each SuperNode checked the run's FAB against it
    for i in range(num_clients):
        approved = (homes[f"client-{i}"] / "dpfedavg-creds" / "approved-app-hash").read_text().strip()
        assert f"has the approved app hash {approved}" in bg.log(f"supernode-{i}"), bg.log(f"supernode-{i}")[-3000:]

    # the unregistered key was refused by the SuperLink, and the SuperNode said so and exited with 1
    assert intruder_code == 1, bg.log("intruder")[-3000:]
    assert "Failed to activate SuperNode" in bg.log("intruder")
    assert "No SuperNode found with the given public key" in (homes["superlink"] / "dpfedavg-superlink.log").read_text()

    # the policy refusal: both nodes refused round 1, naming the rule; a round refused by all ends the run
    refused = server_dir / "outputs" / "refused"
    assert "final" in json.loads((refused / "config.json").read_text()), outputs["refused"][-3000:]
    rows = list(csv.DictReader((refused / "metrics.csv").open()))[1:]
    counts = [(r["num_sampled"], r["num_received"], r["num_dropped"], r["num_rejected"]) for r in rows]
    assert counts == [("2", "0", "0", "2")], rows
    assert "refused by this node's policy (max-clip)" in outputs["refused"], outputs["refused"][-3000:]
