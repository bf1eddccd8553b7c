"""The node's one guard: what a SuperNode answers, whatever its SuperLink sends (no Flower message here).

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
   masked-vector stage, whose vector ``secaggplus_mod`` masks; the protocol's other stages train nothing. Every
   stage's own parameters are checked before ``secaggplus_mod`` sees it, so before any secret leaves the node
   (`dpfedavg.flower.guard.answer_stage()`, the rules in `dpfedavg.privacy.secagg_stages`): the setup's cohort (at least
   ``secagg-min-cohort``), share count and threshold (a majority of a node's shares); the stages in order, each
   once (one unmask request per round, after the node's masked vector); in the unmask stage no node both active
   and dropped, and this node active; in the masked-vector stage the setup's cohort equal to the ``|S_k|`` the
   node's noise share is computed for (`_secagg_checked()`). The project's ClientApp checks every stage itself; a
   user's app has ``checked_secaggplus_mod`` (`dpfedavg.flower.mod`) in place of Flower's ``secaggplus_mod``, and
   under a node policy ``dp_mod`` refuses a masked-vector stage whose earlier stages were not checked.
3. **The round.** The instructions are read strictly and checked by the one rule set,
   `dpfedavg.privacy.policy.check_round()` (the node's policy, then the run config or the train config's
   public terms, the client's own noise share, the SecAgg+ grid).
4. **The ledger.** The release is charged to the node's ledger (write-ahead, refused past ``max-epsilon``)
   before anything is computed.

The apps read a message into what this module decides on (its type, the node config, a `TrainRequest`, a
`SecAggStage`) and apply the `Verdict` (`dpfedavg.flower.guard`): a refused message is answered by
`dpfedavg.flower.guard.refusal()` (an error reply with code ``REFUSED``: the server counts a rejection), and
nothing else. A new rule goes here, once, for both apps: a check of a SecAgg+ stage's own
parameters in `dpfedavg.privacy.secagg_stages.stage_refusal()` (both apps answer every stage of the protocol
through `dpfedavg.flower.guard.answer_stage()`); what the ledger charges in `_followed()`, the one place a release
is charged (`_secagg_checked()` says whether those stage checks ran; the ledger records it, and its server
account charges the node's own noise share either way).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import Any

from dpfedavg.config import RunConfig
from dpfedavg.core.types import RoundInstructions
from dpfedavg.privacy.ledger import record_release
from dpfedavg.privacy.policy import NodePolicy, PolicyError, PublicTerms, RoundRefused, check_round
from dpfedavg.privacy.secagg_stages import SecAggStage, Stage, admitted_cohort, stage_refusal

__all__ = [
    "BYPASSED",
    "CLIENT_APP",
    "CLIENT_IDS",
    "CLIENTS_PER_ROUND",
    "DP_MOD",
    "NOISE_PLACEMENT",
    "NodeApp",
    "Route",
    "TrainRequest",
    "Verdict",
    "guard",
    "node_policy",
]

class MessageType:
    """Flower's message types (``flwr.app.MessageType``; a test checks they are the same): ``<type>[.<action>]``."""

    TRAIN, EVALUATE, QUERY = "train", "evaluate", "query"


#: The SecAgg+ "stage" of content that did not come through the protocol's masked-vector stage.
BYPASSED = "bypassed"
#: The message types the project's ClientApp answers besides train ones: the partition query (Flower's default
#: action).
PARTITION_QUERY = (MessageType.QUERY, f"{MessageType.QUERY}.default")
#: Train-config key of the virtual clients (``clients-per-node`` > 1) a node is asked to train, ascending.
CLIENT_IDS = "client-ids"
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

    @property
    def clients(self) -> int:
        """The updates of this node's data the message asks for: its virtual clients (``clients-per-node`` > 1,
        the train config's `CLIENT_IDS`), else 1."""
        if self.cfg is None or self.cfg.clients_per_node == 1 or self.config is None:
            return 1
        ids = self.config.get(CLIENT_IDS)
        return max(1, len(ids)) if isinstance(ids, list | tuple) else self.cfg.clients_per_node


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
    secagg: SecAggStage | None = None,
) -> Verdict:
    """The node's one rule set (the module docstring's four steps), applied to what the app knows of a message.

    ``secagg_stage``: ``None`` without SecAgg+ content; the protocol's stage the content is in (the project's
    ClientApp wraps ``secaggplus_mod`` and reads it), `Stage.COLLECT_MASKED_VECTORS` when ``dp_mod`` is called by
    ``secaggplus_mod`` in that stage, or `BYPASSED` (content that did not come through it). ``train``: the
    round to check and charge; without it the verdict says only whether the message may go on (the apps ask
    before they set anything up, then again with the round). ``secagg``: the SecAgg+ stage message with the node's
    record of the protocol (`secagg_stage_of()`): its parameters are checked when it has them (before
    ``secaggplus_mod``), the setup's cohort against the round's ``|S_k|`` in the masked-vector stage.

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
        refused = _secure_content(app, message_type, secagg_stage, secagg, node_config)
        if refused is not None:
            return refused
    if train is None:
        return Verdict(Route.TRAIN)
    try:
        ins = _followed(app, message_type, node_config, train, secure_round=secagg_stage is not None, secagg=secagg)
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


def _secure_content(
    app: NodeApp, message_type: str, stage: str, checked: SecAggStage | None, node_config: Mapping[str, Any]
) -> Verdict | None:
    """SecAgg+ content is answered only by a ``train`` message in the protocol's masked-vector stage.

    The project's ClientApp wraps ``secaggplus_mod``, and so does ``checked_secaggplus_mod``: each stage's
    parameters are checked (`stage_refusal()`), the protocol's other stages go to ``secaggplus_mod`` alone
    (they train nothing). ``dp_mod`` is called by ``secaggplus_mod``, only in that stage: anything else
    bypassed the protocol (``secaggplus_mod`` passes a ``train.<action>`` message through unmasked).
    """
    before_secaggplus = checked is not None and checked.configs is not None
    if app.own_handlers or before_secaggplus:
        if stage == BYPASSED:
            return _refuse("refused: SecAgg+ content outside the protocol's masked-vector stage")
        if message_type != MessageType.TRAIN:
            return _refuse(
                f"refused: a {message_type!r} message with SecAgg+ content; SecAgg+ rounds are answered only as "
                "'train' messages inside the protocol, whose masked-vector stage masks the vector"
            )
        if before_secaggplus:
            reason = stage_refusal(node_policy(node_config), checked)  # type: ignore[arg-type]
            if reason is not None:
                return _refuse(reason)
        return None if stage == Stage.COLLECT_MASKED_VECTORS else Verdict(Route.PROTOCOL)
    if message_type != MessageType.TRAIN or stage != Stage.COLLECT_MASKED_VECTORS:
        return _refuse(
            f"refused: a {message_type!r} message with SecAgg+ content outside the protocol's masked-vector stage "
            "(only a 'train' message through secaggplus_mod is answered; its vector is masked)"
        )
    return None


def _secagg_checked(app: NodeApp, policy: NodePolicy, ins: RoundInstructions, checked: SecAggStage | None) -> bool:
    """Whether this SecAgg+ round's stages were checked (`stage_refusal()`), the setup's cohort being the ``|S_k|``
    this node's noise share is computed for (recorded in the ledger's entry; its server account still charges this
    node's own share: the server decides who is dropped, `dpfedavg.privacy.node_accounts`).

    In the masked-vector stage, before the release is charged: ``RoundRefused`` for another cohort, and for a
    round whose earlier stages this node did not check (Flower's own ``secaggplus_mod`` around ``dp_mod``) under a
    node policy; without one such a round is answered with a warning (``False``: the node's own share).
    """
    cohort = admitted_cohort(None if checked is None else checked.record)
    if cohort is None:
        if app.own_handlers or policy.active:
            raise RoundRefused(
                "SecAgg+ stages", "this node did not check the protocol's stages before its masked vector (use "
                "ClientApp(mods=[checked_secaggplus_mod, dp_mod]), not Flower's secaggplus_mod, under a node policy)",
                policy=False, where="this node",
            )  # fmt: skip
        logging.getLogger(app.logger).warning(
            "%s: the SecAgg+ stages were not checked by this node (use checked_secaggplus_mod in place of "
            "secaggplus_mod)", app.name,
        )  # fmt: skip
        return False
    if cohort != ins.cohort_size:
        raise RoundRefused(
            "SecAgg+ cohort", f"the SecAgg+ setup has {cohort} nodes (sample_num), the round's instructions |S_k| = "
            f"{ins.cohort_size}: this node's noise share is computed for |S_k|", policy=False, where="this node",
        )  # fmt: skip
    return True


def _followed(
    app: NodeApp,
    message_type: str,
    node_config: Mapping[str, Any],
    train: TrainRequest,
    *,
    secure_round: bool,
    secagg: SecAggStage | None = None,
) -> RoundInstructions:
    """The round's instructions read strictly, checked (`check_round()`, the SecAgg+ cohort) and charged to the
    node's ledger."""
    policy = node_policy(node_config)
    if app.own_handlers:
        try:
            ins = RoundInstructions.from_config(train.config)  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise RoundRefused("instructions", f"the round's instructions do not parse ({type(err).__name__}: "
                               f"{err})", policy=False) from None  # fmt: skip
        followed = check_round(policy, ins, secure_round=secure_round, cfg=train.cfg)
    else:
        ins, terms = _public_round(train.config)
        followed = check_round(policy, ins, secure_round=secure_round, public=terms)
    checked = secure_round and _secagg_checked(app, policy, followed, secagg)
    record_release(
        node_config, train.run_id, followed, train.cfg, message_type=message_type, secure_aggregation=checked,
        clients=train.clients,
    )  # fmt: skip
    if followed.noise_seed != ins.noise_seed and train.run_id not in _SEEDED_RUNS_WARNED:
        _SEEDED_RUNS_WARNED.add(train.run_id)
        logging.getLogger(app.logger).warning(
            "run %s: this node draws its noise from the OS (its policy: %s), but the server runs seeded (its run "
            "config has secure-noise = false): the server's seed is not used here, yet the run's sampling and the "
            "server's own noise stay reproducible from it. The server cannot read this node's policy: set "
            "secure-noise = true in the run config too", train.run_id, ", ".join(policy.floors),
        )  # fmt: skip
    return followed


#: Runs whose seeded server this node has warned about (once per run: `_followed()`).
_SEEDED_RUNS_WARNED: set[int] = set()


def _public_round(config: Mapping[str, Any] | None) -> tuple[RoundInstructions, PublicTerms]:
    """``dp_mod``'s round: the instructions and the public terms of its train config.

    ``ValueError`` saying which key is missing (the server is not DPFedAvg's); ``RoundRefused`` naming the value
    that does not parse.
    """
    try:
        ins = RoundInstructions.from_config(config)  # type: ignore[arg-type]
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
