"""Which SuperNode is which client: discovery of the federation before round 1, and nodes that reconnect.

Sampling is over client ids (``partition-id`` ``0..n-1``, from each SuperNode's
``--node-config``), the ids the batched engine and the reference
implementation use; Flower addresses nodes by node id. :class:`Federation`
keeps the two maps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from dpfedavg.config import RunConfig
from dpfedavg.protocol import CONFIG, METRICS, NUM_PARTITIONS, PARTITION_ID, QUERY

__all__ = ["Federation", "FederationError"]

logger = logging.getLogger(__name__)


class FederationError(RuntimeError):
    """The connected SuperNodes do not match the run (count, partition ids)."""


class Federation:
    """The map between client ids and Flower node ids.

    Parameters
    ----------
    cfg:
        The run configuration (``num-clients``, ``node-wait-timeout``).
    sleep:
        Injected for tests: how to wait between polls of the Grid.
    """

    def __init__(self, cfg: RunConfig, sleep: Callable[[float], None] = time.sleep) -> None:
        self.cfg = cfg
        self._sleep = sleep
        #: client id (partition-id) -> Flower node id.
        self.node_of_client: dict[int, int] = {}
        #: Flower node id -> client id.
        self.client_of_node: dict[int, int] = {}
        #: Wall seconds spent waiting for the SuperNodes and learning their partition ids.
        self.discovery_seconds: float | None = None

    def discover(self, grid: Grid, timeout: float | None = None) -> dict[int, int]:
        """Wait for all ``n`` SuperNodes and learn each one's ``partition-id``.

        Sampling is over client ids (partition ids ``0..n-1``), the same ids
        the batched engine and the reference implementation use, so a node's
        identity must be known before round 1. One node is asked first so that
        a federation of the wrong size fails fast instead of waiting out the
        timeout.

        Raises
        ------
        FederationError
            Wrong number of SuperNodes, missing/duplicate partition ids, or not
            all ``n`` nodes registered within ``timeout`` seconds.
        """
        started = time.perf_counter()
        n = self.cfg.num_clients
        timeout = self.cfg.node_wait_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        node_ids = self._wait_for_nodes(grid, 1, deadline)
        first = self._query_partitions(grid, node_ids[:1], deadline)
        ((pid, num_partitions),) = first.values()
        if num_partitions != n:
            raise FederationError(
                f"the federation has num-partitions={num_partitions} SuperNodes but the run has num-clients={n}; "
                f'start it with --federation-config "num-supernodes={n}" (simulation) '
                f'or give every SuperNode --node-config "partition-id=I num-partitions={n}" (deployment)'
            )
        node_ids = self._wait_for_nodes(grid, n, deadline)
        if len(node_ids) > n:
            raise FederationError(f"{len(node_ids)} SuperNodes are connected but num-clients={n}")
        replies = self._query_partitions(grid, node_ids, deadline)
        mapping: dict[int, int] = {}
        for node_id, (pid, num_partitions) in replies.items():
            if num_partitions != n or not 0 <= pid < n:
                raise FederationError(
                    f"node {node_id} reports partition-id={pid}, num-partitions={num_partitions}; "
                    f"expected 0 <= partition-id < {n} and num-partitions={n}"
                )
            if pid in mapping:
                raise FederationError(f"partition-id={pid} is reported by two nodes ({mapping[pid]} and {node_id})")
            mapping[pid] = node_id
        missing = sorted(set(range(n)) - set(mapping))
        if missing:
            raise FederationError(
                f"no node answered for partition ids {missing[:10]}{'...' if len(missing) > 10 else ''}"
            )
        self.node_of_client = mapping
        self.client_of_node = {node: pid for pid, node in mapping.items()}
        self.discovery_seconds = time.perf_counter() - started
        logger.info("All %d clients registered (partition ids 0..%d) in %.1f s", n, n - 1, self.discovery_seconds)
        return mapping

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
            if num_partitions != self.cfg.num_clients or not 0 <= pid < self.cfg.num_clients:
                logger.warning("ignoring node %d: partition-id=%d, num-partitions=%d", node_id, pid, num_partitions)
                continue
            old = self.node_of_client.get(pid)
            self.node_of_client[pid] = node_id
            self.client_of_node.pop(old, None)
            self.client_of_node[node_id] = pid
            logger.info("client %d is now node %d (was %s)", pid, node_id, old)
