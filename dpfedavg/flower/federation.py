"""Which SuperNode hosts which clients: discovery of the federation before round 1, and nodes that reconnect.

Sampling is over client ids ``0..n-1``, the ids the batched engine and the
reference implementation use; Flower addresses nodes by node id. Each
SuperNode reports its ``partition-id`` p (from its ``--node-config``; Flower's
simulation numbers its SuperNodes ``0..num-supernodes-1``) and hosts the
clients ``p m .. p m + m - 1`` with ``m = clients-per-node``: one client, its
own, in a deployment (``m = 1``: client id = partition id), a block of virtual
clients in a simulation. `Federation` keeps the maps between partition
ids and node ids, and groups a round's sampled clients by node.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from dpfedavg.config import RunConfig
from dpfedavg.flower.protocol import CONFIG, METRICS, NUM_PARTITIONS, PARTITION_ID, QUERY

__all__ = ["Federation", "FederationError"]

logger = logging.getLogger(__name__)

#: A node whose heartbeat interval is at least this never sends heartbeats: Flower's simulation registers its
#: ``num-supernodes`` nodes so (``HEARTBEAT_INTERVAL_INF``, 1e300), all at once, before Ray starts; a deployed
#: SuperNode has a finite interval and may connect at any time within ``node-wait-timeout``.
SIMULATED_HEARTBEAT_S = 1e299
#: Seconds the node count of a simulation must stay the same (polled every `SETTLE_POLL_S`) before a count below
#: the run's is taken as the federation's size (Flower registers the nodes in one loop, well under this).
SETTLE_S = 2.0
SETTLE_POLL_S = 0.2


def simulated_node_count(grid: Grid) -> int | None:
    """The number of nodes on ``grid`` if they are all simulated (`SIMULATED_HEARTBEAT_S`), else None.

    ``Grid.get_nodes()`` is Flower's public API; a Grid that reports no heartbeat intervals (0.0, the default)
    is never taken for a simulation.
    """
    nodes = list(grid.get_nodes())
    if nodes and all(info.heartbeat_interval >= SIMULATED_HEARTBEAT_S for info in nodes):
        return len(nodes)
    return None


def registration_order(grid: Grid, node_ids: list[int]) -> list[int]:
    """``node_ids`` in the order the SuperNodes registered (``Grid.get_nodes``' ``registered_at``), then by id.

    Only a delivery-speed choice, never a mapping: partition ids come from the nodes' replies. Flower's
    simulation delivers by sweeping its nodes in registration order and looking each one's message up
    in the stored messages, in the order they were pushed, so queries pushed in the sweep's order are
    found at the front (the handshake with one SuperNode per client drops from O(n^2) message checks to
    about O(n x messages in flight)); deployed SuperNodes pull their own messages and do not care.
    """
    registered = {info.node_id: info.registered_at for info in grid.get_nodes()}
    return sorted(node_ids, key=lambda nid: (registered.get(nid, ""), nid))


class FederationError(RuntimeError):
    """The connected SuperNodes do not match the run (count, partition ids)."""


class Federation:
    """The maps between partition ids (blocks of ``clients-per-node`` clients) and Flower node ids.

    Parameters
    ----------
    cfg:
        The run configuration (``num-clients``, ``clients-per-node``, ``node-wait-timeout``).
    sleep:
        Injected for tests: how to wait between polls of the Grid.
    """

    def __init__(self, cfg: RunConfig, sleep: Callable[[float], None] = time.sleep) -> None:
        self.cfg = cfg
        self._sleep = sleep
        #: Clients per SuperNode (``clients-per-node``) and the number of SuperNodes, ``ceil(n / m)``.
        self.clients_per_node, self.num_nodes = cfg.clients_per_node, cfg.num_nodes
        #: partition id -> Flower node id.
        self.node_of_partition: dict[int, int] = {}
        #: Flower node id -> partition id.
        self.partition_of_node: dict[int, int] = {}
        #: Wall seconds spent waiting for the SuperNodes and learning their partition ids.
        self.discovery_seconds: float | None = None

    @property
    def node_of_client(self) -> dict[int, int]:
        """Client id -> Flower node id (empty before discovery)."""
        if not self.node_of_partition:
            return {}
        m = self.clients_per_node
        return {c: self.node_of_partition[c // m] for c in range(self.cfg.num_clients)}

    def node_of(self, client_id: int) -> int:
        """The Flower node id hosting ``client_id``."""
        return self.node_of_partition[client_id // self.clients_per_node]

    def group_by_node(self, clients: Iterable[int], online: set[int]) -> tuple[dict[int, list[int]], list[int]]:
        """``(node id -> its sampled clients ascending, for connected nodes; the clients of offline nodes)``."""
        by_node: dict[int, list[int]] = {}
        offline: list[int] = []
        for c in sorted(int(c) for c in clients):
            node = self.node_of(c)
            if node in online:
                by_node.setdefault(node, []).append(c)
            else:
                offline.append(c)
        return by_node, offline

    def connected_clients(self, grid: Grid) -> list[int]:
        """The clients whose SuperNode is connected now (new nodes are mapped first), ascending."""
        online = set(grid.get_node_ids())
        if online - set(self.partition_of_node):
            self.learn_new_nodes(grid, sorted(online - set(self.partition_of_node)))
        return sorted(c for c, node in self.node_of_client.items() if node in online)

    def _size_hint(self) -> str:
        n, m, nodes = self.cfg.num_clients, self.clients_per_node, self.num_nodes
        if m == 1:
            return (
                f'start it with --federation-config "num-supernodes={n}" (simulation) '
                f'or give every SuperNode --node-config "partition-id=I num-partitions={n}" (deployment)'
            )
        return (
            f"num-clients={n} with clients-per-node={m} needs {nodes} SuperNodes: start it with --federation-config "
            f'"num-supernodes={nodes}", or set clients-per-node so that ceil(num-clients / clients-per-node) '
            "is the number of SuperNodes"
        )

    def discover(self, grid: Grid, timeout: float | None = None) -> dict[int, int]:
        """Wait for all ``ceil(n / m)`` SuperNodes and learn each one's ``partition-id``; returns partition -> node.

        Sampling is over client ids, the same ids the batched engine and the
        reference implementation use, so the node hosting each client must be
        known before round 1. One node is asked first so that a federation of
        the wrong size fails fast instead of waiting out the timeout. The cost
        is one QUERY message per SuperNode: with virtual clients (``m > 1``)
        ``m`` times fewer than one per client.

        Raises
        ------
        FederationError
            Wrong number of SuperNodes, missing/duplicate partition ids, or not
            all nodes registered within ``timeout`` seconds.
        """
        started = time.perf_counter()
        n = self.num_nodes
        timeout = self.cfg.node_wait_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        node_ids = self._wait_for_nodes(grid, 1, deadline)
        self.check_simulation_size(grid)
        first = self._query_partitions(grid, node_ids[:1], deadline)
        ((pid, num_partitions),) = first.values()
        if num_partitions != n:
            raise FederationError(
                f"the federation has num-partitions={num_partitions} SuperNodes but the run needs {n}; "
                + self._size_hint()
            )
        node_ids = self._wait_for_nodes(grid, n, deadline)
        if len(node_ids) > n:
            raise FederationError(
                f"{len(node_ids)} SuperNodes are connected but the run needs {n}; " + self._size_hint()
            )
        replies = self._query_partitions(grid, node_ids, deadline)
        mapping: dict[int, int] = {}
        for node_id, (pid, num_partitions) in replies.items():
            if num_partitions != n or not 0 <= pid < n:
                raise FederationError(
                    f"node {node_id} reports partition-id={pid}, num-partitions={num_partitions}; "
                    f"expected 0 <= partition-id < {n} and num-partitions={n}; " + self._size_hint()
                )
            if pid in mapping:
                raise FederationError(f"partition-id={pid} is reported by two nodes ({mapping[pid]} and {node_id})")
            mapping[pid] = node_id
        missing = sorted(set(range(n)) - set(mapping))
        if missing:
            raise FederationError(
                f"no node answered for partition ids {missing[:10]}{'...' if len(missing) > 10 else ''}"
            )
        self.node_of_partition = mapping
        self.partition_of_node = {node: pid for pid, node in mapping.items()}
        self.discovery_seconds = time.perf_counter() - started
        if self.clients_per_node == 1:
            logger.info("All %d clients registered (partition ids 0..%d) in %.1f s", n, n - 1, self.discovery_seconds)
        else:
            logger.info(
                "All %d clients registered on %d SuperNodes (%d clients per node) in %.1f s",
                self.cfg.num_clients,
                n,
                self.clients_per_node,
                self.discovery_seconds,
            )
        return mapping

    def check_simulation_size(self, grid: Grid, first_node_wait: float = 0.0) -> None:
        """In a simulation, the federation's size before any node is asked (before anything is written).

        Flower's simulation registers all its SuperNodes at once, before it starts the ClientApps (and Ray, which
        starts alongside the ServerApp); the count, once it stays the same for `SETTLE_S` (more nodes than the run
        needs: at once), is ``num-supernodes``. The right count costs no wait; a wrong one is one
        `FederationError` now instead of after Ray's start-up and the first node's answer. A deployment (or no
        node within ``first_node_wait`` seconds) is left to `discover()`: its SuperNodes may join later.
        """
        count, waited = simulated_node_count(grid), 0.0
        while count is None and waited < first_node_wait and not list(grid.get_node_ids()):
            self._sleep(SETTLE_POLL_S)
            waited += SETTLE_POLL_S
            count = simulated_node_count(grid)
        if count is None or count == self.num_nodes:
            return
        stable = 0  # polls with the same count
        while count < self.num_nodes and stable < round(SETTLE_S / SETTLE_POLL_S):  # too few: unless still registering
            self._sleep(SETTLE_POLL_S)
            now = simulated_node_count(grid)
            if now is None:
                return
            stable, count = (stable + 1 if now == count else 0), now
        if count == self.num_nodes:
            return
        n, m, nodes = self.cfg.num_clients, self.clients_per_node, self.num_nodes
        raise FederationError(
            f"the simulation has num-supernodes={count} but num-clients={n} with clients-per-node={m} needs "
            f"ceil({n} / {m}) = {nodes} SuperNodes: start it with --federation-config \"num-supernodes={nodes}\""
            f", or set clients-per-node so that ceil(num-clients / clients-per-node) is {count}"
        )

    def _wait_for_nodes(self, grid: Grid, count: int, deadline: float) -> list[int]:
        last_log = 0.0
        while True:
            node_ids = sorted(grid.get_node_ids())
            if len(node_ids) >= count:
                return node_ids
            now = time.monotonic()
            if now > deadline:
                raise FederationError(
                    f"only {len(node_ids)} of {count} SuperNodes registered within "
                    f"node-wait-timeout={self.cfg.node_wait_timeout:g}s"
                )
            if now - last_log > 5.0:
                logger.info("Waiting for SuperNodes: %d of %d registered", len(node_ids), count)
                last_log = now
            self._sleep(0.2)

    def _query_partitions(self, grid: Grid, node_ids: list[int], deadline: float) -> dict[int, tuple[int, int]]:
        node_ids = registration_order(grid, node_ids)
        messages = [
            Message(
                content=RecordDict({CONFIG: ConfigRecord(dict([QUERY]))}),
                message_type=MessageType.QUERY,
                dst_node_id=nid,
            )
            for nid in node_ids
        ]
        out: dict[int, tuple[int, int]] = {}
        for reply in grid.send_and_receive(messages, timeout=max(1.0, deadline - time.monotonic())):
            src = reply.metadata.src_node_id
            if reply.has_error():
                raise FederationError(f"node {src} failed to report its partition id: {reply.error.reason}")
            metrics = reply.content[METRICS]
            out[src] = (int(metrics[PARTITION_ID]), int(metrics[NUM_PARTITIONS]))
        if len(out) < len(node_ids):
            raise FederationError(f"only {len(out)} of {len(node_ids)} SuperNodes answered the partition-id query")
        return out

    def learn_new_nodes(self, grid: Grid, node_ids: list[int]) -> None:
        """Map SuperNodes that connected after discovery (e.g. a client that restarted with a new node id)."""
        try:
            replies = self._query_partitions(grid, node_ids, time.monotonic() + min(30.0, self.cfg.node_wait_timeout))
        except FederationError as err:
            logger.warning("new SuperNodes %s did not report a partition id: %s", node_ids[:5], err)
            return
        for node_id, (pid, num_partitions) in replies.items():
            if num_partitions != self.num_nodes or not 0 <= pid < self.num_nodes:
                logger.warning("ignoring node %d: partition-id=%d, num-partitions=%d", node_id, pid, num_partitions)
                continue
            old = self.node_of_partition.get(pid)
            self.node_of_partition[pid] = node_id
            self.partition_of_node.pop(old, None)  # type: ignore[arg-type]
            self.partition_of_node[node_id] = pid
            logger.info("partition %d is now node %d (was %s)", pid, node_id, old)
