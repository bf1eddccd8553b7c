"""The deployment guide (docs/how-to/deploy.md) runs as written: every block, on loopback.

Where network namespaces can be made (root, iproute2), tests/test_multihost.py runs the page across
four simulated hosts with every check below, and this loopback run is skipped: the page runs once.

Every ```` ```bash ```` block of the page is run with ``bash -e`` in page order:

* the one starting ``flower-superlink`` in the background (it ``cd``s to ``~/dpfedavg-server``,
  where the results are written), stopped by PID at the end;
* the one starting the SuperNode (``python -m dpfedavg.deploy supernode``, which runs
  ``flower-supernode``) N times in the background, with ``I=0`` .. ``I=N-1``, each in its own
  "client" folder, stopped by PID at the end;
* every other block in the foreground, in the repository root (``flwr run .``), with a time limit.

What is changed from the text: ``SERVER=...`` is set to ``127.0.0.1``, every host of
``CLIENTS=(...)`` too (the count, N, is kept), and ``I=...`` to the client's index; lines with
``pip install`` are skipped (the package is installed in the test's environment, whose ``bin``
comes first on ``PATH``). All machines are this one with one home folder, so ``ssh HOST CMD``
runs CMD in the home folder and ``scp`` copies locally, mapping ``HOST:path`` to the home folder
(a copy onto the file itself only checks that it exists): both are stand-ins on ``PATH``.
``HOME`` and ``FLWR_HOME`` point into ``tmp_path``, so the credentials, the SuperLink's database,
log and results, the approved app hash, and the ``flwr`` connection all live there (the
approval block hashes the repository, the clone every "machine" shares). The test waits on events (the
SuperLink's port, the SuperNodes' "SuperNode ID" log line; a SuperLink or SuperNode not up within 90 s is
stopped and started again, once, with a WARNING: a loaded machine can be slow to start Flower), checks that
the run really finished (``flwr run --stream`` exits 0 even when the ServerApp raises, so it reads ``config.json``'s
``final``), that it was private (guarantee ``dp``), that the results came back to "your machine",
that pasting the idempotent steps twice changes nothing, that every SuperNode checked the run's
FAB against the approved app hash, and that no process it started is left, pass or fail.

The page uses fixed ports (9093 for the SuperLink, 9094 + I for the SuperNodes), so two runs of
this test cannot share a machine; it fails at once if one is taken.
"""

from __future__ import annotations

import csv
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dpfedavg.engines.local_superlink import StartupTimeout, leftover_pids, retry_startup_once, stop_processes

pytestmark = [pytest.mark.deployment, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SERVER = "127.0.0.1"
PAGE = ROOT / "docs" / "how-to" / "deploy.md"

#: ``ssh HOST CMD`` on a one-machine federation: CMD in the home folder.
FAKE_SSH = """#!/bin/bash
shift
cd "$HOME" && exec bash -c "$*"
"""

#: ``scp [-r] SRC... DST`` on a one-machine federation: ``HOST:path`` is ``path`` in the home folder.
FAKE_SCP = f"""#!{sys.executable}
import os, shutil, sys
def local(p):
    if ":" in p and not p.startswith("/"):
        p = p.split(":", 1)[1]
        return p if p.startswith("/") else os.path.join(os.environ["HOME"], p)
    return p
*sources, target = [local(a) for a in sys.argv[1:] if not a.startswith("-")]
for source in sources:
    if not os.path.exists(source):
        sys.exit(f"scp: {{source}}: No such file or directory")
    dest = os.path.join(target, os.path.basename(source.rstrip("/"))) if os.path.isdir(target) else target
    if os.path.exists(dest) and os.path.samefile(source, dest):
        continue
    if os.path.isdir(source):
        shutil.copytree(source, dest, dirs_exist_ok=True)
    else:
        shutil.copy2(source, dest)
"""


def bash_blocks() -> list[str]:
    from doc_blocks import page_blocks

    blocks = [b for b in page_blocks(PAGE) if b.is_shell]
    assert blocks and all(b.kind == "run-by" for b in blocks), [b.where for b in blocks if b.kind != "run-by"]
    return [b.source for b in blocks]


def as_script(block: str, client: int | None = None, server: str = SERVER, clients: list[str] | None = None) -> str:
    """The block with SERVER, the client hosts (and the client index I) set, ``pip install`` lines skipped.

    ``clients`` are the client machines' addresses, in order (default: every one is ``server``).
    """
    lines = []
    for line in block.splitlines():
        if "pip install" in line:
            continue  # the package is installed here (and a venv in the repository would be wrong)
        line = re.sub(r"^SERVER=\S+", f"SERVER={server}", line)

        def hosts(m: re.Match) -> str:
            names = clients or [server] * len(m[1].split())
            assert len(names) == len(m[1].split()), (names, m[0])
            return "CLIENTS=(" + " ".join(names) + ")"

        line = re.sub(r"^CLIENTS=\((.*)\)", hosts, line)
        if client is not None:
            line = re.sub(r"^I=\S+", f"I={client}", line)
        lines.append(line)
    return "\n".join(lines) + "\n"


def _port_free(port: int) -> bool:
    """Nothing listens on ``port`` (a port in TIME_WAIT from an earlier run counts as free, as for uvicorn)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


class Processes:
    """Background blocks started in their own session; every descendant remembered, stopped by PID."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.known: dict[int, psutil.Process] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, tuple] = {}

    def start(
        self, name: str, script: str, cwd: Path, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()
    ) -> subprocess.Popen:
        """Run ``script`` with ``bash -e`` in the background (``prefix``, e.g. ``ip netns exec NS``, before it)."""
        cwd.mkdir(parents=True, exist_ok=True)
        log = (self.logs / f"{name}.log").open("w")
        proc = subprocess.Popen(
            [*prefix, "bash", "-e", "-c", script],
            cwd=cwd,
            env=env or self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.known[proc.pid] = psutil.Process(proc.pid)
        self.procs[name] = proc
        self.commands[name] = (script, cwd, env, prefix)
        return proc

    def remember_descendants(self) -> None:
        for proc in list(self.known.values()):
            try:
                for child in proc.children(recursive=True):
                    self.known[child.pid] = child
            except psutil.Error:
                pass

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def wait_for(self, name: str, ready, timeout: float, what: str) -> None:
        """Poll until ``ready()``; fail at once if the block's process exits; `StartupTimeout` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not ready():
            self.remember_descendants()
            if self.procs[name].poll() is not None:
                code = self.procs[name].returncode
                pytest.fail(f"{name} exited with {code} before {what}:\n{self.log(name)[-3000:]}")
            if time.monotonic() > deadline:
                raise StartupTimeout(f"{name}: no {what} within {timeout:.0f} s\n{self.log(name)[-3000:]}")
            time.sleep(0.2)

    def wait_for_start(self, name: str, ready, timeout: float, what: str) -> None:
        """`wait_for()` a block that starts Flower (a SuperLink, a SuperNode); one that is not ready in time is
        stopped (by PID) and started again, once, with a WARNING naming the cause (`retry_startup_once()`): a loaded
        machine can be slow to start Flower."""
        retry_startup_once(
            lambda: self.wait_for(name, ready, timeout, what),
            f"{name} ({what})",
            before_retry=lambda: self.restart(name),
        )

    def restart(self, name: str) -> None:
        """Stop the block ``name`` and every process it started (by PID), then start it again."""
        self.remember_descendants()
        root = self.known[self.procs[name].pid]
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            tree = [root]
        stop_processes({p.pid: p for p in tree})
        self.start(name, *self.commands[name])

    def stop(self) -> None:
        self.remember_descendants()
        stop_processes(self.known)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection((SERVER, port), timeout=0.5):
            return True
    except OSError:
        return False


def _foreground(
    script: str, env: dict[str, str], timeout: float, bg: Processes, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """Run a block in the repository root; on timeout its process group is killed."""
    proc = subprocess.Popen(
        [*prefix, "bash", "-e", "-c", script],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    bg.known[proc.pid] = psutil.Process(proc.pid)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"block did not finish in {timeout:.0f} s:\n{script}\n{out[-3000:]}")
    bg.remember_descendants()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def _final(server_dir: Path) -> bool:
    configs = list((server_dir / "outputs").glob("*/config.json"))
    return len(configs) == 1 and "final" in json.loads(configs[0].read_text())


def _wait_for_the_run(
    server_dir: Path, env: dict[str, str], bg: Processes, timeout: float = 180.0, prefix: tuple[str, ...] = ()
) -> None:
    """Until the run's ``config.json`` has ``final`` or ``flwr ls`` says the run finished.

    ``flwr run --stream`` can return before the run ends: seen once on an overloaded machine, where
    the SuperLink's SQLite database was locked and the log stream ended. The run may go on.
    """
    deadline = time.monotonic() + timeout
    while not _final(server_dir) and time.monotonic() < deadline:
        listing = _foreground("flwr ls remote --format json\n", env, 60, bg, prefix).stdout
        runs = json.loads(listing[listing.index("{") :]).get("runs", [])
        if runs and all(run["status"].startswith("finished") for run in runs):
            return
        time.sleep(2)


def test_readme_deploy_section_runs_as_written(tmp_path: Path) -> None:
    """The page on one machine, where tests/test_multihost.py cannot make its hosts (it checks all of this too)."""
    from test_multihost import _namespaces_unavailable

    if _namespaces_unavailable() is None:
        pytest.skip("the page runs across four simulated hosts instead: tests/test_multihost.py")
    blocks = bash_blocks()
    server_blocks = [b for b in blocks if "flower-superlink " in b]
    client_blocks = [b for b in blocks if "dpfedavg.deploy supernode " in b]
    run_blocks = [b for b in blocks if "flwr run " in b]
    idempotent = [b for b in blocks if "dpfedavg.deploy credentials" in b or "tomli_w" in b]
    assert len(server_blocks) == len(client_blocks) == len(run_blocks) == 1, blocks
    assert len(idempotent) == 2, idempotent
    superlink_port = int(re.search(r"--port (\d+)", server_blocks[0]).group(1))
    counts = {int(n) for b in blocks for n in re.findall(r"^N=(\d+)", b, flags=re.M)}
    hosts = [len(m.split()) for b in blocks for m in re.findall(r"^CLIENTS=\((.*)\)", b, flags=re.M)]
    assert len(counts) == 1 and hosts and set(hosts) == counts, (counts, hosts)
    num_clients = counts.pop()
    num_rounds = int(re.search(r"num-rounds=(\d+)", run_blocks[0]).group(1))
    run_name = re.search(r"run-name='([^']+)'", run_blocks[0]).group(1)
    assert num_rounds <= 5, "the page's run is a smoke test: keep num-rounds small"
    busy = [p for p in (superlink_port, *(9094 + i for i in range(num_clients))) if not _port_free(p)]
    assert not busy, f"ports {busy} are in use (another run of this test?): the page's ports must be free"

    home = tmp_path / "home"
    home.mkdir()
    fakes = tmp_path / "bin"
    fakes.mkdir()
    for name, text in (("ssh", FAKE_SSH), ("scp", FAKE_SCP)):
        (fakes / name).write_text(text)
        (fakes / name).chmod(0o755)
    env = dict(os.environ)
    env.update(
        HOME=str(home),
        FLWR_HOME=str(tmp_path / "flwr_home"),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        PYTHONUNBUFFERED="1",
        PATH=f"{fakes}{os.pathsep}{BIN}{os.pathsep}{env.get('PATH', '')}",
    )
    bg = Processes(env, tmp_path)
    server_dir = home / "dpfedavg-server"  # where the page's server block starts the SuperLink
    outputs: list[str] = []
    snapshots: dict[str, bytes] = {}
    try:
        for block in blocks:
            if block in server_blocks:
                bg.start("superlink", as_script(block), tmp_path / "server-shell")
                bg.wait_for_start("superlink", lambda: _listening(superlink_port), 90, f"listener on {superlink_port}")
            elif block in client_blocks:
                for i in range(num_clients):
                    bg.start(f"supernode-{i}", as_script(block, client=i), tmp_path / f"client-{i}")
                for i in range(num_clients):
                    name = f"supernode-{i}"
                    bg.wait_for_start(name, lambda name=name: "SuperNode ID" in bg.log(name), 90, "'SuperNode ID' line")
            else:
                for attempt in (1, 2) if block in idempotent else (1,):
                    t0 = time.monotonic()
                    result = _foreground(as_script(block), env, 300 if block in run_blocks else 120, bg)
                    outputs.append(result.stdout)
                    print(f"{time.monotonic() - t0:6.1f} s  {block.splitlines()[-1][:80]}")
                    assert result.returncode == 0, f"{block}\n{result.stdout[-3000:]}"
                    if block in idempotent:  # pasting it twice leaves the same files
                        files = [
                            home / "dpfedavg-creds" / "certificates" / "ca.crt",
                            tmp_path / "flwr_home" / "config.toml",
                        ]
                        state = b"".join(f.read_bytes() for f in files if f.exists())
                        assert attempt == 1 or snapshots[block] == state, "a second paste changed the files"
                        snapshots[block] = state
                if block in run_blocks:
                    _wait_for_the_run(server_dir, env, bg)
        listing = _foreground("flwr supernode list remote --format json\n", env, 60, bg).stdout
        approved = (home / "dpfedavg-creds" / "approved-app-hash").read_text().strip()
        supernode_logs = [bg.log(f"supernode-{i}") for i in range(num_clients)]
    finally:
        bg.stop()
    assert leftover_pids(bg.known) == []
    # nothing else that mentions this test's folder still runs (e.g. a process that escaped tracking)
    stray = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.info["pid"] != os.getpid() and str(tmp_path) in " ".join(p.info["cmdline"] or []):
                stray.append(p.info["pid"])
        except psutil.Error:
            pass
    assert stray == [], stray

    # the run finished (flwr run --stream exits 0 even when the ServerApp raises), privately
    configs = list((server_dir / "outputs").glob("*/config.json"))
    assert len(configs) == 1, (configs, bg.log("superlink")[-3000:], outputs[-1][-3000:] if outputs else "")
    assert configs[0].parent.name == run_name
    final = json.loads(configs[0].read_text())["final"]
    assert final["rounds_completed"] == num_rounds, final
    assert final["guarantee"] == "dp", final
    rows = (configs[0].parent / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + 1 + num_rounds  # header, round 0, rounds 1..K
    # the SuperNodes' privacy policy (step 5) admits the documented run: no client refused a round
    table = list(csv.DictReader(rows))[1:]
    assert all(r["num_rejected"] == "0" and r["num_received"] == r["num_sampled"] for r in table), table
    # step 5 approved this clone's app hash; every SuperNode checked the run's FAB against it before running it
    assert re.fullmatch("[0-9a-f]{64}", approved), approved
    assert all(f"has the approved app hash {approved}" in log for log in supernode_logs), supernode_logs[0][-3000:]
    # the results came back to "your machine"
    fetched = home / "dpfedavg-results" / run_name
    assert json.loads((fetched / "config.json").read_text())["final"] == final
    assert (fetched / "model.npz").exists()
    # the credentials were written under HOME, not in the clone; one connection named remote
    assert (home / "dpfedavg-creds" / "certificates" / "ca.key").exists()
    assert not (ROOT / "creds").exists() and not (ROOT / "dpfedavg-creds").exists()
    assert (tmp_path / "flwr_home" / "config.toml").read_text().count("[superlink.remote]") == 1
    # the N SuperNodes were online; the "one more client" block registered one more key
    nodes = json.loads(listing[listing.index("{") :])["nodes"]
    assert len(nodes) == num_clients + 1, nodes
    assert sum(node["status"] == "online" for node in nodes) == num_clients, nodes


def test_supernode_key_adds_a_client_without_a_new_ca(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    from dpfedavg.deploy.__main__ import main

    key = tmp_path / "keys" / "supernode_2"
    assert main(["supernode-key", str(key)]) == 0
    assert key.stat().st_mode & 0o777 == 0o600
    private = load_ssh_private_key(key.read_bytes(), password=None)
    public = load_ssh_public_key(key.with_name("supernode_2.pub").read_bytes())
    assert private.public_key().public_numbers() == public.public_numbers()
    assert main(["supernode-key", str(key)]) == 2  # never overwrites a key


class _TlsServer:
    """A TLS listener on 127.0.0.1 with the given certificate: handshakes, nothing else (a stand-in SuperLink port)."""

    def __init__(self, cert: Path, key: Path) -> None:
        import ssl
        import threading

        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                with self.context.wrap_socket(conn, server_side=True):
                    pass
            except OSError:
                pass

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not on Linux)
        self.sock.close()
        self.thread.join(timeout=5)


def _handshake(port: int, name: str, ca: Path) -> None:
    """A TLS client verifying the server's certificate for ``name`` against ``ca`` (raises if it does not)."""
    import ssl

    context = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname=name),
    ):
        pass


def _old_style_credentials(out: Path, hosts: list[str], monkeypatch) -> None:
    """Credentials as the command made them before the loopback names were always added."""
    from dpfedavg.deploy import credentials

    with monkeypatch.context() as m:
        m.setattr(credentials, "LOOPBACK_NAMES", (), raising=False)  # (raising=False: absent before they were added)
        credentials.generate_credentials(out, hosts, 2)


def test_credentials_name_the_loopback_addresses_whatever_the_hosts(tmp_path: Path) -> None:
    """The SuperExec dials 127.0.0.1 (``--host 0.0.0.0``) or ::1 (``--host ::``): a TLS client checks each name."""
    import ssl

    from cryptography import x509

    from dpfedavg.deploy.__main__ import main

    assert main(["credentials", "--out", str(tmp_path), "--hosts", "10.231.0.1", "--supernodes", "1"]) == 0
    certs = tmp_path / "certificates"
    server = _TlsServer(certs / "server.pem", certs / "server.key")
    try:
        for name in ("127.0.0.1", "localhost"):
            _handshake(server.port, name, certs / "ca.crt")  # raises SSLCertVerificationError without the name
        with pytest.raises(ssl.SSLCertVerificationError):
            _handshake(server.port, "10.231.0.2", certs / "ca.crt")  # the check has teeth
    finally:
        server.close()
    sans = x509.load_pem_x509_certificate((certs / "server.pem").read_bytes()).extensions
    ips = sans.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.IPAddress)
    assert sorted(str(ip) for ip in ips) == ["10.231.0.1", "127.0.0.1", "::1"]


def test_credentials_rerun_on_old_credentials_says_how_to_renew(tmp_path: Path, monkeypatch, capsys) -> None:
    """Old credentials (the guide's ``--hosts $SERVER localhost``): re-running names the fix; the fix keeps the keys."""
    import shlex

    from dpfedavg.deploy.__main__ import main

    out = tmp_path / "creds"
    _old_style_credentials(out, ["10.231.0.1", "localhost"], monkeypatch)
    kept = {p: p.read_bytes() for p in [*(out / "keys").iterdir(), out / "certificates" / "ca.crt"]}
    args = ["credentials", "--out", str(out), "--hosts", "10.231.0.1", "--supernodes", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "127.0.0.1" in err and "::1" in err and "SuperExec" in err, err
    (fix,) = [line for line in err.splitlines() if "--renew-server-certificate" in line]
    words = shlex.split(fix)
    assert words[:3] == ["python", "-m", "dpfedavg.deploy"], words
    assert main(words[3:]) == 0
    assert {p: p.read_bytes() for p in kept} == kept  # the CA and every SuperNode key are unchanged
    certs = out / "certificates"
    server = _TlsServer(certs / "server.pem", certs / "server.key")
    try:
        _handshake(server.port, "127.0.0.1", certs / "ca.crt")
    finally:
        server.close()
    capsys.readouterr()
    assert main(args) == 0  # now they cover everything: pasting step 1 again changes nothing
    assert "left alone" in capsys.readouterr().out


def test_check_names_the_likely_cause(tmp_path: Path, monkeypatch) -> None:
    """Nothing listening, a certificate without 127.0.0.1 (a dead SuperExec), another CA, no SuperExec process."""
    from dpfedavg.deploy.check import NotReady, check_superlink
    from dpfedavg.deploy.credentials import generate_credentials

    old, new, other = tmp_path / "old", tmp_path / "new", tmp_path / "other"
    _old_style_credentials(old, ["10.231.0.1", "localhost"], monkeypatch)
    generate_credentials(new, ["10.231.0.1"], 0)
    generate_credentials(other, ["10.231.0.1"], 0)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(NotReady, match="nothing answers"):
        check_superlink(f"127.0.0.1:{closed}", new / "certificates" / "ca.crt", timeout=2)
    servers = {}
    try:
        for name, creds in (("old", old), ("new", new)):
            servers[name] = _TlsServer(creds / "certificates" / "server.pem", creds / "certificates" / "server.key")
        with pytest.raises(NotReady, match=r"not valid for 127\.0\.0\.1: its built-in SuperExec"):
            check_superlink(f"localhost:{servers['old'].port}", old / "certificates" / "ca.crt")
        with pytest.raises(NotReady, match="does not accept"):
            check_superlink(f"127.0.0.1:{servers['new'].port}", other / "certificates" / "ca.crt")
        with pytest.raises(NotReady, match="no flower-superexec process"):
            check_superlink(f"127.0.0.1:{servers['new'].port}", new / "certificates" / "ca.crt")
    finally:
        for server in servers.values():
            server.close()
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        check_superlink("127.0.0.1", new / "certificates" / "ca.crt")
