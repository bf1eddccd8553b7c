"""The node's one guard: what a SuperNode answers, whatever its SuperLink sends.

A SuperNode's operator trusts nothing the SuperLink sends: the message type and action, the run config,
the round's instructions, the FAB. The node's guarantee is its policy (``--node-config``,
`dpfedavg.privacy.policy`) and its ledger (`dpfedavg.privacy.ledger`). Both ClientApps a node can run, the
project's own (`dpfedavg.flower.client_app`, `CLIENT_APP`) and ``dp_mod`` around a user's train function
(`dpfedavg.flower.mod`, `DP_MOD`), ask `guard()` about every message and apply its `Verdict`; the rules are
these, in this order, for both:

1. **message types and actions.** A train message of any action (``train``, ``train.<action>``) is
   privatised. The project's ClientApp answers besides only the partition query (its reply is the node's
   public ``partition-id`` and ``num-partitions``) and refuses every other message, policy or not; ``dp_mod``
   lets the user's other handlers answer without a policy and, under one, refuses every other message
   (``evaluate*`` unless ``allow-evaluate = true``: its reply is the user's metrics of the node's data).
2. **SecAgg+.** SecAgg+ content is answered only in a ``train`` message inside Flower's protocol, in its
   masked-vector stage, whose vector ``secaggplus_mod`` masks; the protocol's other stages train nothing.
3. **The round.** The instructions are read strictly and checked by the one rule set,
   `dpfedavg.privacy.policy.check_round()` (the node's policy, then the run config or the train config's
   public terms, the client's own noise share, the SecAgg+ grid).
4. **The ledger.** The release is charged to the node's ledger (write-ahead, refused past ``max-epsilon``)
   before anything is computed.

A refused message is answered by `refusal()` (an error reply with code `REFUSED`: the server counts a
rejection), and nothing else. A new rule goes here, once, for both apps: a check of a SecAgg+ stage's own
parameters (the cohort, the threshold, who is dropped) in `_secure_content()`, which the project's ClientApp
calls at every stage of the protocol (``dp_mod`` is called in the masked-vector stage only, so a stage check
needs a mod around ``secaggplus_mod`` that asks the same function); what the ledger charges in
`_followed()`, the one place a release is charged (`_secagg_checked()` says whether those stage checks ran, which
moves the ledger's server account from the node's own noise share to the cohort's).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import Any

from flwr.app import Error, Message, MessageType
from flwr.common.secure_aggregation.secaggplus_constants import Stage

from dpfedavg.config import RunConfig
from dpfedavg.core.types import RoundInstructions
from dpfedavg.flower.protocol import CLIENT_IDS, REFUSED, instructions_from_config_record
from dpfedavg.flower.runtime import route_logs_through_flower
from dpfedavg.privacy.ledger import record_release
from dpfedavg.privacy.policy import NodePolicy, PolicyError, PublicTerms, RoundRefused, check_round

__all__ = [
    "BYPASSED",
    "CLIENT_APP",
    "DP_MOD",
    "NodeApp",
    "Route",
    "TrainRequest",
    "Verdict",
    "guard",
    "node_policy",
    "refusal",
]

#: The SecAgg+ "stage" of content that did not come through the protocol's masked-vector stage.
BYPASSED = "bypassed"
#: The message types the project's ClientApp answers besides train ones: the partition query (Flower's default
#: action).
PARTITION_QUERY = (MessageType.QUERY, f"{MessageType.QUERY}.default")
#: Train-config keys of ``dp_mod``'s public terms (`PublicTerms`): the noise placement and the expected cohort ``r``.
NOISE_PLACEMENT = "noise-placement"
CLIENTS_PER_ROUND = "clients-per-round"


@dataclass(frozen=True)
class NodeApp:
    """Which of the node's ClientApps the guard answers for: where they differ is data, the rules are one.

    ``own_handlers``: the project's ClientApp (train messages and the partition query only, policy or not,
    checked against the run config); otherwise ``dp_mod`` (the user's handlers answer other messages without a
    policy; train messages are checked against the train config's public terms, `PublicTerms`). ``name`` prefixes
    ``dp_mod``'s refusals and log lines; ``logger`` logs the refusals.
    """

    name: str | None
    logger: str
    own_handlers: bool


CLIENT_APP = NodeApp(name=None, logger="dpfedavg.flower.client_app", own_handlers=True)
DP_MOD = NodeApp(name="dp_mod", logger="dpfedavg.flower.mod", own_handlers=False)


class Route(Enum):
    """What the app does with a message (`Verdict.route`)."""

    ANSWER = "answer"  # the app's handler answers it as it is (no data of the node in it, or no policy)
    TRAIN = "train"  # privatised: Alg. 1 / 2 lines 4-10 with `Verdict.instructions`
    PROTOCOL = "protocol"  # a SecAgg+ stage that trains nothing (keys, shares, unmasking): secaggplus_mod alone
    REFUSE = "refuse"  # `refusal()` with `Verdict.reason`


@dataclass(frozen=True)
class Verdict:
    """The guard's answer: the route, why a message is refused, the round's instructions as the client follows them."""

    route: Route
    reason: str = ""
    instructions: RoundInstructions | None = None


@dataclass(frozen=True)
class TrainRequest:
    """A train message's round, to be checked and charged: its train config, Flower's run id, the run config.

    ``config`` is the round's config record as the message holds it (``None`` when it holds none: refused);
    ``cfg`` the run config (the project's ClientApp; ``None`` for ``dp_mod``, which reads its `PublicTerms`).
    """

    config: Mapping[str, Any] | None
    run_id: int
    cfg: RunConfig | None = None


def node_policy(node_config: Mapping[str, Any]) -> NodePolicy:
    """This SuperNode's policy, from its ``--node-config`` (`dpfedavg.privacy.policy`); ``PolicyError`` if bad."""
    return _policy(tuple(sorted(node_config.items())))


@lru_cache(maxsize=16)
def _policy(items: tuple[tuple[str, object], ...]) -> NodePolicy:
    return NodePolicy.from_node_config(dict(items))


def guard(
    app: NodeApp,
    message_type: str,
    node_config: Mapping[str, Any],
    *,
    secagg_stage: str | None = None,
    train: TrainRequest | None = None,
) -> Verdict:
    """The node's one rule set (the module docstring's four steps), applied to what the app knows of a message.

    ``secagg_stage``: ``None`` without SecAgg+ content; the protocol's stage the content is in (the project's
    ClientApp wraps ``secaggplus_mod`` and reads it), `Stage.COLLECT_MASKED_VECTORS` when ``dp_mod`` is called by
    ``secaggplus_mod`` in that stage, or `BYPASSED` (content that did not come through it). ``train``: the
    round to check and charge; without it the verdict says only whether the message may go on (the apps ask
    before they set anything up, then again with the round).

    Raises ``ValueError`` for a ``dp_mod`` train config that is not DPFedAvg's (an error reply, not a refusal).
    """
    category = message_type.split(".", 1)[0]
    if app.own_handlers:
        if category != MessageType.TRAIN and message_type not in PARTITION_QUERY:
            return _refuse(
                f"refused: this node answers train messages (privatised) and the partition query only, not "
                f"{message_type!r}"
            )
    else:
        try:
            policy = node_policy(node_config)
        except PolicyError as err:
            return _refuse(str(err))
        if category != MessageType.TRAIN and policy.active:
            if category != MessageType.EVALUATE or not policy.allow_evaluate:
                return _refuse(_not_answered(message_type, category, policy))
    if category != MessageType.TRAIN:
        return Verdict(Route.ANSWER)
    if secagg_stage is not None:
        refused = _secure_content(app, message_type, secagg_stage)
        if refused is not None:
            return refused
    if train is None:
        return Verdict(Route.TRAIN)
    try:
        ins = _followed(app, message_type, node_config, train, secure_round=secagg_stage is not None)
    except (RoundRefused, PolicyError) as err:
        return _refuse(str(err))
    if secagg_stage is not None and ins.secagg_step <= 0:  # dp_mod (the run config's grid: check_round); charged
        raise ValueError("a secure-aggregation round without a quantization grid (secagg-step)")
    return Verdict(Route.TRAIN, instructions=ins)


def _refuse(reason: str) -> Verdict:
    return Verdict(Route.REFUSE, reason)


def _not_answered(message_type: str, category: str, policy: NodePolicy) -> str:
    """Why ``dp_mod`` refuses a message that is not a train message under a node policy."""
    if category == MessageType.EVALUATE:
        return (
            f"refused by this node's policy (allow-evaluate): a {message_type!r} message's reply is the user's "
            "metrics of this node's data without noise; the node answers it only with allow-evaluate = true"
        )
    return (
        f"refused by this node's policy ({', '.join(policy.stated)}): a {message_type!r} message is neither a train "
        "message (privatised) nor an evaluate message (allow-evaluate); this node answers no other under a policy"
    )


def _secure_content(app: NodeApp, message_type: str, stage: str) -> Verdict | None:
    """SecAgg+ content is answered only by a ``train`` message in the protocol's masked-vector stage.

    The project's ClientApp wraps ``secaggplus_mod``: the protocol's other stages go to it alone (they train
    nothing). ``dp_mod`` is called by ``secaggplus_mod``, only in that stage: anything else bypassed the protocol
    (``secaggplus_mod`` passes a ``train.<action>`` message through unmasked).
    """
    if app.own_handlers:
        if stage == BYPASSED:
            return _refuse("refused: SecAgg+ content outside the protocol's masked-vector stage")
        if message_type != MessageType.TRAIN:
            return _refuse(
                f"refused: a {message_type!r} message with SecAgg+ content; SecAgg+ rounds are answered only as "
                "'train' messages inside the protocol, whose masked-vector stage masks the vector"
            )
        return None if stage == Stage.COLLECT_MASKED_VECTORS else Verdict(Route.PROTOCOL)
    if message_type != MessageType.TRAIN or stage != Stage.COLLECT_MASKED_VECTORS:
        return _refuse(
            f"refused: a {message_type!r} message with SecAgg+ content outside the protocol's masked-vector stage "
            "(only a 'train' message through secaggplus_mod is answered; its vector is masked)"
        )
    return None


def _followed(
    app: NodeApp, message_type: str, node_config: Mapping[str, Any], train: TrainRequest, *, secure_round: bool
) -> RoundInstructions:
    """The round's instructions read strictly, checked (`check_round()`) and charged to the node's ledger."""
    policy = node_policy(node_config)
    if app.own_handlers:
        try:
            ins = instructions_from_config_record(train.config)  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise RoundRefused("instructions", f"the round's instructions do not parse ({type(err).__name__}: "
                               f"{err})", policy=False) from None  # fmt: skip
        followed = check_round(policy, ins, secure_round=secure_round, cfg=train.cfg)
    else:
        ins, terms = _public_round(train.config)
        followed = check_round(policy, ins, secure_round=secure_round, public=terms)
    record_release(
        node_config, train.run_id, followed, train.cfg, message_type=message_type,
        secure_aggregation=secure_round and _secagg_checked(app, train), clients=_clients(train),
    )  # fmt: skip
    if app.own_handlers and followed.noise_seed != ins.noise_seed:
        logging.getLogger(app.logger).info("round %d: secure noise: the server's noise seed is not used",
                                           ins.server_round)  # fmt: skip
    return followed


def _secagg_checked(app: NodeApp, train: TrainRequest) -> bool:
    """Whether this SecAgg+ round's own parameters (run ``train.run_id``, the round of ``train.config``) were
    checked by `_secure_content()` at the protocol's stages (a cohort of at least the node's minimum, equal to the
    instructions' ``|S_k|``, consistent shares and threshold, nobody both active and dropped), so that the server
    sees only the cohort's sum: the ledger's server account then counts the cohort's noise, ``z_own sqrt(|S_k|)``,
    instead of this node's share alone. No stage is checked yet: ``False``, the node's own share."""
    return False


def _clients(train: TrainRequest) -> int:
    """The updates of this node's data the message asks for: its virtual clients (``clients-per-node`` > 1), else 1."""
    if train.cfg is None or train.cfg.clients_per_node == 1 or train.config is None:
        return 1
    ids = train.config.get(CLIENT_IDS)
    return max(1, len(ids)) if isinstance(ids, list | tuple) else train.cfg.clients_per_node


def _public_round(config: Mapping[str, Any] | None) -> tuple[RoundInstructions, PublicTerms]:
    """``dp_mod``'s round: the instructions and the public terms of its train config.

    ``ValueError`` saying which key is missing (the server is not DPFedAvg's); ``RoundRefused`` naming the value
    that does not parse.
    """
    try:
        ins = instructions_from_config_record(config)  # type: ignore[arg-type]
        placement, r = config[NOISE_PLACEMENT], config[CLIENTS_PER_ROUND]  # type: ignore[index]
    except KeyError as err:
        raise ValueError(
            f"the train config lacks {err}: the ServerApp's strategy must be dpfedavg's DPFedAvg, which sends "
            "each round's clip and noise (with another strategy there is nothing to make private)"
        ) from None
    except ValueError as err:
        raise RoundRefused("instructions", f"the round's instructions do not parse ({err})", policy=False) from None
    if not isinstance(placement, str) or isinstance(r, bool) or not isinstance(r, (int, float)):
        raise RoundRefused(
            "instructions", f"{NOISE_PLACEMENT!r} = {placement!r} and {CLIENTS_PER_ROUND!r} = {r!r}: expected a "
            "placement name and a number", policy=False,
        )  # fmt: skip
    return ins, PublicTerms(placement=placement, clients_per_round=float(r))


def refusal(msg: Message, reason: str, app: NodeApp) -> Message:
    """The error reply of a refused message (`REFUSED`: the server counts a rejection): every refusal is this one."""
    logger = logging.getLogger(app.logger)
    if app.name is None:
        logger.warning("refusing a %r message: %s", msg.metadata.message_type, reason)
        return Message(Error(code=REFUSED, reason=reason), reply_to=msg)
    route_logs_through_flower()
    logger.warning("%s: %s", app.name, reason)
    return Message(Error(code=REFUSED, reason=f"{app.name}: {reason}"), reply_to=msg)
