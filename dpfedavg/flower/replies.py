"""A round's TRAIN replies, client by client: what the server sums, and who failed, was rejected or dropped out.

The message-level checks are `dpfedavg.flower.protocol`'s (`parse_train_reply()`
for a SuperNode that is one client, `parse_block_reply()` for a SuperNode
hosting a block of virtual clients); this module turns the replies of one round into per-client
results, counts and reasons, one frozen `dpfedavg.server.round.RoundReplies` for
`dpfedavg.server.dp_server.DPServer.close_round()`:

* a reply that passes the checks: one `ClientResult` per client;
* a malformed update (any record type in any place, dtype, shape, NaN/Inf, bytes that do not parse, a list
  where a number belongs), or one no honest client sends (beyond the plausibility bound of
  `dpfedavg.privacy.plausibility`): that client is rejected (with the reason); a reply that cannot be
  read at all rejects every client of its node; whatever a reply holds, it is never an exception here;
* a refusal (an error reply with code `REFUSED`: the node's policy or the run
  config forbids the round, `dpfedavg.privacy.policy`): every client of the node is rejected, the rule
  in the reason;
* an error reply: every client of the node failed, or dropped out when Flower reports the node or
  its reply unavailable; a client whose local training diverged failed;
* no reply within the round timeout: every client of the node dropped out (``DPServer`` counts the
  sampled clients that are neither received, failed nor rejected as dropouts);
* a reply from a node that was not sampled this round, or a node's second reply: rejected with its reason
  and counted apart (``RoundReplies.num_unexpected``), never against a sampled client, so a sampled node
  that did not answer still counts as a dropout.

In every case the server tops up the noise of the updates that did not arrive (`dpfedavg.core.mechanism`),
so the released sum carries the nominal noise whatever a node's failure takes with it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from flwr.app import Message
from flwr.common.constant import ErrorCode

from dpfedavg.core.types import ClientResult
from dpfedavg.flower.protocol import REFUSED, parse_block_reply, parse_train_reply
from dpfedavg.privacy.plausibility import ReplyLimits
from dpfedavg.server.round import RoundReplies

__all__ = ["collect_replies"]

logger = logging.getLogger(__name__)

#: Error codes Flower uses when a node or its reply is gone: its clients are dropouts, not failures.
UNAVAILABLE_CODES = frozenset({ErrorCode.NODE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE})


@dataclass
class _Collected:
    """The round's per-client outcome while it is read (frozen into `RoundReplies` at the end)."""

    results: list[ClientResult] = field(default_factory=list)
    num_failed: int = 0
    #: Sampled clients whose reply was rejected.
    num_rejected: int = 0
    #: Replies nobody asked for (a node not sampled this round, a node's second reply): rejected, their reasons
    #: in ``reasons``, but not counted against the sampled clients (each of those still replied, failed,
    #: was rejected or dropped out).
    num_unexpected: int = 0
    reasons: list[str] = field(default_factory=list)
    #: Why clients failed (a node's error reply, diverged local training).
    failures: list[str] = field(default_factory=list)


def collect_replies(
    server_round: int,
    replies: Iterable[Message],
    sampled: Mapping[int, Sequence[int]],
    *,
    dim: int,
    diagnostics: bool,
    clip: float,
    block: bool,
    limits: ReplyLimits | None = None,
) -> RoundReplies:
    """Check a round's replies and count them per client.

    Parameters
    ----------
    sampled:
        Node id -> the sampled clients it was asked to compute (ascending).
    clip:
        The bound on a clean update's norm (``inf`` without DP), checked with ``diagnostics``.
    block:
        The nodes host virtual clients (``clients-per-node`` > 1): replies hold one update per client.
    limits:
        The plausibility bounds of one client's ``g + zeta`` (``None`` without a sensitivity bound).
    """
    out = _Collected()
    replied: set[int] = set()
    unavailable = 0
    for msg in replies:
        src = msg.metadata.src_node_id
        if msg.has_error() and msg.error.code in UNAVAILABLE_CODES:
            # The SuperLink answers for a node that went offline, from its own id (Flower's
            # create_message_error_unavailable_res_message): that node's clients dropped out, and
            # the server counts every sampled client without a reply as a dropout.
            unavailable += 1
            continue
        if src not in sampled:
            _reject_unexpected(out, server_round, src, f"reply from node {src}, which was not sampled this round")
            continue
        if src in replied:
            _reject_unexpected(out, server_round, src, f"second reply from node {src} in this round")
            continue
        replied.add(src)
        clients = sampled[src]
        if msg.has_error():
            reason = str(msg.error.reason or "")[:300]
            if msg.error.code == REFUSED:
                _reject(out, server_round, src, f"node {src} refused the round: {reason}", len(clients))
                continue
            out.num_failed += len(clients)
            out.failures.extend([f"node {src} failed: {msg.error.reason[:300]}"] * len(clients))
            logger.warning(
                "Round %d: node %d failed (%d sampled clients): %s",
                server_round,
                src,
                len(clients),
                reason,
            )
            continue
        try:
            _take(out, server_round, msg, clients, dim=dim, diagnostics=diagnostics, clip=clip, block=block,
                  limits=limits)  # fmt: skip
        except Exception as err:  # noqa: BLE001 - a client's message must never end the ServerApp
            _reject(out, server_round, src, f"unreadable reply ({type(err).__name__}: {str(err)[:200]})", len(clients))
    if unavailable:
        logger.warning("Round %d: %d sampled nodes became unavailable (dropouts)", server_round, unavailable)
    out.results.sort(key=lambda result: result.client_id)  # fixed summation order
    return RoundReplies(
        tuple(out.results),
        num_failed=out.num_failed,
        num_rejected=out.num_rejected,
        num_unexpected=out.num_unexpected,
        failed_reasons=tuple(out.failures),
        rejected_reasons=tuple(out.reasons),
    )


def _take(
    out: _Collected,
    server_round: int,
    msg: Message,
    clients: Sequence[int],
    *,
    dim: int,
    diagnostics: bool,
    clip: float,
    block: bool,
    limits: ReplyLimits | None,
) -> None:
    """One node's reply (not an error): its clients' results, rejections and diverged local trainings.

    The results are collected first and appended only once the whole reply was read, so a reply that fails
    half-way leaves no partial results behind.
    """
    src = msg.metadata.src_node_id
    try:
        if not block:
            update, norm, clean = parse_train_reply(msg.content, dim, diagnostics=diagnostics, clip=clip)
            reason = limits.violation(update) if limits is not None else None
            if reason is not None:
                _reject(out, server_round, src, f"client {clients[0]}: {reason}", 1)
            else:
                out.results.append(ClientResult(clients[0], update, norm, clean))
            return
        parsed = parse_block_reply(msg.content, clients, dim, diagnostics=diagnostics, clip=clip)
    except ValueError as err:
        _reject(out, server_round, src, str(err), len(clients))
        return
    accepted = []
    for client_id, (update, norm, clean) in parsed.updates.items():
        reason = limits.violation(update) if limits is not None else None
        if reason is not None:
            parsed.rejected[client_id] = f"client {client_id}: {reason}"
            continue
        accepted.append(ClientResult(client_id, update, norm, clean))
    out.results.extend(accepted)
    for reason in parsed.rejected.values():
        _reject(out, server_round, src, reason, 1)
    if parsed.diverged:
        out.num_failed += len(parsed.diverged)
        out.failures.extend(f"client {c}: local training diverged (NaN/Inf)" for c in parsed.diverged)
        logger.warning(
            "Round %d: node %d: local training diverged (NaN/Inf) for clients %s",
            server_round,
            src,
            parsed.diverged[:10],
        )


def _reject(out: _Collected, server_round: int, node: int, reason: str, count: int) -> None:
    out.num_rejected += count
    out.reasons.append(reason)
    logger.warning("Round %d: rejected reply from node %d: %s", server_round, node, reason)


def _reject_unexpected(out: _Collected, server_round: int, node: int, reason: str) -> None:
    out.num_unexpected += 1
    out.reasons.append(reason)
    logger.warning("Round %d: rejected reply from node %d: %s", server_round, node, reason)
