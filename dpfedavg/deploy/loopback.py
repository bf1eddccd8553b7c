"""A real deployment on one machine: a SuperLink with TLS and SuperNode authentication, and N SuperNodes.

Everything is a separate process on 127.0.0.1, started exactly as on separate
machines (see the documentation's "Deploy on N machines"): ``flower-superlink``
with the generated TLS certificate and ``--enable-supernode-auth``, each
SuperNode's public key registered with ``flwr supernode register``, then
``flower-supernode --root-certificates ... --auth-supernode-private-key ...
--node-config "partition-id=I num-partitions=N"`` per client and
``flwr run . remote``. It uses its own ``FLWR_HOME`` (holding the ``remote``
SuperLink connection) and free ports, and stops every process it started by
PID, including on failure (use it as a context manager). With
``approved_app_hashes`` the SuperNodes are started as the documentation's
step 5 does, through ``python -m dpfedavg.deploy supernode --approved-app-hash
...`` (they refuse every other app; see `dpfedavg.deploy.approval`).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from dpfedavg.deploy.credentials import Credentials, generate_credentials, generate_supernode_key
from dpfedavg.engines.local_superlink import (
    StartupTimeout,
    copy_app,
    free_port,
    leftover_pids,
    processes_with_home,
    retry_startup_once,
    scripts_first_path,
    stop_processes,
)

if TYPE_CHECKING:
    from dpfedavg.deploy.netns import NetnsHosts

__all__ = ["LoopbackFederation"]

BIN = Path(sys.executable).parent
CONNECTION = "remote"


def _wait_for_port(
    port: int, timeout: float, proc: subprocess.Popen, log: Path, host: str = "127.0.0.1", prefix: Sequence[str] = ()
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}; see {log}")
        if prefix:  # another host's port: probe from inside its namespace
            probe = [*prefix, "bash", "-c", f"exec 3<>/dev/tcp/{host}/{port}"]
            if subprocess.run(probe, capture_output=True, timeout=10).returncode == 0:
                return
            time.sleep(0.2)
            continue
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise StartupTimeout(f"nothing listened on port {port} within {timeout:g}s; see {log}")


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and its descendants, as if its machine lost power."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=10)


class LoopbackFederation:
    """SuperLink + ``num_supernodes`` SuperNodes on loopback, with TLS and SuperNode authentication.

    Parameters
    ----------
    workdir:
        Where credentials, logs, ``FLWR_HOME`` and the SuperLink database go.
    num_supernodes:
        SuperNodes to start (partition ids ``0..N-1``, ``num-partitions = N``).
    approved_app_hashes:
        If given, every SuperNode runs only apps with one of these app hashes.
    hosts:
        Simulated hosts (`dpfedavg.deploy.netns.NetnsHosts`) with one named ``superlink`` (the SuperLink, its
        ServerApp and the ``flwr`` CLI) and ``node-I`` per SuperNode; ``None``: everything on 127.0.0.1.
    node_config:
        Extra ``--node-config`` entries for every SuperNode (``{i}`` is its partition id), e.g. a ledger path.
    superlink_via:
        The address SuperNodes dial instead of the SuperLink's (a `dpfedavg.deploy.netns.DelayProxy`'s host).
    database:
        The SuperLink's ``--database``: default ``<workdir>/state.db``, which a restarted SuperLink reads.
    max_retries:
        Each SuperNode's ``--max-retries`` (reconnections to its SuperLink before it gives up).
    """

    def __init__(
        self,
        workdir: Path,
        num_supernodes: int,
        approved_app_hashes: Sequence[str] = (),
        *,
        hosts: NetnsHosts | None = None,
        node_config: str = "",
        superlink_via: str | None = None,
        database: str | None = None,
        max_retries: int = 3,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.num_supernodes = num_supernodes
        self.approved_app_hashes = tuple(approved_app_hashes)
        self.hosts, self.node_config, self.superlink_via = hosts, node_config, superlink_via
        self.address = hosts.address("superlink") if hosts is not None else "127.0.0.1"
        self.database = database or str(self.workdir / "state.db")
        self.max_retries = max_retries
        self.home = self.workdir / "flwr_home"
        self.home.mkdir(exist_ok=True)
        #: Flower 1.41 serves the Fleet, Control and Runtime APIs on one HTTPS port.
        self.port = free_port()
        self.env = dict(os.environ)
        self.env.update(
            FLWR_HOME=str(self.home),
            FLWR_TELEMETRY_ENABLED="0",
            FLWR_DISABLE_UPDATE_CHECK="1",
            FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
            PYTHONUNBUFFERED="1",  # logs reach the files as they happen (run() watches them)
            PATH=scripts_first_path(),
        )
        self.creds: Credentials | None = None
        self.superlink: subprocess.Popen | None = None
        self._known_superlink_command: list[str] = []
        self.supernodes: dict[int, subprocess.Popen] = {}
        self.node_ids: dict[int, int] = {}  # partition id -> node id given at registration
        self._known: dict[int, psutil.Process] = {}
        self._runs = 0

    # ---------------------------------------------------------------- helpers
    def _log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def _prefix(self, name: str) -> list[str]:
        """The command prefix that runs ``name``'s process on its host (none on loopback)."""
        if self.hosts is None:
            return []
        return self.hosts.prefix(name if name.startswith("node-") else "superlink")

    def _spawn(self, name: str, command: list[str], host: str | None = None) -> subprocess.Popen:
        log = self._log(name).open("a")  # a restarted process appends to its log
        proc = subprocess.Popen(
            [*self._prefix(host or name), *command], env=self.env, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._known[proc.pid] = psutil.Process(proc.pid)
        return proc

    def _remember_descendants(self) -> None:
        for proc in list(self._known.values()):
            try:
                for child in proc.children(recursive=True):
                    self._known[child.pid] = child
            except psutil.Error:
                pass

    def flwr(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run the ``flwr`` CLI against this federation's ``FLWR_HOME``."""
        return subprocess.run(
            [*self._prefix("superlink"), str(BIN / "flwr"), *args], env=self.env, cwd=self.workdir, capture_output=True, text=True, timeout=timeout
        )

    # ------------------------------------------------------------------ start
    def start(self, timeout: float = 60.0) -> None:
        """Credentials, the SuperLink, key registration and the SuperNodes."""
        names = ["127.0.0.1", "localhost", self.address] + ([self.superlink_via] if self.superlink_via else [])
        self.creds = generate_credentials(self.workdir / "creds", sorted(set(names)), self.num_supernodes)
        retry_startup_once(lambda: self._start_superlink(timeout), "the SuperLink", before_retry=self._stop_superlink)
        for i in range(self.num_supernodes):
            self.node_ids[i] = self.register(self.creds.public_key(i))
        for i in range(self.num_supernodes):
            self.supernodes[i] = self.start_supernode(i, self.creds.supernode_keys[i])

    def _start_superlink(self, timeout: float) -> None:
        """The SuperLink on ``self.port`` with TLS and SuperNode authentication, and the ``remote`` connection."""
        assert self.creds is not None
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{self.address}:{self.port}"\nroot-certificates = "{self.creds.ca_cert}"\n'
        )
        self._known_superlink_command = [
                str(BIN / "flower-superlink"),
                "--ssl-ca-certfile", str(self.creds.ca_cert),
                "--ssl-certfile", str(self.creds.server_cert),
                "--ssl-keyfile", str(self.creds.server_key),
                "--enable-supernode-auth",
                "--host", self.address,
                "--port", str(self.port),
                "--database", self.database,
        ]  # fmt: skip
        self.superlink = self._spawn("superlink", self._known_superlink_command)
        _wait_for_port(
            self.port, timeout, self.superlink, self._log("superlink"), self.address, self._prefix("superlink")
        )

    def _stop_superlink(self) -> None:
        """Stop a SuperLink that did not start in time and pick a new port (a fresh database) for the next."""
        if self.superlink is not None:
            self._remember_descendants()
            stop_processes({pid: p for pid, p in self._known.items() if p.is_running()})
        if not self.database.startswith(":"):  # not an in-memory state
            Path(self.database).unlink(missing_ok=True)
        self.port = free_port()

    def kill_superlink(self) -> None:
        """SIGKILL the SuperLink and everything it started (its SuperExec, the ServerApp), as a crashed host."""
        assert self.superlink is not None
        _kill_tree(self.superlink)

    def restart_superlink(self, timeout: float = 60.0) -> None:
        """Start the SuperLink again on its port and database (the registered keys and runs are in it)."""
        self.superlink = self._spawn("superlink", self._known_superlink_command)
        _wait_for_port(
            self.port, timeout, self.superlink, self._log("superlink"), self.address, self._prefix("superlink")
        )

    def serverapp_pids(self) -> list[int]:
        """The running ServerApp processes (``flwr-serverapp``) of this federation."""
        self._remember_descendants()
        pids = []
        for pid, proc in list(self._known.items()):
            try:
                if proc.is_running() and any("flwr-serverapp" in part for part in proc.cmdline()[:2]):
                    pids.append(pid)
            except psutil.Error:
                pass
        return pids

    def kill_serverapp(self) -> int:
        """SIGKILL the running ServerApp (the SuperLink stays up); returns how many were killed."""
        pids = self.serverapp_pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def register(self, public_key: Path) -> int:
        """``flwr supernode register <key> remote``; returns the node id the SuperLink assigned."""
        result = self.flwr("supernode", "register", str(public_key), CONNECTION)
        match = re.search(r"SuperNode (\d+) registered", result.stdout + result.stderr)
        if result.returncode != 0 or not match:
            raise RuntimeError(f"flwr supernode register failed:\n{result.stdout}\n{result.stderr}")
        return int(match.group(1))

    def start_supernode(self, partition_id: int, private_key: Path, name: str | None = None) -> subprocess.Popen:
        """One ``flower-supernode`` with TLS, its authentication key and its partition."""
        assert self.creds is not None
        launcher = [str(BIN / "flower-supernode")]
        if self.approved_app_hashes:
            launcher = [sys.executable, "-m", "dpfedavg.deploy", "supernode"]
            for app_hash in self.approved_app_hashes:
                launcher += ["--approved-app-hash", app_hash]
        return self._spawn(
            name or f"supernode-{partition_id}",
            [
                *launcher,
                "--root-certificates", str(self.creds.ca_cert),
                "--superlink", f"{self.superlink_via or self.address}:{self.port}",
                "--auth-supernode-private-key", str(private_key),
                "--node-config", f"partition-id={partition_id} num-partitions={self.num_supernodes} "
                + self.node_config.format(i=partition_id),
                "--host", "127.0.0.1",
                "--port", str(free_port()),
                "--max-retries", str(self.max_retries),
            ],
            host=f"node-{partition_id}",
        )  # fmt: skip

    def unauthorized_supernode(self) -> subprocess.Popen:
        """A SuperNode whose (freshly generated) key was never registered: the SuperLink must refuse it."""
        key = generate_supernode_key(self.workdir / "creds" / "keys" / "unregistered")
        return self.start_supernode(0, key, name="supernode-unregistered")

    # -------------------------------------------------------------------- run
    def run(
        self, run_config: str, timeout: float = 600.0, on_poll=None, app: Path | None = None
    ) -> subprocess.CompletedProcess:
        """``flwr run <app> remote --stream --run-config ...``; ``on_poll(log_text)`` is called every 0.5 s.

        ``app`` is the app folder the SuperLink ships to the SuperNodes (default: dpfedavg's own app, copied
        without the checkout's ``.venv`` by `copy_app()`; the FAB holds the same files).
        """
        if app is None:
            app = copy_app(self.workdir / "app")
        self._runs += 1
        log_path = self._log(f"flwr-run-{self._runs}")
        command = [
            *self._prefix("superlink"), str(BIN / "flwr"), "run", str(app), CONNECTION, "--stream",
            "--run-config", run_config,
        ]  # fmt: skip
        with log_path.open("w") as log:
            proc = subprocess.Popen(command, env=self.env, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + timeout
            try:
                while proc.poll() is None:
                    self._remember_descendants()
                    if on_poll is not None:  # it may raise to stop waiting (a fault test that killed the run)
                        on_poll(log_path.read_text(errors="replace"))
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"flwr run did not finish in {timeout}s:\n{log_path.read_text()[-5000:]}")
                    time.sleep(0.5)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        return subprocess.CompletedProcess(command, proc.returncode, log_path.read_text(errors="replace"), "")

    def kill_supernode(self, partition_id: int) -> None:
        """SIGKILL one SuperNode and its children, as if its machine lost power."""
        _kill_tree(self.supernodes[partition_id])

    def restart_supernode(self, partition_id: int) -> subprocess.Popen:
        """Start SuperNode ``partition_id`` again with its key (after `kill_supernode()`)."""
        assert self.creds is not None
        self.supernodes[partition_id] = self.start_supernode(partition_id, self.creds.supernode_keys[partition_id])
        return self.supernodes[partition_id]

    # ------------------------------------------------------------------- stop
    def stop(self) -> None:
        """Terminate every process this federation started (by PID), then kill what is left."""
        self._remember_descendants()
        self._known.update(processes_with_home(self.home))
        stop_processes(self._known)

    def leftover_pids(self) -> list[int]:
        return leftover_pids({**self._known, **processes_with_home(self.home)})

    def __enter__(self) -> LoopbackFederation:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
