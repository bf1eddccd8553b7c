"""Simulated hosts for deployment and fault tests: one Linux network namespace per host on a private bridge.

Each host is a namespace ``<tag>-<name>`` with its own loopback and one veth link (``eth0``, address
``10.<a>.<b>.<i>/24``) to a bridge that lives in the namespace ``<tag>-br``: hosts reach each other only by
their private addresses and nothing has a route out. `NetnsHosts.partition()` cuts a host off (its bridge
port down) and `NetnsHosts.heal()` reconnects it, a network partition without ``netem`` (this kernel has
none). `DelayProxy` stands in for a slow, lossy link: a TCP proxy that holds every chunk for a delay and,
with probability ``loss``, for one retransmission timeout more (what a lost packet costs a TCP stream).

Needs root and iproute2; `namespaces_unavailable()` says why not where they are missing.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Sequence

__all__ = ["DelayProxy", "NetnsHosts", "namespaces_unavailable"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or ``None``."""
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"dpfprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class NetnsHosts:
    """Hosts ``names`` on one private bridge (use as a context manager: every namespace is deleted on exit).

    ``subnet`` is the first three octets; host ``i`` (0-based, in the order given) gets ``<subnet>.<i + 1>``.
    """

    def __init__(self, names: Sequence[str], subnet: str | None = None) -> None:
        if len(names) > 250 or len(set(names)) != len(names):
            raise ValueError(f"hosts must be at most 250 distinct names, got {list(names)}")
        self.names = list(names)
        self.tag = f"dpf{uuid.uuid4().hex[:6]}"
        # a subnet of its own per instance (10.200-229.x.0/24: apart from tests/test_multihost.py's 10.231.0.0/24)
        self.subnet = subnet or f"10.{200 + int(self.tag[3:5], 16) % 30}.{int(self.tag[5:7], 16)}"
        self.made: list[str] = []

    def ns(self, name: str) -> str:
        return f"{self.tag}-{name}" if name == "br" else f"{self.tag}-{self.names.index(name)}"

    def address(self, name: str) -> str:
        return f"{self.subnet}.{self.names.index(name) + 1}"

    def prefix(self, name: str) -> list[str]:
        """The command prefix that runs a program on host ``name``."""
        return ["ip", "netns", "exec", self.ns(name)]

    def _port(self, name: str) -> str:
        return f"v{self.names.index(name)}"

    def create(self) -> None:
        bridge = self.ns("br")
        _ip("netns", "add", bridge)
        self.made.append(bridge)
        _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge, "link", "set", "br0", "up")
        for name in self.names:
            host, port = self.ns(name), self._port(name)
            _ip("netns", "add", host)
            self.made.append(host)
            _ip("-n", host, "link", "set", "lo", "up")
            _ip("-n", bridge, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", host)
            _ip("-n", bridge, "link", "set", port, "master", "br0")
            _ip("-n", bridge, "link", "set", port, "up")
            _ip("-n", host, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
            _ip("-n", host, "link", "set", "eth0", "up")

    def partition(self, name: str) -> None:
        """Cut host ``name`` off the network (its bridge port down; its own processes keep running)."""
        _ip("-n", self.ns("br"), "link", "set", self._port(name), "down")

    def heal(self, name: str) -> None:
        """Reconnect host ``name`` after `partition()`."""
        _ip("-n", self.ns("br"), "link", "set", self._port(name), "up")

    def delete(self) -> None:
        for name in reversed(self.made):
            _ip("netns", "del", name, check=False)
        self.made.clear()

    def left(self) -> list[str]:
        listing = _ip("netns", "list", check=False).stdout
        return [line.split()[0] for line in listing.splitlines() if line.startswith(self.tag)]

    def __enter__(self) -> NetnsHosts:
        try:
            self.create()
        except BaseException:
            self.delete()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()


#: What a lost segment costs a TCP stream: Linux's minimum retransmission timeout.
RTO_S = 0.2


class DelayProxy:
    """A TCP proxy ``listen -> target`` that delays every chunk by ``delay_s`` and, with probability ``loss``,
    by `RTO_S` more (a retransmitted segment). Run it in a thread of a process on the proxy's host
    (``python -m dpfedavg.deploy.netns proxy LISTEN_HOST:PORT TARGET_HOST:PORT DELAY LOSS SEED``).

    Bytes are never dropped or reordered: above TCP, loss is only delay.
    """

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay_s: float, loss: float, seed: int = 0):
        if delay_s < 0 or not 0 <= loss < 1:
            raise ValueError(f"delay must be >= 0 and loss in [0, 1), got delay={delay_s} loss={loss}")
        self.listen, self.target, self.delay_s, self.loss = listen, target, delay_s, loss
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def _hold(self) -> float:
        with self.lock:
            lost = self.rng.random() < self.loss
        return self.delay_s + (RTO_S if lost else 0.0)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                time.sleep(self._hold())
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve_forever(self) -> None:
        server = socket.create_server(self.listen, reuse_port=False)
        while True:
            client, _ = server.accept()
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 7 or sys.argv[1] != "proxy":
        sys.exit("usage: python -m dpfedavg.deploy.netns proxy LISTEN_HOST:PORT TARGET_HOST:PORT DELAY_S LOSS SEED")
    DelayProxy(
        _address(sys.argv[2]), _address(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
    ).serve_forever()
