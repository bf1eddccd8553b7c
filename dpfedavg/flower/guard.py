"""The node's guard on Flower's messages: read a message for `dpfedavg.privacy.node_guard.guard()`, apply its verdict.

Both ClientApps a node can run, the project's own (`dpfedavg.flower.client_app`) and ``dp_mod``
(`dpfedavg.flower.mod`), answer a refused message with `refusal()` and every SecAgg+ stage message through
`answer_stage()`, which keeps the node's own record of the protocol (`SECAGG_RECORD`) in the ClientApp's
context. The rules themselves are `dpfedavg.privacy.node_guard`'s (no Flower message there).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from flwr.app import ConfigRecord, Context, Error, Message
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

from dpfedavg.flower.protocol import REFUSED
from dpfedavg.flower.runtime import route_logs_through_flower
from dpfedavg.privacy.node_guard import NodeApp, Route, Verdict, guard
from dpfedavg.privacy.secagg_stages import SecAggStage, record_after

__all__ = ["SECAGG_RECORD", "answer_stage", "refusal", "secagg_stage_of", "secagg_stage_within"]

#: The node's own record of the SecAgg+ protocol it is in (a ``ConfigRecord`` in ``context.state``, written by
#: `answer_stage()` only: `dpfedavg.privacy.secagg_stages.record_after()`).
SECAGG_RECORD = "dpfedavg.secagg-stages"


def secagg_stage_of(msg: Message, context: Context) -> SecAggStage | None:
    """The SecAgg+ stage ``msg`` holds, or ``None`` without SecAgg+ content (or for an error message)."""
    configs = None if msg.has_error() else msg.content.config_records.get(RECORD_KEY_CONFIGS)
    if configs is None:
        return None
    return replace(secagg_stage_within(msg, context, str(configs.get(Key.STAGE))), configs=dict(configs))


def secagg_stage_within(msg: Message, context: Context, stage: str) -> SecAggStage:
    """The SecAgg+ ``stage`` a train handler is called in (``secaggplus_mod`` has taken the stage's configs), or
    `BYPASSED`: only the node's record of the protocol is read."""
    record = context.state.config_records.get(SECAGG_RECORD)
    return SecAggStage(stage, None, int(msg.metadata.dst_node_id), None if record is None else dict(record))


def answer_stage(
    app: NodeApp, msg: Message, context: Context, checked: SecAggStage, answer: Callable[[Verdict], Message]
) -> Message:
    """One SecAgg+ stage message, checked by `guard()` before ``secaggplus_mod`` sees it: the refusal, or ``answer``'s
    reply (``secaggplus_mod``'s, or in the masked-vector stage the vector it masks). The one path of both apps.

    The node's record of the protocol (`SECAGG_RECORD`) notes every stage answered; after a refusal, an error
    reply or an exception (raised on), the record is dropped: a node that refused or failed a stage answers no later
    stage of that round (a new setup starts a new one).
    """
    verdict = guard(app, msg.metadata.message_type, context.node_config, secagg_stage=checked.stage, secagg=checked)
    try:
        reply = refusal(msg, verdict.reason, app) if verdict.route is Route.REFUSE else answer(verdict)
    except BaseException:
        context.state.config_records.pop(SECAGG_RECORD, None)
        raise
    if reply.has_error() or checked.configs is None:
        context.state.config_records.pop(SECAGG_RECORD, None)
        return reply
    context.state.config_records[SECAGG_RECORD] = ConfigRecord(record_after(checked))
    return reply


def refusal(msg: Message, reason: str, app: NodeApp) -> Message:
    """The error reply of a refused message (`REFUSED`: the server counts a rejection): every refusal is this one."""
    logger = logging.getLogger(app.logger)
    if app.name is None:
        logger.warning("refusing a %r message: %s", msg.metadata.message_type, reason)
        return Message(Error(code=REFUSED, reason=reason), reply_to=msg)
    route_logs_through_flower()
    logger.warning("%s: %s", app.name, reason)
    return Message(Error(code=REFUSED, reason=f"{app.name}: {reason}"), reply_to=msg)
