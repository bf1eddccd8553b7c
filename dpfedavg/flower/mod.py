"""``dp_mod``: DP-FedAvg / DP-NormFedAvg around a Flower ClientApp's own train function.

Flower's idiom for adding a privacy step to someone else's app is a *mod* (``flwr.clientapp.mod``):
a function ``mod(msg, context, call_next)`` attached to the whole app, ``ClientApp(mods=[dp_mod])`` (the safe
pattern: it sees every message), or to one handler, ``@app.train(mods=[dp_mod])``. This one turns the user's
unchanged train function into one sampled client of Alg. 1 / Alg. 2 (Das et al., lines 4-10):

1. it hands the user's function the message as it arrived: the global model ``w_k`` in the user's
   own ``ArrayRecord`` (any keys, shapes and dtypes) and the round's ``ConfigRecord`` (the user's
   keys, plus the round's instructions that `DPFedAvg` adds);
2. it takes the user's reply, checks that its arrays are the model's (same keys and shapes), and
   computes the update as the **pseudo-gradient in the arrays' own units**,
   ``u = w_k - w_new`` over all floating arrays, flattened in sorted key order
   (`ArrayLayout`; integer arrays are not trained);
3. it bounds ``u`` as the round's instructions say (``clip``: ``g = u min(1, C/||u||)``;
   ``norm``: ``g = C u/||u||``; ``adaptive-clip``: clip to ``C_k`` plus the count coordinate) and adds
   this client's share of the noise for the run's placement (`dpfedavg.core.private_block_update()`,
   the pipeline every engine uses), then replies with ``g + zeta`` only. The user's own metrics pass
   through (they are not covered by the DP guarantee; the server says so once), except under a node policy:
   a metric of the node's data at a model the server chose (a loss, an accuracy) is what an evaluate reply
   leaks, so a node with a policy sends ``num-examples = 1`` and nothing else.

**Units.** The paper's update divides by the local learning rate, ``u = (w_k - w_{k,E}) / eta_k``; a
generic train function does not expose its learning rate (or it changes within the loop), so here
``u = w_k - w_new``. The clipping bound ``C`` is therefore in the units of the weights: a client whose
train function runs ``E`` steps at learning rate ``eta`` and would be clipped at ``C_paper`` is clipped
the same with ``C = eta C_paper``. With DP-NormFedAvg every client moves the average by exactly ``C``
(times the server's step, 1 by default) before noise.

**Its own noise.** The client computes its noise std itself from the round's public parameters,
``s = placement.client_std(z, C, r, |S_k|)`` (``z C / sqrt(|S_k|)`` with the default placement; Alg. 1 line 10),
with ``z``, ``C`` and ``|S_k|`` from the instructions and the placement and ``r`` from the train config
(``public_parameters``); the server's ``noise-std`` is only compared with it, and a round whose
``noise-std`` differs is refused (``dpfedavg.privacy.policy.check_round``, through the node's one guard,
``dpfedavg.flower.guard``, which the project's ClientApp uses too).

**Every message type.** Flower routes ``train`` and ``train.<action>`` to train handlers, ``evaluate*`` and
``query*`` to theirs. ``dp_mod`` privatises every train message, whatever the action, by the same path; as an
app-level mod, ``ClientApp(mods=[dp_mod])``, it also sees every evaluate and query message, and under a node
policy (any policy key in the node config) it refuses them, evaluation unless the operator sets
``allow-evaluate = true`` (the reply is the user's metrics of the node's data, without noise). Without a
policy they go straight to the user's handlers. A ``dp_mod`` both at the app level and on a handler
privatises once (the outer one). A numpy-only client (no gradients, any update rule that returns new weights)
works the same way.

**Secure aggregation.** Under Flower's SecAgg+ the mod goes *inside* ``checked_secaggplus_mod``, this module's
wrapper of Flower's ``secaggplus_mod`` that has the node's guard check every stage's own parameters first (the
cohort, share count and threshold of the setup, the stages' order, one unmask request per round, nobody both
active and dropped: `dpfedavg.flower.guard`), ``ClientApp(mods=[checked_secaggplus_mod, dp_mod])`` or
``@app.train(mods=[checked_secaggplus_mod, dp_mod])``. Under a node policy a masked-vector stage whose earlier
stages were not checked (Flower's plain ``secaggplus_mod``) is refused. ``secaggplus_mod`` runs the protocol's
stages and calls
``dp_mod`` once, in its masked-vector stage, with the round's instructions in the legacy ``FitIns``
layout; ``dp_mod`` rebuilds the user's ``ArrayRecord`` (the server sends the keys), calls the user's
function, encodes ``g + zeta`` on the round's grid (discrete Gaussian noise) and returns it for
masking. The user's metrics are dropped there: the server must see the sum only. The other order is
refused with an error reply naming the right one, and so is SecAgg+ content that did not come through
the protocol's masked-vector stage (a ``train.<action>`` message, which ``secaggplus_mod`` passes through
unmasked, or an app without ``secaggplus_mod``).

Errors (a message without the round's instructions, a reply whose arrays are not the model's, local
training that diverged) become error *replies* (``Message(Error(...), reply_to=msg)``), as in Flower's
own mods, so the SuperNode keeps serving; the server counts them as failed clients.
"""

from __future__ import annotations

import json
import logging
from contextvars import ContextVar

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import parameters_to_ndarrays
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Stage
from flwr.common.secure_aggregation.secaggplus_constants import Key as SecAggKey
from flwr.compat.common import recorddict_compat as compat

from dpfedavg.config import RunConfig
from dpfedavg.core import SECURE_NOISE_SEED, round_block_update
from dpfedavg.core.local import ClientUpdate, zero_updates
from dpfedavg.core.types import RoundInstructions
from dpfedavg.flower.arrays import ArrayLayout, LayoutMismatch, warn_buffers_once
from dpfedavg.flower.guard import answer_stage, refusal, secagg_stage_of, secagg_stage_within
from dpfedavg.flower.protocol import (
    ARRAYS,
    CLEAN_UPDATE_KEY,
    CONFIG,
    NUM_EXAMPLES,
    UPDATE_KEY,
    UPDATE_NORM,
    train_reply,
)
from dpfedavg.flower.runtime import route_logs_through_flower
from dpfedavg.privacy.node_guard import (
    BYPASSED,
    CLIENTS_PER_ROUND,
    DP_MOD,
    NOISE_PLACEMENT,
    Route,
    TrainRequest,
    Verdict,
    guard,
    node_policy,
)
from dpfedavg.privacy.secagg_stages import SecAggStage

__all__ = [
    "ARRAY_KEYS",
    "CLIENT_ID",
    "CLIENTS_PER_ROUND",
    "NOISE_PLACEMENT",
    "checked_secaggplus_mod",
    "dp_mod",
    "public_parameters",
]

logger = logging.getLogger(__name__)

#: Train-config key: the client id the server sampled this node as (its noise stream in seeded mode).
CLIENT_ID = "client-id"
#: Train-config key under secure aggregation: the model's array keys as a JSON list, in the order of the legacy
#: ``FitIns`` parameters (which carry no keys; a legacy config holds no lists).
ARRAY_KEYS = "array-keys"
#: Train-config keys `NOISE_PLACEMENT` and `CLIENTS_PER_ROUND` (`dpfedavg.flower.guard`): the run's public
#: parameters a client computes its own noise share from (with ``z``, ``C`` and ``|S_k|`` of the instructions).

_NAME = "dp_mod"


class _AnsweredInside(Exception):
    """``dp_mod``'s error reply (a refusal) in ``secaggplus_mod``'s masked-vector stage, which masks whatever it gets
    and cannot pass an error reply on: `checked_secaggplus_mod` answers with the reply; Flower's plain mod turns the
    exception into an error reply with its reason."""

    def __init__(self, reply: Message) -> None:
        super().__init__(reply.error.reason)
        self.reply = reply
#: Set while a ``dp_mod`` handles a message: an inner ``dp_mod`` (app-level and per-handler) passes it on.
_HANDLING: ContextVar[bool] = ContextVar("dp_mod_handling", default=False)


def public_parameters(cfg: RunConfig) -> dict[str, str | float]:
    """The train-config entries ``dp_mod`` needs besides the instructions: the placement and ``r``."""
    return {NOISE_PLACEMENT: cfg.noise_placement, CLIENTS_PER_ROUND: float(cfg.clients_per_round)}


def dp_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Make the wrapped train function one client of DP-FedAvg / DP-NormFedAvg (Alg. 1 / 2, lines 4-10).

    Attach it to the whole app, ``ClientApp(mods=[dp_mod])``, so that it sees every message the node
    answers (or to each train handler, ``@app.train(mods=[dp_mod])``), with dpfedavg's
    ``DPFedAvg`` as the ServerApp's strategy. Every train message (``train`` or
    ``train.<action>``) is privatised; evaluate, query and any other message goes to the user's handler
    without a node policy, and is refused under one (evaluate unless ``allow-evaluate = true``).
    It should be the last mod to touch the arrays (the innermost one); under SecAgg+ it goes inside
    `checked_secaggplus_mod` (Flower's mod behind the node's stage checks): ``mods=[checked_secaggplus_mod, dp_mod]``.

    Parameters
    ----------
    msg:
        The message. A train message has one ``ArrayRecord`` (the model ``w_k``) and one ``ConfigRecord``
        (the user's keys and the round's instructions: ``algorithm``, ``clip``, ``noise-multiplier``,
        ``cohort-size``, ``noise-placement``, ``clients-per-round``, ``noise-std``, ``noise-seed``, ...).
    context:
        The ClientApp's context: its ``node_config`` holds the operator's privacy policy
        (`dpfedavg.privacy.policy`; e.g. ``secure-noise = true`` draws the noise from the OS CSPRNG whatever
        the server asks and never sends an un-noised update, ``min-noise-multiplier`` refuses rounds with less
        noise). Its privacy ledger charges every release here as an unamplified Gaussian: of z against those
        who see the released model (``max-epsilon-released``; your app's clients have no run config, so no q),
        of this node's own share against the server (``max-epsilon``; ``dpfedavg.privacy.ledger``).
    call_next:
        The user's handler (and any inner mods).

    Returns
    -------
    Message
        For a train message ``{"arrays": {"update": g + zeta}, "metrics": the user's metrics + num-examples
        (+ update-norm in seeded mode)}``, under a node policy with ``{"num-examples": 1}`` as its only metric;
        the user's reply for a message it lets through; or an error reply saying what is wrong or which rule
        refuses it.
    """
    if _HANDLING.get():
        return call_next(msg, context)
    token = _HANDLING.set(True)
    try:
        return _answer(msg, context, call_next)
    finally:
        _HANDLING.reset(token)


def checked_secaggplus_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's ``secaggplus_mod`` behind the node's guard: use it in place of ``secaggplus_mod`` with ``dp_mod``.

    Each SecAgg+ stage message is checked by the node's one guard (`dpfedavg.privacy.node_guard.guard()`, the rules the
    project's ClientApp applies too) before ``secaggplus_mod`` sees it, so before any of the node's secrets
    leaves it: the setup's cohort (at least the node policy's ``secagg-min-cohort``, default 3), share count and
    threshold (a majority of a node's shares); the stages in order, one unmask request per round, after the
    node's masked vector; in the unmask stage nobody both active and dropped, and this node active. In the
    masked-vector stage ``dp_mod`` (inside) checks the setup's cohort against the round's ``|S_k|``. A refused
    stage is a refusal (the server counts a rejection) and ends the node's part in that round. Every other
    message goes to ``secaggplus_mod`` unchanged (it passes them on).

    ``ClientApp(mods=[checked_secaggplus_mod, dp_mod])``, or ``@app.train(mods=[checked_secaggplus_mod, dp_mod])``.
    """
    checked = secagg_stage_of(msg, context) if msg.metadata.message_type == MessageType.TRAIN else None
    if checked is None:
        return secaggplus_mod(msg, context, call_next)
    return answer_stage(DP_MOD, msg, context, checked, lambda verdict: _inside_secaggplus(msg, context, call_next))


def _inside_secaggplus(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    try:
        return secaggplus_mod(msg, context, call_next)
    except _AnsweredInside as answered:  # dp_mod refused the round in the masked-vector stage
        return answered.reply


def _answer(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """The one place every message through ``dp_mod`` is answered: privatised (train), let through or refused
    (`dpfedavg.privacy.node_guard.guard()`, the node's one guard)."""
    verdict = guard(DP_MOD, msg.metadata.message_type, context.node_config)
    if verdict.route is Route.REFUSE:
        return refusal(msg, verdict.reason, DP_MOD)
    if verdict.route is Route.ANSWER:
        return call_next(msg, context)
    return _train(msg, context, call_next)


def _train(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """A train message of any action: Alg. 1 / 2 lines 4-10 on the user's reply, or a refusal."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        inside = SecAggKey.STAGE not in msg.content.config_records[RECORD_KEY_CONFIGS]
        reply = _secure_train(msg, context, call_next)
        if reply.has_error() and inside and _in_masked_vector_stage(msg, context):
            raise _AnsweredInside(reply)  # secaggplus_mod cannot pass an error reply on
        return reply
    content = msg.content
    if len(content.array_records) != 1 or len(content.config_records) != 1:
        return _error(
            msg,
            f"the train message has {len(content.array_records)} ArrayRecords and {len(content.config_records)} "
            "ConfigRecords, expected one of each (the model and the round's config)",
        )
    config = next(iter(content.config_records.values()))
    try:
        verdict = _round(config, context, msg, secagg=None)
        if verdict.route is Route.REFUSE:
            return refusal(msg, verdict.reason, DP_MOD)
        received = next(iter(content.array_records.values()))
        layout = ArrayLayout.of(received)
    except ValueError as err:
        return _error(msg, str(err))
    warn_buffers_once(layout)  # BatchNorm's running statistics: what is sent of them
    return _privatised(msg, context, call_next(msg, context), layout, received, verdict.instructions, config)


def _round(config: ConfigRecord, context: Context, msg: Message, *, secagg: SecAggStage | None) -> Verdict:
    """The guard's verdict on a train message's round (checked against the node's policy and charged).

    Every train message ``dp_mod`` answers passes here (plain and SecAgg+: ``secagg`` is the stage, with the
    node's record of the protocol). ``ValueError`` saying which key is missing (the strategy is not DPFedAvg's).
    """
    request = TrainRequest(config, context.run_id)
    stage = None if secagg is None else secagg.stage
    return guard(DP_MOD, msg.metadata.message_type, context.node_config, secagg_stage=stage, train=request,
                 secagg=secagg)  # fmt: skip


def _privatised(
    msg: Message,
    context: Context,
    reply: Message,
    layout: ArrayLayout,
    received: ArrayRecord,
    ins: RoundInstructions | None,
    config: ConfigRecord,
    *,
    masked: bool = False,
) -> Message:
    """The train reply from the user's ``reply``: ``g + zeta`` (masked: the SecAgg+ vector), or the error reply.

    Under a node policy the user's metrics (un-noised statistics of the node's data) are not sent, and neither
    is ``||u||`` with secure noise; the masked vector carries nothing else.
    """
    if reply.has_error():
        return reply
    assert ins is not None  # noqa: S101 - a train verdict carries its instructions
    under_policy = node_policy(context.node_config).active
    try:
        update = _private_update(layout, received, reply, ins, _client_id(config, msg), under_policy)
    except ValueError as err:
        return _error(msg, str(err))
    if masked:
        return train_reply(msg, {UPDATE_KEY: update.noisy})
    metrics = {} if under_policy else _user_metrics(reply)  # un-noised: not under a policy
    metrics.setdefault(NUM_EXAMPLES, 1)
    if ins.noise_seed != SECURE_NOISE_SEED:  # un-noised statistics of this client's data: seeded research mode only
        metrics[UPDATE_NORM] = update.update_norm
    clean = {CLEAN_UPDATE_KEY: update.clean} if ins.diagnostics else None
    return train_reply(msg, {UPDATE_KEY: update.noisy}, metrics, clean)


def _client_id(config: ConfigRecord, msg: Message) -> int:
    """The id the server sampled this node as (its noise stream); the node id when the server sent none."""
    value = config.get(CLIENT_ID)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else int(msg.metadata.dst_node_id)


def _private_update(
    layout: ArrayLayout, received: ArrayRecord, reply: Message, ins: RoundInstructions, client: int, under_policy: bool
) -> ClientUpdate:
    """``g + zeta`` from the user's reply: ``u = w_k - w_new``, bounded and noised (ValueError if impossible).

    Under a node policy a ``u`` with NaN/Inf (training that diverged at the server's model and learning rate: a
    function of the node's data) becomes ``u = 0``, noised as usual (`dpfedavg.core.local.zero_updates()`), rather
    than an error reply that would tell the server so without noise.
    """
    records = reply.content.array_records
    if len(records) != 1:
        raise ValueError(
            f"the train function replied with {len(records)} ArrayRecords, expected 1 (the model's arrays, "
            "e.g. ArrayRecord(model.state_dict()))"
        )
    try:
        w_new = layout.flatten(next(iter(records.values())), what="the train function's arrays")
    except LayoutMismatch as err:
        raise ValueError(f"{err} (return the arrays of the model it received)") from None
    u = layout.flatten(received) - w_new
    if under_policy and not np.all(np.isfinite(u)):
        logger.warning("%s: local training diverged; under this node's policy a zero update is sent, noised", _NAME)
        (update,) = zero_updates([client], len(u), ins, dtype=u.dtype)
        return update
    (update,) = round_block_update(u[None, :], ins, [client])
    if update is None:
        raise ValueError("local training diverged: the returned arrays have NaN/Inf (nothing is sent)")
    return update


def _user_metrics(reply: Message) -> dict:
    """The user's metric records, merged into one dict (Flower's replies have one, named ``metrics``)."""
    out: dict = {}
    for record in reply.content.metric_records.values():
        out.update(dict(record))
    return out


def _error(msg: Message, reason: str) -> Message:
    route_logs_through_flower()
    logger.error("%s: %s", _NAME, reason)
    return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=f"{_NAME}: {reason}"), reply_to=msg)


# ------------------------------------------------------------------ secure aggregation (inside secaggplus_mod)
def _secure_train(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """The masked-vector stage of SecAgg+: the user's train on its own record, ``g~ + zeta~`` as a legacy FitRes.

    ``secaggplus_mod`` pops the stage key before it calls the inner app; a message that still has it
    reached ``dp_mod`` first, so the mods are in the wrong order.
    """
    if SecAggKey.STAGE in msg.content.config_records[RECORD_KEY_CONFIGS]:
        return _error(
            msg,
            "a SecAgg+ message reached dp_mod before secaggplus_mod: put dp_mod inside it, "
            "@app.train(mods=[checked_secaggplus_mod, dp_mod])",
        )
    inside = Stage.COLLECT_MASKED_VECTORS if _in_masked_vector_stage(msg, context) else BYPASSED
    stage = secagg_stage_within(msg, context, inside)
    admitted = guard(DP_MOD, msg.metadata.message_type, context.node_config, secagg_stage=stage.stage)
    if admitted.route is Route.REFUSE:
        return refusal(msg, admitted.reason, DP_MOD)
    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    config = ConfigRecord({k: v for k, v in fitins.config.items() if k != ARRAY_KEYS})  # type: ignore[misc]
    arrays = parameters_to_ndarrays(fitins.parameters)
    try:
        keys = json.loads(str(fitins.config.get(ARRAY_KEYS)))
    except ValueError:
        keys = None
    if not isinstance(keys, list) or len(keys) != len(arrays):
        return _error(msg, f"the SecAgg+ train config has no {ARRAY_KEYS!r} for its {len(arrays)} arrays")
    try:
        verdict = _round(config, context, msg, secagg=stage)
        if verdict.route is Route.REFUSE:
            return refusal(msg, verdict.reason, DP_MOD)
        received = ArrayRecord(
            {str(k): Array(np.require(a, requirements="C")) for k, a in zip(keys, arrays, strict=True)}
        )
        layout = ArrayLayout.of(received)
    except ValueError as err:
        return _error(msg, str(err))
    inner = Message(RecordDict({ARRAYS: received, CONFIG: config}), metadata=msg.metadata)
    reply = call_next(inner, context)
    return _privatised(msg, context, reply, layout, received, verdict.instructions, config, masked=True)


def _in_masked_vector_stage(msg: Message, context: Context) -> bool:
    """Whether ``secaggplus_mod`` called this in its masked-vector stage (then it masks what ``dp_mod`` returns).

    It runs the protocol for the exact type ``train`` only (``train.<action>`` passes through it unmasked),
    pops the stage key before it calls the inner app, and saves the stage it enters only after that call:
    during it the node's saved SecAgg+ state is still at the key-sharing stage.
    """
    if msg.metadata.message_type != MessageType.TRAIN:
        return False
    state = context.state.config_records.get(RECORD_KEY_STATE)
    return state is not None and state.get("current_stage") == Stage.SHARE_KEYS
