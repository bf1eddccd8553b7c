"""The one round loop of every engine (Alg. 1 / Alg. 2, lines 2-13), without Flower.

Each round: `DPServer.begin_round()` (the rules every round obeys: the privacy budget, the
secure-aggregation round with fewer than three clients; Poisson sampling, ``k~``), a `ClientRunner`
brings back the sampled clients' replies as one frozen `RoundReplies` (Flower messages, SecAgg+, or a
block of clients in-process), `DPServer.close_round()` closes the round into one frozen `RoundRecord`,
and the loop passes that record on: ``on_round_end`` (evaluation, ``metrics.csv``, checkpoint), then
the health check. A run stops cleanly before a round that would exceed ``max-epsilon``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dpfedavg.core.types import RoundInstructions, Vector
from dpfedavg.server.dp_server import DPServer, PrivacyBudgetExhausted
from dpfedavg.server.health import ReplyHealth, TrainingStopped, stopped
from dpfedavg.server.round import RoundRecord, RoundReplies

__all__ = ["ClientRunner", "LoopResult", "run_round", "run_rounds"]

logger = logging.getLogger(__name__)


class ClientRunner(Protocol):
    """How an engine reaches the sampled clients of one round."""

    def run_round(self, server_round: int, clients: np.ndarray, w: Vector, ins: RoundInstructions) -> RoundReplies:
        """Have ``clients`` run Alg. 1 lines 4-10 on ``w`` with ``ins``; what they brought back.

        The runner holds no server: the loop closes the round (`DPServer.close_round()`).
        """


@dataclass
class LoopResult:
    """The model after the last round that ran, the round the budget stopped before (if it did), and why the
    run stopped when its replies were unusable (`ReplyHealth`)."""

    w: Vector
    stopped_before_round: int | None = None
    failed: TrainingStopped | None = None


def run_round(
    server: DPServer, runner: ClientRunner, server_round: int, w: Vector, available: Iterable[int] | None = None
) -> RoundRecord:
    """One round: `DPServer.begin_round()`, the runner's replies, `DPServer.close_round()`; the closed round.

    Raises `PrivacyBudgetExhausted` before a round whose release would exceed ``max-epsilon``.
    """
    start = server.begin_round(server_round, w, available)
    if start.closed:  # a rule closed it at once (nobody is contacted)
        assert start.record is not None
        return start.record
    assert start.instructions is not None
    return server.close_round(server_round, runner.run_round(server_round, start.clients, w, start.instructions))


def run_rounds(
    server: DPServer,
    runner: ClientRunner,
    w: Vector,
    rounds: Iterable[int],
    on_round_end: Callable[[RoundRecord], None] | None = None,
    health: ReplyHealth | None = None,
    available: Callable[[], Iterable[int]] | None = None,
    who: str = "the run",
) -> LoopResult:
    """Run ``rounds`` (1-based, ascending) from ``w``; ``on_round_end(record)`` after each one.

    ``available()`` lists the connected clients before each round, for a noise mechanism whose cohort depends
    on them (``server.round_mechanism.selects_from_available``); ``None`` means every client is reachable.

    Stops cleanly before a round whose release would exceed ``max-epsilon``
    (`PrivacyBudgetExhausted`, logged as a WARNING), and after a round whose replies ``health`` finds
    unusable (fail fast instead of training on noise: the result's ``failed`` says why, the fix and what
    the rounds that ran spent; they are accounted; ``who`` names the run in it).
    """
    for server_round in rounds:
        try:
            connected = available() if available is not None and server.round_mechanism.selects_from_available else None
            record = run_round(server, runner, server_round, w, connected)
        except PrivacyBudgetExhausted as stop:
            logger.warning("%s", stop)
            return LoopResult(w, stop.server_round)
        w = record.w
        if on_round_end is not None:
            on_round_end(record)
        verdict = None if health is None else health.verdict(server_round, server.history)
        if verdict is not None:
            epsilon, plan = server.epsilon, server.plan
            return LoopResult(w, failed=stopped(who, verdict, server_round, epsilon, plan.delta, plan.dp))
    return LoopResult(w)
