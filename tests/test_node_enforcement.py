"""A malicious server against the node's one enforcement point: every message type, its own noise, partial policies.

Both clients are driven through `InProcessGrid` as Flower routes messages: dpfedavg's
own ClientApp (`dpfedavg.flower.client_app.app`) and a small user app built here with `dpfedavg.dp_mod()`,
as an app-level mod and per handler. Each test is named by the attack; a refusal is an error reply, and whatever is
answered is checked against a closed form computed here (the noise std ``z C / sqrt(|S_k|)``, the clipped update).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import FitIns, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat

from dpfedavg import checked_secaggplus_mod, dp_mod
from dpfedavg.config import RunConfig
from dpfedavg.flower.client_app import app as own_app
from dpfedavg.flower.mod import ARRAY_KEYS, CLIENT_ID, public_parameters
from dpfedavg.flower.protocol import ARRAYS, CONFIG, REFUSED, instructions_to_config_record, to_array_record
from dpfedavg.flower.testing import InProcessGrid
from dpfedavg.privacy.policy import NodePolicy, PolicyError
from dpfedavg.server.dp_server import DPServer

DIM = 20
#: The own ClientApp's run (the quadratic task), as in tests/test_hostile_server.py.
BASE = {"task": "quadratic", "dim": DIM, "num-clients": 8, "clients-per-round": 4.0, "num-rounds": 5,
        "epsilon": 0.0, "noise-multiplier": 1.0, "delta": 1e-5, "algorithm": "clip", "clip": 3.0, "seed": 1,
        "checkpoint-every": 0}  # fmt: skip
#: The user app's run (dp_mod): z = 2, C = 1, r = 5, |S_k| = 5, so each client's share is 2 / sqrt(5).
USER = {"algorithm": "clip", "clip": 1.0, "num_clients": 10, "clients_per_round": 5.0, "epsilon": 0.0,
        "noise_multiplier": 2.0, "server_lr": 1.0}  # fmt: skip
USER_DIM = 4000
#: The strictest policy of the deployment page (what a careful operator sets).
STRICT = {"secure-noise": True, "min-noise-multiplier": 1.0, "min-update-noise-multiplier": 0.5, "max-clip": 100.0,
          "allowed-algorithms": "clip,norm,adaptive-clip", "allow-diagnostics": False}  # fmt: skip
TRAIN_TYPES = ["train", "train.default", "train.finetune"]
OTHER_TYPES = ["evaluate", "evaluate.x", "query", "query.x"]
#: Ten validation labels per class count: the node's private label histogram.
LABELS = np.repeat(np.arange(10), [3, 0, 7, 1, 4, 4, 9, 2, 0, 5])


# ------------------------------------------------------------------ the user's app with dp_mod
def _user_train(msg: Message, context) -> Message:
    """The user's training: every weight moves by +0.001 (u = -0.001, ||u|| = 0.063 < C: not clipped)."""
    w = msg.content[ARRAYS]["w"].numpy() + 0.001
    reply = RecordDict({ARRAYS: ArrayRecord({"w": Array(w)}), "metrics": MetricRecord({"num-examples": 7})})
    return Message(reply, reply_to=msg)


def _user_evaluate(msg: Message, context) -> Message:
    """Accuracy of the model's constant prediction ``argmax(b)`` on the node's validation labels."""
    prediction = int(np.argmax(msg.content[ARRAYS]["b"].numpy()))
    metrics = MetricRecord({"accuracy": float(np.mean(LABELS == prediction)), "num-examples": len(LABELS)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


def _user_query(msg: Message, context) -> Message:
    return Message(RecordDict({"metrics": MetricRecord({"labels": [int(v) for v in LABELS]})}), reply_to=msg)


def user_app(level: str, secagg: bool = False) -> ClientApp:
    """A user's app: dp_mod app-level (``"app"``, the safe pattern) or on each train handler (``"handler"``)."""
    outer = [checked_secaggplus_mod, dp_mod] if secagg else [dp_mod]
    app = ClientApp(mods=outer) if level == "app" else ClientApp()
    mods = [] if level == "app" else outer
    app.train(mods=mods)(_user_train)
    app.train("finetune", mods=mods)(_user_train)
    app.evaluate()(_user_evaluate)
    app.evaluate("x")(_user_evaluate)
    app.query()(_user_query)
    app.query("x")(_user_query)
    return app


def _user_config(**changes) -> ConfigRecord:
    """Round 2's train config as DPFedAvg sends it (instructions, public parameters, client id, the user's lr)."""
    cfg = RunConfig(**USER)
    ins = dataclasses.replace(DPServer(cfg, USER_DIM).instructions(2, 5))
    config = instructions_to_config_record(ins)
    for key, value in {**public_parameters(cfg), CLIENT_ID: 3, "lr": 0.05}.items():
        config[key] = value
    for key, value in changes.items():
        config[key] = value
    return config


def _send(app, message_type: str, content: RecordDict, node_config: dict | None = None) -> Message:
    grid = InProcessGrid(app, 1, {}, node_config=node_config)
    node = next(iter(grid.contexts))
    msg = Message(content, dst_node_id=node, message_type="train")
    msg.metadata.__dict__["_message_type"] = message_type  # any string a SuperLink may send
    (reply,) = grid.send_and_receive([msg])
    return reply


def _user_train_message(**changes) -> RecordDict:
    return RecordDict({ARRAYS: ArrayRecord({"w": Array(np.zeros(USER_DIM))}), CONFIG: _user_config(**changes)})


def _assert_private(reply: Message) -> None:
    """The reply is ``g + zeta`` only: ``g = -0.001`` (not clipped) plus N(0, (zC)^2/|S_k|) per coordinate."""
    assert not reply.has_error(), reply.error.reason
    assert list(reply.content[ARRAYS]) == ["update"]  # not the user's raw weights
    noise = reply.content[ARRAYS]["update"].numpy() + 0.001
    own = 2.0 * 1.0 / np.sqrt(5)
    assert abs(noise.std() / own - 1) < 0.05  # 4000 draws: the sample std is within ~2.2% (2 sigma)


def _assert_refused(reply: Message, *fragments: str) -> str:
    assert reply.has_error(), "the node answered a message it must refuse"
    reason = reply.error.reason or ""
    for fragment in fragments:
        assert fragment in reason, reason
    return reason


@pytest.mark.parametrize("level", ["app", "handler"])
@pytest.mark.parametrize("message_type", TRAIN_TYPES)
def test_train_with_any_action_is_privatised_by_dp_mod(level: str, message_type: str) -> None:
    """``train.default`` / ``train.finetune`` routed to the user's handler: the reply is g + zeta, not its weights."""
    _assert_private(_send(user_app(level), message_type, _user_train_message()))
    _assert_private(_send(user_app(level), message_type, _user_train_message(), STRICT))


@pytest.mark.parametrize("message_type", [*OTHER_TYPES, "train.unregistered"])
def test_evaluate_query_and_unknown_messages_are_refused_by_dp_mod_under_a_policy(message_type: str) -> None:
    """App-level dp_mod under the strict policy: no reply computed by the user's evaluate or query handlers."""
    reply = _send(user_app("app"), message_type, _user_train_message(), STRICT)
    assert reply.has_error()
    if message_type.startswith("evaluate"):
        _assert_refused(reply, "allow-evaluate")
    assert reply.error.code == REFUSED or message_type == "train.unregistered"  # Flower: no such handler


def test_a_message_type_flower_cannot_route_reaches_no_handler() -> None:
    """``bogus`` (no category): Flower's routing raises before any mod or handler runs, in both clients."""
    grid = InProcessGrid(own_app, 1, _cfg().to_run_config(), node_config=STRICT)
    context = next(iter(grid.contexts.values()))
    for app in (own_app, user_app("app")):
        msg = Message(_user_train_message(), dst_node_id=context.node_id, message_type="train")
        msg.metadata.__dict__["_message_type"] = "bogus"
        with pytest.raises(ValueError, match="Invalid message type"):
            app(msg, context)


def test_without_a_policy_dp_mod_lets_evaluate_and_query_through() -> None:
    """No policy: Flower's behaviour is kept (the user's handlers answer)."""
    content = RecordDict({ARRAYS: ArrayRecord({"b": Array(np.eye(10)[2])})})
    assert _send(user_app("app"), "evaluate", content).content["metrics"]["accuracy"] == pytest.approx(7 / 35)
    assert not _send(user_app("app"), "query", RecordDict()).has_error()


def test_evaluate_histogram_attack_is_refused_under_a_policy_and_answered_with_allow_evaluate() -> None:
    """Ten crafted models (model j predicts class j) recover the node's exact label histogram from its accuracies,
    as long as evaluate is answered; under the strict policy every one is refused."""

    def attack(node_config: dict) -> list[Message]:
        return [_send(user_app("app"), "evaluate", RecordDict({ARRAYS: ArrayRecord({"b": Array(np.eye(10)[j])})}),
                      node_config) for j in range(10)]  # fmt: skip

    for reply in attack(STRICT):
        _assert_refused(reply, "allow-evaluate")
    answered = attack({**STRICT, "allow-evaluate": True})
    recovered = [round(r.content["metrics"]["accuracy"] * r.content["metrics"]["num-examples"]) for r in answered]
    assert recovered == np.bincount(LABELS, minlength=10).tolist()  # what allow-evaluate leaks, exactly


def test_nested_dp_mod_privatises_once() -> None:
    """dp_mod both at the app level and on the handler: one g + zeta (the inner one passes the message on)."""
    app = ClientApp(mods=[dp_mod])
    app.train(mods=[dp_mod])(_user_train)
    _assert_private(_send(app, "train", _user_train_message()))


# ------------------------------------------------------------------ server-chosen noise (dp_mod)
@pytest.mark.parametrize(
    ("changes", "node_config", "rule"),
    [
        ({"noise-std": 0.0}, {"secure-noise": True}, "noise-std"),
        ({"noise-std": "1e-400"}, {"min-noise-multiplier": 1.0}, "noise-std"),
        ({"noise-std": -0.0}, {"secure-noise": True}, "noise-std"),
        ({"noise-std": 0.0}, {"min-noise-multiplier": 1.0}, "noise-std"),
        ({"noise-std": 0.0}, None, "noise-std"),
        ({"noise-multiplier": "nan"}, {"min-noise-multiplier": 1.0}, "noise-multiplier"),
        ({"noise-multiplier": float("nan")}, {"min-noise-multiplier": 1.0}, "noise-multiplier"),
        (
            {"algorithm": "none", "noise-std": 0.0, "noise-multiplier": 0.0},
            {"min-update-noise-multiplier": 0.5},
            "min-update-noise-multiplier",
        ),
        ({"diagnostics": "false"}, None, "diagnostics"),
        ({"noise-placement": "server", "noise-std": 0.0}, {"secure-noise": True}, "allow-server-noise"),
        (
            {"noise-placement": "client", "clients-per-round": 1e12, "noise-std": 2.0 / 1e6},
            {"min-update-noise-multiplier": 0.5},
            "min-update-noise-multiplier",
        ),
    ],
    ids=[
        "std-0-secure-noise",
        "std-1e-400-min-z",
        "std-minus-0-secure-noise",
        "z-2-std-0-min-z",
        "std-0-no-policy",
        "z-nan-string",
        "z-nan-float",
        "algorithm-none-min-update-z",
        "diagnostics-string-false",
        "server-placement-secure-noise",
        "huge-r",
    ],
)
def test_server_chosen_noise_is_refused_by_dp_mod(changes: dict, node_config: dict | None, rule: str) -> None:
    """The client computes its own std from z, C, r, |S_k| and the placement; the server's values only compare."""
    for message_type in ("train", "train.finetune"):
        _assert_refused(_send(user_app("app"), message_type, _user_train_message(**changes), node_config), rule)


def test_secagg_content_outside_the_protocol_is_refused_by_dp_mod() -> None:
    """SecAgg+ content as ``train.default`` passes through (checked_)secaggplus_mod: dp_mod must not answer it."""
    cfg = RunConfig(**{**USER, "secure_aggregation": True, "delta": 1e-5, "secagg_clip_stds": 12.0})
    config = dict(_user_config())
    config.update(instructions_to_config_record(DPServer(cfg, USER_DIM).instructions(2, 5)))
    config[ARRAY_KEYS] = '["w"]'
    content = compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters([np.zeros(USER_DIM)]), config), True)
    content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord({})
    for level in ("app", "handler"):
        for message_type in ("train.default", "train.finetune"):
            reply = _send(user_app(level, secagg=True), message_type, content)
            _assert_refused(reply, "masked-vector stage")


# ------------------------------------------------------------------ dpfedavg's own ClientApp
def _cfg(**overrides) -> RunConfig:
    return RunConfig.from_run_config({**BASE, **overrides})


def _own(cfg: RunConfig, message_type: str, content: RecordDict, node_config: dict | None = None) -> Message:
    grid = InProcessGrid(own_app, cfg.num_clients, cfg.to_run_config(), node_config=node_config)
    node = next(iter(grid.contexts))
    msg = Message(content, dst_node_id=node, message_type="train")
    msg.metadata.__dict__["_message_type"] = message_type
    (reply,) = grid.send_and_receive([msg])
    return reply


def _own_train(cfg: RunConfig, **changes) -> RecordDict:
    ins = dataclasses.replace(DPServer(cfg, DIM).instructions(2, 4), **changes)
    return RecordDict({ARRAYS: to_array_record(np.zeros(DIM)), CONFIG: instructions_to_config_record(ins)})


@pytest.mark.parametrize("message_type", ["train", "train.default"])
def test_every_train_type_to_the_own_clientapp_is_checked(message_type: str) -> None:
    """Both train types reach the one train path: honest rounds are answered with noise, a noise-std 0 is refused."""
    cfg = _cfg()
    honest = _own(cfg, message_type, _own_train(cfg), STRICT)
    assert not honest.has_error(), honest.error.reason
    _assert_refused(_own(cfg, message_type, _own_train(cfg, noise_std=0.0), STRICT), "noise-std")


@pytest.mark.parametrize("message_type", ["evaluate", "evaluate.x", "query.x", "train.finetune"])
def test_evaluate_and_unknown_messages_get_no_reply_from_the_own_clientapp(message_type: str) -> None:
    cfg = _cfg()
    assert _own(cfg, message_type, _own_train(cfg), STRICT).has_error()


def test_partition_query_reveals_the_partition_id_only() -> None:
    cfg = _cfg()
    reply = _own(cfg, "query", RecordDict({CONFIG: ConfigRecord({"query": "partition"})}), STRICT)
    assert dict(reply.content["metrics"]).keys() == {"partition-id", "num-partitions"}


def _secagg_content(cfg: RunConfig, stage: str | None) -> RecordDict:
    ins = DPServer(cfg, DIM).instructions(2, 4)
    fitins = FitIns(ndarrays_to_parameters([np.zeros(DIM)]), dict(instructions_to_config_record(ins)))
    content = compat.fitins_to_recorddict(fitins, True)
    content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord({} if stage is None else {Key.STAGE: stage})
    return content


@pytest.mark.parametrize("stage", [None, Stage.COLLECT_MASKED_VECTORS])
@pytest.mark.parametrize("message_type", ["train.default", "train"])
def test_secagg_content_as_train_default_gets_no_unmasked_vector_from_the_own_clientapp(
    message_type: str, stage: str | None
) -> None:
    """Flower's secaggplus_mod passes ``train.default`` through: the node must refuse it, not send its vector.

    As ``train``, the same content out of the protocol's order is an error of Flower's mod: no vector either.
    """
    cfg = _cfg(**{"secure-aggregation": True})
    reply = _own(cfg, message_type, _secagg_content(cfg, stage))
    assert reply.has_error(), "the node sent its SecAgg+ vector outside the protocol"
    if message_type == "train.default":
        _assert_refused(reply, "SecAgg+")


@pytest.mark.parametrize(
    ("overrides", "node_config", "rule"),
    [
        ({"noise-placement": "server"}, {"secure-noise": True}, "allow-server-noise"),
        ({"noise-multiplier": 0.0}, {"secure-noise": True}, "secure-noise"),
        ({"algorithm": "none", "noise-multiplier": 0.0}, {"secure-noise": True}, "secure-noise"),
        ({"noise-placement": "server"}, {"secure-noise": True, "min-noise-multiplier": 0.5}, "allow-server-noise"),
        (
            {"algorithm": "none", "noise-multiplier": 0.0},
            {"min-update-noise-multiplier": 0.5},
            "min-update-noise-multiplier",
        ),
    ],
    ids=[
        "secure-noise-server-placement",
        "secure-noise-z-0",
        "secure-noise-algorithm-none",
        "secure-noise-min-z-server-placement",
        "min-update-z-algorithm-none",
    ],
)
def test_partial_policy_never_sends_an_un_noised_update(overrides: dict, node_config: dict, rule: str) -> None:
    """The run config (the server's) asks for a round without the client's noise: a policy with secure-noise or a
    floor refuses it, in the own ClientApp and in dp_mod alike."""
    cfg = _cfg(**overrides)
    _assert_refused(_own(cfg, "train", _own_train(cfg), node_config), rule)


def test_allow_server_noise_lets_a_secure_noise_node_take_part_in_central_dp() -> None:
    cfg = _cfg(**{"noise-placement": "server"})
    reply = _own(cfg, "train", _own_train(cfg), {"secure-noise": True, "allow-server-noise": True})
    assert not reply.has_error(), reply.error.reason
    config = {"noise-placement": "server", "noise-std": 0.0}
    allowed = {"secure-noise": True, "allow-server-noise": True}
    assert not _send(user_app("app"), "train", _user_train_message(**config), allowed).has_error()


# ------------------------------------------------------------------ strict node-config parsing
@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("min-noise-multiplier", "1e-400", "a number >= 0"),
        ("min-noise-multiplier", "nan", "a number >= 0"),
        ("max-clip", "inf", "a number > 0"),
        ("max-epsilon", float("inf"), "a number > 0"),
        ("min-update-noise-multiplier", "-1e-400", "a number >= 0"),
        ("secure-noise", "yes", "true or false"),
        ("secure-noise", 1, "true or false"),
        ("secure-noise", "TRUE", "true or false"),
        ("allow-diagnostics", "false ", "true or false"),
        ("allow-evaluate", 0, "true or false"),
    ],
)
def test_node_config_parsing_is_strict(key: str, value: object, allowed: str) -> None:
    """A value that would turn a rule off or be guessed at is one error naming the key, the value and the allowed."""
    with pytest.raises(PolicyError) as err:
        NodePolicy.from_node_config({key: value})
    assert f"'{key}' = {value!r}" in str(err.value) and allowed in str(err.value)


def test_a_node_config_that_underflows_refuses_every_message_in_both_clients() -> None:
    cfg = _cfg()
    _assert_refused(_own(cfg, "train", _own_train(cfg), {"min-noise-multiplier": "1e-400"}), "'1e-400'")
    _assert_refused(_send(user_app("app"), "train", _user_train_message(), {"min-noise-multiplier": "1e-400"}),
                    "'1e-400'")  # fmt: skip
    assert NodePolicy.from_node_config({"secure-noise": "true", "min-noise-multiplier": "0.5"}).secure_noise


def test_the_safe_pattern_finishes_a_run_under_the_strict_policy(monkeypatch) -> None:
    """App-level dp_mod, every node with a policy that demands noise: DPFedAvg's honest rounds are all answered
    (it evaluates on the server only and sends no evaluate message), so the ServerApp finishes its run."""
    from dpfedavg import DPFedAvg

    monkeypatch.setattr(DPFedAvg, "settle_seconds", 0.05)
    policy = {"secure-noise": True, "min-noise-multiplier": 0.5, "max-clip": 10.0, "allow-diagnostics": False}
    strategy = DPFedAvg(algorithm="clip", clip=1.0, epsilon=0.0, noise_multiplier=1.0, clients_per_round=3.0,
                        secure_noise=True)  # fmt: skip
    grid = InProcessGrid(user_app("app"), 6, {}, node_config=policy)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord({"w": Array(np.zeros(50))}), num_rounds=3,
                            train_config=ConfigRecord({"lr": 0.05}))  # fmt: skip
    stats = [strategy.history[k] for k in (1, 2, 3)]
    assert [(s.num_received, s.num_rejected, s.num_failed) for s in stats] == [(s.num_sampled, 0, 0) for s in stats]
    assert np.all(np.isfinite(result.arrays["w"].numpy()))
    assert not [m for m in grid.sent if m.metadata.message_type.startswith("evaluate")]


# ------------------------------------------------------------------ red team after the merge (issue 36)
#: Policies with one floor and no secure-noise: each promises that the node never sends an un-noised update.
FLOOR_ONLY = [{"min-noise-multiplier": 0.5}, {"max-clip": 10.0}]


def _update(reply: Message) -> np.ndarray:
    assert not reply.has_error(), reply.error.reason
    return reply.content[ARRAYS]["update"].numpy()


@pytest.mark.parametrize("floor", FLOOR_ONLY, ids=["min-z", "max-clip"])
def test_diagnostics_asked_of_a_node_with_only_a_floor_get_no_clean_update(floor: dict) -> None:
    """``diagnostics = true`` in the run config: a node whose policy states a floor (no secure-noise) must not send
    the clean update beside the noised one, in both clients; the operator may still allow it explicitly."""
    cfg = _cfg(diagnostics=True)
    _assert_refused(_own(cfg, "train", _own_train(cfg), floor), "allow-diagnostics")
    _assert_refused(_send(user_app("app"), "train", _user_train_message(diagnostics=True), floor), "allow-diagnostics")
    allowed = _own(cfg, "train", _own_train(cfg), {**floor, "allow-diagnostics": True})
    assert "diagnostics" in allowed.content  # the operator's explicit choice


@pytest.mark.parametrize("floor", FLOOR_ONLY, ids=["min-z", "max-clip"])
def test_a_node_with_only_a_floor_draws_noise_the_server_cannot_replay(floor: dict) -> None:
    """Seeded run, a node with a floor but not secure-noise: the noise must not come from the server's seed.

    With the server's seed the server regenerates zeta: two replies to the same seed differ by exactly the
    difference of the clean updates (here 0), so it reads each clean update. The node's own noise makes the
    difference of two replies N(0, 2 s^2) per coordinate (checked to 10% over 4000 / 20 coordinates: far from 0).
    """
    cfg = _cfg()
    first, second = (_own(cfg, "train", _own_train(cfg), floor) for _ in range(2))
    s = 1.0 * 3.0 / np.sqrt(4)  # z C / sqrt(|S_k|)
    assert np.linalg.norm(_update(first) - _update(second)) > 0.5 * s * np.sqrt(2 * DIM)
    assert "update-norm" not in first.content["metrics"]  # an un-noised statistic of the node's data
    replies = [_send(user_app("app"), "train", _user_train_message(**{"server-round": k}), floor) for k in (2, 3)]
    difference = _update(replies[0]) - _update(replies[1])
    assert abs(difference.std() / (np.sqrt(2) * 2.0 / np.sqrt(5)) - 1) < 0.1
    assert "update-norm" not in replies[0].content["metrics"]


def _user_train_reporting_accuracy(msg: Message, context) -> Message:
    """A common train function: it reports a metric of its data at the model it received (with the server's
    ``lr = 0`` the model does not move): the accuracy of the constant prediction ``argmax(b)``."""
    b = msg.content[ARRAYS]["b"].numpy()
    accuracy = float(np.mean(LABELS == int(np.argmax(b))))
    metrics = MetricRecord({"accuracy": accuracy, "num-examples": len(LABELS)})
    return Message(RecordDict({ARRAYS: ArrayRecord({"b": Array(b + 0.001)}), "metrics": metrics}), reply_to=msg)


def test_train_metrics_histogram_attack_is_refused_under_a_policy() -> None:
    """The evaluate histogram attack sent as train messages: ten crafted models, the user's train metrics (its
    accuracy at the received model) would give the node's exact label histogram. Under a policy the privatised
    reply carries no metric of the user's (num-examples is 1); without one they pass as before."""
    app = ClientApp(mods=[dp_mod])
    app.train()(_user_train_reporting_accuracy)

    def attack(node_config: dict | None) -> list[Message]:
        config = _user_config(lr=0.0)
        return [_send(app, "train", RecordDict({ARRAYS: ArrayRecord({"b": Array(np.eye(10)[j])}), CONFIG: config}),
                      node_config) for j in range(10)]  # fmt: skip

    for reply in attack(STRICT):
        assert not reply.has_error(), reply.error.reason
        assert dict(reply.content["metrics"]) == {"num-examples": 1}
    open_node = attack(None)
    recovered = [round(r.content["metrics"]["accuracy"] * r.content["metrics"]["num-examples"]) for r in open_node]
    assert recovered == np.bincount(LABELS, minlength=10).tolist()  # what a node without a policy leaks


#: The curvature of the node's data: gradient descent at the server's lr diverges iff lr > 2 / L = 0.54.
CURVATURE = 3.7


def _user_train_gradient_descent(msg: Message, context) -> Message:
    """1000 steps of gradient descent at the server's ``lr`` on ``L / 2 ||w - 1||^2`` (NaN for lr = 1 > 2 / L)."""
    w = msg.content[ARRAYS]["w"].numpy().copy()
    lr = float(msg.content[CONFIG]["lr"])
    with np.errstate(over="ignore", invalid="ignore"):
        for _ in range(1000):
            w = w - lr * CURVATURE * (w - 1.0)
    return Message(RecordDict({ARRAYS: ArrayRecord({"w": Array(w)})}), reply_to=msg)


def test_divergence_at_the_servers_learning_rate_tells_the_server_nothing_under_a_policy() -> None:
    """The server bisects ``lr`` over rounds: which ``lr`` makes the node's training diverge gives its data's
    curvature (2 / L = 0.54) to any precision, without noise, while divergence is an error reply. Under a policy
    both replies are ``g + zeta`` (``g = 0`` where it diverged), in dp_mod and in the own ClientApp."""
    app = ClientApp(mods=[dp_mod])
    app.train()(_user_train_gradient_descent)
    converged, diverged = (_send(app, "train", _user_train_message(lr=lr), STRICT) for lr in (0.5, 1.0))
    assert np.linalg.norm(_update(converged)) > 0
    assert abs(_update(diverged).std() / (2.0 / np.sqrt(5)) - 1) < 0.05  # 0 + N(0, (zC)^2 / |S_k|), 4000 draws
    assert _send(app, "train", _user_train_message(lr=1.0)).has_error()  # no policy: reported, as before
    cfg = _cfg(**{"local-lr": 1e100})  # the quadratic task diverges at this eta_k
    assert np.all(np.isfinite(_update(_own(cfg, "train", _own_train(cfg), STRICT))))
    assert _own(cfg, "train", _own_train(cfg)).has_error()


def test_divergence_of_virtual_clients_tells_the_server_nothing_under_a_policy() -> None:
    """A SuperNode hosting clients 0 and 1 (clients-per-node = 2): under a policy neither diverged client is listed,
    each sends ``0 + zeta``; without one both are reported as diverged, as before."""
    from dpfedavg.flower.protocol import CLIENT_IDS, DIVERGED_CLIENT_IDS

    cfg = _cfg(**{"local-lr": 1e100, "clients-per-node": 2})

    def ask(node_config: dict | None) -> Message:
        grid = InProcessGrid(own_app, cfg.num_nodes, cfg.to_run_config(), node_config=node_config)
        node = next(n for n, c in grid.contexts.items() if c.node_config["partition-id"] == 0)
        content = _own_train(cfg)
        content[CONFIG][CLIENT_IDS] = [0, 1]
        (reply,) = grid.send_and_receive([Message(content, dst_node_id=node, message_type="train")])
        assert not reply.has_error(), reply.error.reason
        return reply

    private = ask({**STRICT, "allow-virtual-clients": True})  # refused without it (test_node_accounts.py)
    assert DIVERGED_CLIENT_IDS not in private.content["metrics"] and len(private.content[ARRAYS]) == 2
    noise = np.concatenate([a.numpy() for a in private.content[ARRAYS].values()])
    assert np.all(np.isfinite(noise)) and np.linalg.norm(noise) > 0
    assert list(ask(None).content["metrics"][DIVERGED_CLIENT_IDS]) == [0, 1]
