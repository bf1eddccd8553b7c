"""An in-process Flower Grid: run a strategy against real ClientApps without Ray.

`InProcessGrid` implements the part of `flwr.serverapp.Grid`
that ``Strategy.start`` uses (``get_node_ids`` and ``send_and_receive``) by
calling a ClientApp (or any ``(Message, Context) -> Message | None``
callable) directly, one node after the other. Message contents are
deep-copied on the way in and out, as serialization would. It exists so that
strategies can be tested in isolation, quickly and deterministically:

>>> from dpfedavg.flower.client_app import app as client_app
>>> grid = InProcessGrid(client_app, num_nodes=10, run_config={...})  # doctest: +SKIP
>>> strategy.start(grid=grid, initial_arrays=...)  # doctest: +SKIP

A client callable that raises produces an error reply (as in Flower); one that
returns ``None`` produces no reply at all (a dropout).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import numpy as np
from flwr.app import Context, Message, RecordDict
from flwr.app.error import Error
from flwr.serverapp import Grid

__all__ = ["InProcessGrid", "ensure_task_identity"]

ClientFn = Callable[[Message, Context], "Message | None"]

#: Flower's node id of the SuperLink (``flwr.common.constant.SUPERLINK_NODE_ID``).
_SUPERLINK_NODE_ID = 1


def ensure_task_identity(run_id: int = 1) -> None:
    """Set Flower's process-wide task identity if unset (needed to create Messages outside a run)."""
    from flwr.supercore.task_identity import TaskIdentity

    if TaskIdentity._run_id is None:  # noqa: SLF001 - Flower offers no public check
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = _SUPERLINK_NODE_ID
        TaskIdentity.task_id = 1


class InProcessGrid(Grid):
    """A Grid whose SuperNodes are in-process calls of ``client_fn``.

    Parameters
    ----------
    client_fn:
        Usually `dpfedavg.flower.client_app.app`; any ``(Message, Context) -> Message | None``.
    num_nodes:
        Number of SuperNodes; node ``j`` gets ``partition-id`` ``partition_ids[j]``.
    run_config:
        The run config every node's Context carries.
    partition_ids:
        Defaults to ``0..num_nodes-1``; node ids are random (as in Flower) so
        that code cannot rely on node id order.
    seed:
        Seeds the node ids and the reply order.
    shuffle_replies:
        Return replies in random order, as a real SuperLink may.
    enforce_timeout:
        Run the clients of a ``send_and_receive`` call concurrently in threads
        and drop the replies that are not there within its ``timeout``, as a
        SuperLink does (a client that hangs becomes a dropout). Off by default:
        clients then run one after the other and every reply arrives.
    """

    def __init__(
        self,
        client_fn: ClientFn,
        num_nodes: int,
        run_config: Mapping[str, Any],
        *,
        partition_ids: list[int] | None = None,
        num_partitions: int | None = None,
        seed: int = 0,
        shuffle_replies: bool = True,
        enforce_timeout: bool = False,
        node_config: Mapping[str, Any] | None = None,
    ) -> None:
        ensure_task_identity()
        self._enforce_timeout = enforce_timeout
        self._client_fn = client_fn
        self._rng = np.random.default_rng(seed)
        self._shuffle = shuffle_replies
        pids = list(range(num_nodes)) if partition_ids is None else list(partition_ids)
        ids = self._rng.choice(2**62, size=len(pids), replace=False) + 2
        num_partitions = num_nodes if num_partitions is None else num_partitions
        self.contexts: dict[int, Context] = {
            int(nid): Context(
                run_id=1,
                node_id=int(nid),
                node_config={"partition-id": pid, "num-partitions": num_partitions, **(node_config or {})},
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for nid, pid in zip(ids, pids, strict=True)
        }
        #: Every message the server sent and every reply it received (for tests that check what it saw).
        self.sent: list[Message] = []
        self.received: list[Message] = []
        self._mailbox: dict[str, Message] = {}

    # -- the part Strategy.start uses -------------------------------------
    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        self.sent.extend(messages)
        if self._enforce_timeout and timeout is not None and messages:
            pool = ThreadPoolExecutor(max_workers=min(32, len(messages)), thread_name_prefix="in-process-node")
            futures = [pool.submit(self._call, msg) for msg in messages]
            done, _ = wait(futures, timeout=timeout)
            pool.shutdown(wait=False, cancel_futures=True)  # late clients are abandoned: dropouts
            outcomes = [f.result() for f in futures if f in done]
        else:
            outcomes = [self._call(msg) for msg in messages]
        replies = [reply for reply in outcomes if reply is not None]
        if self._shuffle:
            order = self._rng.permutation(len(replies))
            replies = [replies[i] for i in order]
        self.received.extend(replies)
        return replies

    def _call(self, msg: Message) -> Message | None:
        context = self.contexts[msg.metadata.dst_node_id]
        incoming = _copy_message(msg)
        try:
            reply = self._client_fn(incoming, context)
        except Exception as err:  # noqa: BLE001 - Flower turns ClientApp exceptions into error replies
            reply = Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=incoming)
        return None if reply is None else _copy_message(reply)

    # -- unused by Strategy.start ------------------------------------------
    @property
    def run(self) -> Any:  # pragma: no cover - not used by strategies
        raise NotImplementedError

    def set_run(self, run_id: int) -> None:  # pragma: no cover
        raise NotImplementedError

    def create_message(self, *args: Any, **kwargs: Any) -> Message:  # pragma: no cover
        raise NotImplementedError

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver each message now (the client runs at once); its reply waits for `pull_messages()`."""
        ids = []
        for msg in messages:
            message_id = uuid.uuid4().hex
            msg.metadata.__dict__["_message_id"] = message_id  # as Flower's grids assign it
            self.sent.append(msg)
            reply = self._call(msg)
            if reply is not None:
                self._mailbox[message_id] = reply
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies that arrived for ``message_ids`` (each is returned once)."""
        replies = [self._mailbox.pop(mid) for mid in list(message_ids) if mid in self._mailbox]
        self.received.extend(replies)
        return replies


def _copy_message(msg: Message) -> Message:
    """A copy with independent content, as if serialized and deserialized."""
    if msg.has_error():
        return Message(msg.error, metadata=copy.copy(msg.metadata))
    return Message(copy.deepcopy(msg.content), metadata=copy.copy(msg.metadata))


def superlink_unavailable_reply(msg: Message) -> Message:
    """The error reply Flower's SuperLink sends for ``msg`` when its node went offline.

    Built by Flower's own function, so it comes from the SuperLink's id (not the node's) and only
    ``reply_to_message_id`` links it to ``msg``: what a deployed run receives (issue 19's regression).
    """
    from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

    return create_message_error_unavailable_res_message(msg.metadata, "node_unavail")
