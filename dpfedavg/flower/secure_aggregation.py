"""One round of aggregation through Flower's SecAgg+ protocol (``secure-aggregation = true``).

Flower 1.41 ships SecAgg+ as `SecAggPlusWorkflow`,
written for the legacy ``Strategy`` API (``configure_fit`` /
``aggregate_fit``, a ``LegacyContext``). `secure_sum()` drives its four
stages for the clients our strategy has already Poisson-sampled, through a
one-round legacy adapter, and returns the *sum* of their encoded
``g~_i + zeta~_i`` and how many clients it contains. The cryptography
(key agreement, Shamir shares, masks) is Flower's; ours is only the
encoding (`dpfedavg.core.secagg`) and this glue.

What the server holds during a round: the clients' public keys, encrypted
key shares it forwards, each client's *masked* vector (uniform mod ``M`` to
anyone without the masks), which it adds up immediately, and the shares
needed to remove the masks from that sum. The workflow hands
``aggregate_fit`` the unmasked average; no individual update is ever
unmasked (``tests/test_secure_aggregation.py`` checks every array that
reaches the server).

Weights: every client reports ``num_examples = 1`` and ``max_weight = 1``,
so the workflow's "weighted average" is the plain average over the ``N``
clients that sent a masked vector; multiplying by ``N`` gives the sum
(Alg. 1 line 12 then divides by the fixed ``r``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.common import FitIns, FitRes, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid

from dpfedavg.core import SecAggGrid
from dpfedavg.core.types import Vector
from dpfedavg.flower.protocol import REFUSED

__all__ = ["HALTED", "SecureSum", "secure_sum", "workflow_for"]

#: Why a SecAgg+ round released nothing when no client reported an error (too few completed a stage).
HALTED = "SecAgg+ halted (too few clients completed a stage)"

logger = logging.getLogger(__name__)


@dataclass
class SecureSum:
    """What a SecAgg+ round produced: the sum and the node ids it contains, or why it halted.

    ``refused``: node id -> the reason of each node that refused the round (an error reply with code
    `REFUSED`: its policy or the run config forbids it); those nodes are not
    in the sum, and the server counts them as rejected.
    """

    total: Vector | None
    contributors: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)


class _RefusalWatch:
    """The round's Grid as the workflow sees it, noting the replies that refuse the round (by node)."""

    def __init__(self, grid: Grid) -> None:
        self._grid = grid
        self.refused: dict[int, str] = {}

    def __getattr__(self, name: str) -> object:
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001, ANN201 - Grid's signature
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        for msg in replies:
            if msg.has_error() and msg.error.code == REFUSED:
                self.refused[msg.metadata.src_node_id] = str(msg.error.reason or "")[:300]
        return replies


class _Node:
    """The one attribute of a legacy ``ClientProxy`` the workflow reads."""

    def __init__(self, node_id: int) -> None:
        self.node_id = node_id


class _Online(SimpleClientManager):
    """A client manager that only answers ``num_available`` (for the workflow's log line)."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self._count = count

    def num_available(self) -> int:
        return self._count


class _OneRound:
    """A legacy ``Strategy`` for one round: hands out the prepared ``FitIns`` and keeps the aggregate."""

    def __init__(self, fit_ins: dict[int, FitIns]) -> None:
        self._fit_ins = fit_ins
        self.average: list[np.ndarray] | None = None
        self.contributors: list[int] = []
        self.errors: list[str] = []

    def configure_fit(self, server_round, parameters, client_manager):  # noqa: ANN001, ANN201 - legacy signature
        del server_round, parameters, client_manager
        return [(_Node(nid), ins) for nid, ins in self._fit_ins.items()]

    def aggregate_fit(self, server_round, results: list[tuple[_Node, FitRes]], failures):  # noqa: ANN001, ANN201
        del server_round
        self.contributors = sorted(proxy.node_id for proxy, _ in results)
        self.errors = sorted({str(f) for f in failures})
        if results:
            # Every FitRes carries the same unmasked *average* (the workflow writes it into each).
            self.average = parameters_to_ndarrays(results[0][1].parameters)
        return None, {}


class _SecAggPlus(SecAggPlusWorkflow):
    """Flower's SecAgg+ workflow, with the bookkeeping of early dropouts fixed.

    In flwr 1.41 a client that drops out before it has shared its keys (in
    the setup or share-keys stage) stays among the round's sampled nodes and
    neighbours. Nobody holds shares of its secrets and no mask involves it,
    yet the unmask stage asks for them and halts ("Not enough shares to
    recover secret"), or would remove pairwise masks that were never added.
    After the share-keys stage we therefore keep only the nodes that
    completed it, as sampled nodes and as neighbours, which is the set the
    clients mask against (``tests/test_secure_aggregation.py`` drops clients
    in every stage and checks the exact sum).
    """

    #: The error replies and exceptions of the last round's stages before unmasking (Flower keeps them in the
    #: workflow's state, which it does not return): read after each of those stages, through its public method.
    failures: list[str] = []

    def _kept(self, state, ok: bool) -> bool:  # noqa: ANN001 - Flower's WorkflowState
        self.failures = [str(f) for f in state.failures]
        return ok

    def setup_stage(self, grid, context, state) -> bool:  # noqa: ANN001 - Flower's signature
        return self._kept(state, super().setup_stage(grid, context, state))

    def share_keys_stage(self, grid, context, state) -> bool:  # noqa: ANN001 - Flower's signature
        ok = self._kept(state, super().share_keys_stage(grid, context, state))
        shared = set(state.active_node_ids)
        state.sampled_node_ids = shared
        state.nid_to_neighbours = {nid: nbrs & shared for nid, nbrs in state.nid_to_neighbours.items() if nid in shared}
        return ok

    def collect_masked_vectors_stage(self, grid, context, state) -> bool:  # noqa: ANN001 - Flower's signature
        return self._kept(state, super().collect_masked_vectors_stage(grid, context, state))


def workflow_for(
    grid: SecAggGrid, num_shares: float, threshold: float, timeout: float | None, num_clients: int
) -> SecAggPlusWorkflow:
    """Flower's SecAgg+ workflow for a round of ``num_clients``, with our grid and unit weights.

    ``num_shares > 1`` is the SecAgg+ neighbourhood size ``k`` (every client
    shares with all the others when the round has at most ``k``); a value in
    ``(0, 1]`` is a fraction of the round's clients (Flower's meaning).
    ``threshold`` is the fraction of a client's shares needed to unmask.
    """
    if num_shares <= 1:
        shares: int | float = float(num_shares)
    else:
        shares = 1.0 if num_clients <= num_shares else int(num_shares)
    return _SecAggPlus(
        num_shares=shares,
        reconstruction_threshold=float(threshold),
        max_weight=1.0,
        clipping_range=grid.clipping_range,
        quantization_range=grid.levels,
        modulus_range=grid.modulus,
        timeout=timeout,
    )


def secure_sum(
    grid: Grid,
    workflow: SecAggPlusWorkflow,
    server_round: int,
    w: Vector | list[np.ndarray],
    train_config: ConfigRecord,
    node_ids: list[int],
    num_online: int,
) -> SecureSum:
    """Run SecAgg+ with ``node_ids`` on ``w`` and the round's train config; the sum of their replies.

    ``w`` is the flat model, or a list of arrays (a user's model, `dpfedavg.flower.app_strategy`).

    Returns a `SecureSum` whose ``total`` is ``None`` when the protocol
    halted (fewer than two clients, survivors below the reconstruction
    threshold, or a reply Flower's workflow could not process): the server
    then learned nothing.
    """
    if len(node_ids) < 2:
        return SecureSum(None, errors=[f"secure aggregation needs at least 2 clients, {len(node_ids)} sampled"])
    parameters = ndarrays_to_parameters(list(w) if isinstance(w, list) else [np.asarray(w)])
    config = dict(train_config)
    adapter = _OneRound({nid: FitIns(parameters, config) for nid in node_ids})  # type: ignore[arg-type]
    base = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
    context = LegacyContext(base, strategy=adapter, client_manager=_Online(num_online))  # type: ignore[arg-type]
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: server_round})
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    watch = _RefusalWatch(grid)
    try:
        workflow(watch, context)  # type: ignore[arg-type]
    except Exception as err:  # noqa: BLE001 - e.g. a malformed client reply inside Flower's stages
        # Nothing was released (the sum is only handed over at the very end): skip the round, keep running.
        return SecureSum(None, errors=[f"SecAgg+ failed: {type(err).__name__}: {err}"], refused=watch.refused)
    if adapter.average is None:
        why = adapter.errors or list(getattr(workflow, "failures", [])) or [HALTED]
        return SecureSum(None, errors=why, refused=watch.refused)
    (average,) = adapter.average
    total = np.asarray(average, dtype=np.float64) * len(adapter.contributors)
    return SecureSum(total, adapter.contributors, adapter.errors, watch.refused)
