"""The fault tests' network tools (`dpfedavg.deploy.netns`) without namespaces: cheap, in the default suite.

`DelayProxy` relays a byte stream unchanged in both directions, however many chunks it "loses" (above TCP a lost
segment is only a delay), and refuses a bad delay or loss; `NetnsHosts` refuses duplicate names and numbers its
hosts' addresses in order. The namespaces themselves are exercised by ``tests/test_faults.py`` (``-m faults``).
"""

from __future__ import annotations

import os
import socket
import threading

import pytest

from dpfedavg.deploy.netns import DelayProxy, NetnsHosts


def _echo_server() -> tuple[socket.socket, int]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


def test_the_proxy_relays_every_byte_in_order_both_ways() -> None:
    echo, echo_port = _echo_server()
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    # loss 0.5 with a fixed seed: about half of the chunks are held one retransmission timeout more
    proxy = DelayProxy(("127.0.0.1", port), ("127.0.0.1", echo_port), delay_s=0.0, loss=0.5, seed=3)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    payload = os.urandom(20_000)
    for _ in range(100):
        try:
            client = socket.create_connection(("127.0.0.1", port), timeout=5)
            break
        except ConnectionRefusedError:
            threading.Event().wait(0.05)
    with client:
        client.sendall(payload)
        received = b""
        while len(received) < len(payload):
            chunk = client.recv(65536)
            assert chunk, "the proxy closed the stream early"
            received += chunk
    echo.close()
    assert received == payload


@pytest.mark.parametrize(("delay", "loss"), [(-0.1, 0.0), (0.0, 1.0), (0.0, -0.5)])
def test_the_proxy_refuses_a_bad_delay_or_loss(delay: float, loss: float) -> None:
    with pytest.raises(ValueError, match="delay must be >= 0 and loss in"):
        DelayProxy(("127.0.0.1", 1), ("127.0.0.1", 2), delay, loss)


def test_hosts_are_distinct_and_numbered_in_order() -> None:
    hosts = NetnsHosts(["superlink", "node-0", "node-1"], subnet="10.201.7")
    assert [hosts.address(n) for n in hosts.names] == ["10.201.7.1", "10.201.7.2", "10.201.7.3"]
    assert hosts.prefix("node-1") == ["ip", "netns", "exec", f"{hosts.tag}-2"]
    with pytest.raises(ValueError, match="distinct"):
        NetnsHosts(["a", "a"])
