"""A Ray cluster of real nodes on one machine: a head and N more nodes, each its own ``ray start``.

Started exactly as on separate machines (the documentation's "Ray cluster" how-to):
``ray start --head --port P --num-cpus 1 --block`` and, per extra node,
``ray start --address 127.0.0.1:P --num-cpus 1 --block``. Every node gets free
ports (no Ray default port is used, so other Ray instances on the machine are
not disturbed), its own short ``--temp-dir`` (where ``ray start`` also writes
the address file that ``ray.init()`` without an address would follow, so no
other user's Ray picks this cluster up) and usage stats off. `stop()`
stops every process a node started, by PID; `kill_node()` kills one node
(all its processes) at once, to test what a sweep does when a machine dies.
Used by the tests and ``benchmarks/bench_ray_sweep.py``; needs ``psutil``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from dpfedavg.engines.local_superlink import (
    RAY_STARTUP_ENV,
    StartupTimeout,
    free_port,
    kill_processes,
    leftover_pids,
    retry_startup_once,
    startup_failure,
    stop_processes,
)

__all__ = ["LoopbackRayCluster"]

BIN = Path(sys.executable).parent


class LoopbackRayCluster:
    """A head node and ``workers`` more nodes, ``num_cpus`` CPUs each, on 127.0.0.1."""

    def __init__(self, workers: int = 1, num_cpus: int = 1, extra_env: dict[str, str] | None = None) -> None:
        self.workers, self.num_cpus = workers, num_cpus
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.root = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))  # short: Ray's socket paths have a limit
        self.env = dict(os.environ)
        self.env.update(
            RAY_USAGE_STATS_ENABLED="0",
            RAY_TMPDIR=str(self.root),
            # a dead node is noticed in ~3 s instead of ~30 s
            RAY_health_check_period_ms="1000",
            RAY_health_check_timeout_ms="1000",
            RAY_health_check_failure_threshold="3",
            **{key: os.environ.get(key, value) for key, value in RAY_STARTUP_ENV.items()},
            **(extra_env or {}),
        )
        self.env.pop("RAY_ADDRESS", None)
        self.nodes: list[subprocess.Popen] = []
        self._known: dict[int, psutil.Process] = {}
        self._trees: dict[int, dict[int, psutil.Process]] = {}

    def _ports(self) -> list[str]:
        ports = {
            "--node-manager-port": free_port(),
            "--object-manager-port": free_port(),
            "--metrics-export-port": free_port(),
            "--dashboard-agent-listen-port": free_port(),
            "--dashboard-agent-grpc-port": free_port(),
            "--runtime-env-agent-port": free_port(),
        }
        return [f"{k}={v}" for k, v in ports.items()]

    def _start_node(self, index: int, head: bool, timeout: float) -> None:
        """``ray start`` for node ``index``; one that timed out starting (Ray's fixed 30 s) is started once more."""
        retry_startup_once(
            lambda: self._start_node_once(index, head, timeout), f"Ray node {index}", before_retry=self._drop_node
        )

    def _drop_node(self) -> None:
        """Stop the last node started (every process of it, by PID) and forget it, for a second start."""
        index = len(self.nodes) - 1
        self.remember()
        stop_processes(self._trees.pop(index))
        try:
            self.nodes.pop().wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if index == 0:  # the head: a new port, in case the first one's is still held
            self.port = free_port()
            self.address = f"127.0.0.1:{self.port}"

    def _start_node_once(self, index: int, head: bool, timeout: float) -> None:
        temp = self.root / f"n{index}"
        if temp.exists():  # a second start: a fresh folder
            temp = self.root / f"n{index}r"
        temp.mkdir()
        command = [str(BIN / "ray"), "start", "--block", f"--num-cpus={self.num_cpus}", "--num-gpus=0",
                   f"--temp-dir={temp}", "--disable-usage-stats", *self._ports()]  # fmt: skip
        if head:
            command += [
                "--head",
                f"--port={self.port}",
                "--include-dashboard=false",
                f"--ray-client-server-port={free_port()}",
            ]
        else:
            command += [f"--address={self.address}"]
        log = (self.root / f"node{index}.log").open("w")
        proc = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.nodes.append(proc)
        self._trees[index] = {}
        self._wait_nodes(index + 1, timeout, proc)

    def _wait_nodes(self, count: int, timeout: float, proc: subprocess.Popen) -> None:
        """Wait until the cluster has ``count`` alive nodes (asked through ``ray`` in a subprocess)."""
        probe = (
            "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False); "
            "print(sum(1 for n in ray.nodes() if n['Alive']))"
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.remember()
            if proc.poll() is not None:
                log = (self.root / f"node{count - 1}.log").read_text()[-3000:]
                error = StartupTimeout if startup_failure(log) else RuntimeError
                raise error(f"ray start exited with {proc.returncode}: {startup_failure(log) or ''}\n{log}")
            try:
                out = subprocess.run([sys.executable, "-c", probe, self.address], env=self.env, capture_output=True,
                                     text=True, timeout=30)  # fmt: skip
                if out.returncode == 0 and int(out.stdout.strip().splitlines()[-1]) >= count:
                    self.remember()
                    return
            except (subprocess.TimeoutExpired, ValueError, IndexError):
                pass
            time.sleep(1.0)
        log = (self.root / f"node{count - 1}.log").read_text()[-3000:]
        raise StartupTimeout(f"the Ray cluster did not reach {count} nodes within {timeout:g}s:\n{log}")

    def start(self, timeout: float = 90.0) -> LoopbackRayCluster:
        try:
            self._start_node(0, head=True, timeout=timeout)
            for i in range(1, self.workers + 1):
                self._start_node(i, head=False, timeout=timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def remember(self) -> None:
        """Record every process of every node (Ray's workers are children of the node's raylet)."""
        for index, proc in enumerate(self.nodes):
            try:
                root = psutil.Process(proc.pid)
                for p in [root, *root.children(recursive=True)]:
                    self._known[p.pid] = p
                    self._trees[index][p.pid] = p
            except psutil.NoSuchProcess:
                pass

    def node_pids(self, index: int) -> list[int]:
        self.remember()
        return sorted(self._trees[index])

    def kill_node(self, index: int) -> None:
        """SIGKILL every process of node ``index`` at once, as when its machine dies."""
        self.remember()
        kill_processes(list(self._trees[index].values()))

    def stop(self) -> None:
        """Stop every process the nodes started (by PID), workers first, then the head."""
        self.remember()
        for index in sorted(self._trees, reverse=True):
            stop_processes(self._trees[index])
        stop_processes(self._known)
        for proc in self.nodes:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.root, ignore_errors=True)

    def leftover_pids(self) -> list[int]:
        """PIDs of the cluster's processes that still run (should be empty after `stop()`)."""
        return leftover_pids(self._known)

    def __enter__(self) -> LoopbackRayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
