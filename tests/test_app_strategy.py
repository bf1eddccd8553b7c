"""DP for a Flower app the user already has: ``dp_mod`` around their train function, ``DPFedAvg`` (keywords) in
their ServerApp, on their own arrays. No Ray: the apps run through an in-process Grid."""

from __future__ import annotations

import logging
import math
import re
from dataclasses import replace

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.app.error import Error
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from dpfedavg import ConfigError, DPFedAvg, InProcessGrid, RunConfig, TrainingStopped, dp_mod
from dpfedavg.core import Stream, make_rng, poisson_sample
from dpfedavg.flower.app_strategy import AppDPFedAvg
from dpfedavg.flower.arrays import ArrayLayout, LayoutMismatch
from dpfedavg.flower.mod import CLIENT_ID, public_parameters
from dpfedavg.flower.protocol import REFUSED, instructions_to_config_record
from dpfedavg.flower.testing import ensure_task_identity
from dpfedavg.io.metrics import RoundStats
from dpfedavg.server.dp_server import DPServer
from dpfedavg.server.health import ReplyHealth

W_STAR = np.random.default_rng(7).normal(size=7)  # the model: a 2x3 weight and a bias of 1


def initial_arrays() -> ArrayRecord:
    """A user's model: a float32 matrix and vector, and an integer buffer (kept as it is)."""
    return ArrayRecord(
        {
            "layer.weight": Array(np.zeros((2, 3), dtype=np.float32)),
            "layer.bias": Array(np.zeros(1, dtype=np.float32)),
            "bn.num_batches_tracked": Array(np.array(0, dtype=np.int64)),
        }
    )


def weights_of(arrays: ArrayRecord) -> np.ndarray:
    """The user's own view of its model: weight then bias, as one vector (not dpfedavg's sorted order)."""
    return np.concatenate([arrays["layer.weight"].numpy().ravel(), arrays["layer.bias"].numpy()]).astype(np.float64)


def numpy_train(msg: Message, context: Context) -> Message:
    """A numpy-only client: a few least-squares gradient steps on its own data, new weights back (no gradients)."""
    pid = int(context.node_config["partition-id"])
    arrays = msg.content["arrays"]
    w = weights_of(arrays)
    x = np.random.default_rng(100 + pid).normal(size=(30, w.size))
    y = x @ W_STAR
    for _ in range(5):
        w = w - float(msg.content["config"]["lr"]) * x.T @ (x @ w - y) / len(y)
    out = ArrayRecord(
        {
            "layer.weight": Array(w[:6].reshape(2, 3).astype(np.float32)),
            "layer.bias": Array(w[6:].astype(np.float32)),
            "bn.num_batches_tracked": Array(np.array(5, dtype=np.int64)),
        }
    )
    metrics = MetricRecord({"train_loss": float(np.mean((x @ w - y) ** 2)), "num-examples": 30})
    return Message(RecordDict({"arrays": out, "metrics": metrics}), reply_to=msg)


def client_app(wrapped: bool = True) -> ClientApp:
    app = ClientApp()
    app.train(mods=[dp_mod] if wrapped else [])(numpy_train)
    return app


def grid(app, n: int = 10, **kwargs) -> InProcessGrid:
    return InProcessGrid(app, n, {}, **kwargs)


@pytest.fixture(autouse=True)
def _quick_start(monkeypatch) -> None:
    """The in-process grid has every node from the start: no need to wait for the count to settle."""
    monkeypatch.setattr(AppDPFedAvg, "settle_seconds", 0.05)


def lr() -> ConfigRecord:
    """The user's train config (a fresh one: Flower's FedAvg writes 'server-round' into the one it is given)."""
    return ConfigRecord({"lr": 0.05})


# ------------------------------------------------------------------ the mod
def _train_message(arrays: ArrayRecord, **settings) -> Message:
    """A TRAIN message as AppDPFedAvg sends it: the user's arrays, round 2's instructions, the user's lr."""
    ensure_task_identity()
    values = {"algorithm": "clip", "clip": 1.0, "num_clients": 10, "clients_per_round": 5.0, "epsilon": 0.0,
              "server_lr": 1.0, **settings}  # fmt: skip
    cfg = RunConfig(**values)
    server = DPServer(cfg, ArrayLayout.of(arrays).dim)
    config = instructions_to_config_record(server.instructions(2, 5))
    config["lr"], config[CLIENT_ID] = 0.05, 3
    for key, value in public_parameters(cfg).items():
        config[key] = value
    return Message(RecordDict({"arrays": arrays, "config": config}), dst_node_id=5, message_type=MessageType.TRAIN)


def _call(mod_msg: Message, next_fn, node_config=None) -> Message:
    context = Context(run_id=1, node_id=5, node_config={"partition-id": 2, **(node_config or {})}, state=RecordDict(),
                      run_config={})  # fmt: skip
    return dp_mod(mod_msg, context, next_fn)


def test_evaluate_and_query_messages_pass_untouched() -> None:
    ensure_task_identity()
    seen = []

    def inner(msg, context):
        seen.append(msg)
        return "the user's reply"

    for kind in (MessageType.EVALUATE, MessageType.QUERY):
        msg = Message(RecordDict({"arrays": initial_arrays()}), dst_node_id=5, message_type=kind)
        assert _call(msg, inner) == "the user's reply"
        assert seen[-1] is msg


@pytest.mark.parametrize("algorithm", ["clip", "norm"])
def test_the_reply_is_the_bounded_pseudo_gradient_and_the_users_metrics_pass(algorithm: str) -> None:
    """Noise off: the update is w_k - w_new of the floating arrays in sorted key order, clipped / normalized."""
    msg = _train_message(initial_arrays(), noise_multiplier=0.0, algorithm=algorithm)
    reply = _call(msg, numpy_train)
    assert not reply.has_error()
    expected_new = numpy_train(msg, Context(1, 5, {"partition-id": 2}, RecordDict(), {})).content["arrays"]
    # sorted keys: layer.bias before layer.weight
    u = -np.concatenate([expected_new["layer.bias"].numpy().ravel(), expected_new["layer.weight"].numpy().ravel()])
    u = u.astype(np.float64)
    norm = np.linalg.norm(u)
    g = u * min(1.0, 1.0 / norm) if algorithm == "clip" else u / norm
    np.testing.assert_allclose(reply.content["arrays"]["update"].numpy(), g, rtol=1e-12, atol=1e-12)
    metrics = dict(reply.content["metrics"])
    assert metrics["train_loss"] > 0 and metrics["num-examples"] == 30
    assert metrics["update-norm"] == pytest.approx(norm)  # seeded mode only
    assert list(reply.content["arrays"]) == ["update"]


def test_the_client_adds_its_noise_share_and_a_node_can_demand_secure_noise() -> None:
    big = ArrayRecord({"w": Array(np.zeros(4000, dtype=np.float32))})

    def step(msg, context):
        w = msg.content["arrays"]["w"].numpy() + 0.001
        return Message(RecordDict({"arrays": ArrayRecord({"w": Array(w)}), "metrics": MetricRecord({})}), reply_to=msg)

    msg = _train_message(big, noise_multiplier=2.0, diagnostics=True)
    std = float(msg.content["config"]["noise-std"])
    assert std > 0
    replies = [_call(msg, step) for _ in range(2)]
    noise = [r.content["arrays"]["update"].numpy() - r.content["diagnostics"]["clean-update"].numpy() for r in replies]
    assert abs(noise[0].std() / std - 1) < 0.05
    np.testing.assert_array_equal(noise[0], noise[1])  # seeded: the same stream for the same (round, client)
    refused = _call(msg, step, {"secure-noise": "true"})  # such a node never sends the clean g by default
    assert refused.has_error() and refused.error.code == REFUSED and "allow-diagnostics" in refused.error.reason
    secure = [_call(msg, step, {"secure-noise": "true", "allow-diagnostics": "true"}) for _ in range(2)]
    fresh = [r.content["arrays"]["update"].numpy() for r in secure]
    assert not np.allclose(fresh[0], fresh[1])  # the node's own CSPRNG, whatever seed the server sent
    assert "update-norm" not in dict(secure[0].content["metrics"])  # no un-noised statistic leaves the node


def _reply_with(arrays: ArrayRecord):
    def fn(msg, context):
        return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord({})}), reply_to=msg)

    return fn


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("no-instructions", "the train config lacks"),
        ("missing-key", "missing 'layer.bias'"),
        ("extra-key", "unexpected 'other'"),
        ("shape", "'layer.weight' has shape (3, 2)"),
        ("dtype", "'layer.bias' has dtype int32"),
        ("nan", "diverged"),
        ("two-records", "2 ArrayRecords"),
        ("user-error", "the user's own error"),
    ],
)
def test_what_cannot_be_made_private_is_an_error_reply(case: str, reason: str) -> None:
    msg = _train_message(initial_arrays(), noise_multiplier=0.0)
    good = initial_arrays()
    fn = None
    if case == "no-instructions":
        msg = Message(RecordDict({"arrays": good, "config": ConfigRecord({"lr": 0.1})}), dst_node_id=5,
                      message_type=MessageType.TRAIN)  # fmt: skip
        fn = numpy_train
    elif case == "missing-key":
        fn = _reply_with(ArrayRecord({k: good[k] for k in ("layer.weight", "bn.num_batches_tracked")}))
    elif case == "extra-key":
        fn = _reply_with(ArrayRecord({**{k: good[k] for k in good}, "other": Array(np.zeros(1))}))
    elif case == "shape":
        fn = _reply_with(ArrayRecord({**{k: good[k] for k in good}, "layer.weight": Array(np.zeros((3, 2)))}))
    elif case == "dtype":
        fn = _reply_with(ArrayRecord({**{k: good[k] for k in good}, "layer.bias": Array(np.zeros(1, np.int32))}))
    elif case == "nan":
        fn = _reply_with(ArrayRecord({**{k: good[k] for k in good}, "layer.bias": Array(np.full(1, np.nan))}))
    elif case == "two-records":

        def fn(m, c):
            return Message(RecordDict({"a": good, "b": good}), reply_to=m)
    else:

        def fn(m, c):
            return Message(Error(code=2, reason="the user's own error"), reply_to=m)

    reply = _call(msg, fn)
    assert reply.has_error()
    assert reason in reply.error.reason
    if case != "user-error":
        assert reply.error.reason.startswith("dp_mod: ")


# ------------------------------------------------------------------ the layout
def test_layout_round_trip_keeps_keys_shapes_dtypes_and_frozen_arrays() -> None:
    record = initial_arrays()
    layout = ArrayLayout.of(record)
    assert layout.trained == ("layer.bias", "layer.weight") and layout.frozen == ("bn.num_batches_tracked",)
    assert layout.dim == 7
    w = np.arange(7, dtype=np.float64) / 3
    back = layout.unflatten(w, record)
    assert list(back) == list(record)
    for key in record:
        assert back[key].shape == record[key].shape and back[key].dtype == record[key].dtype
    np.testing.assert_array_equal(back["bn.num_batches_tracked"].numpy(), 0)
    np.testing.assert_array_equal(layout.flatten(back), layout.round_trip(w))
    with pytest.raises(ValueError, match="no floating array"):
        ArrayLayout.of(ArrayRecord({"steps": Array(np.array([1, 2]))}))
    with pytest.raises(LayoutMismatch, match="missing 'layer.bias'"):
        layout.flatten(ArrayRecord({k: record[k] for k in ("layer.weight", "bn.num_batches_tracked")}))


# ------------------------------------------------------------------ the strategy
def _run(strategy, app=None, rounds: int = 8, n: int = 10, evaluate=None, **grid_kwargs):
    return strategy.start(
        grid=grid(app or client_app(), n, **grid_kwargs),
        initial_arrays=initial_arrays(),
        num_rounds=rounds,
        train_config=lr(),
        evaluate_fn=evaluate,
    )


def _pld_epsilon(q: float, z: float, rounds: int, delta: float) -> float:
    """Epsilon of ``rounds`` Poisson-subsampled Gaussian rounds, composed here with dp-accounting's PLD at its
    default discretization (finer than dpfedavg's pessimistic 1e-3: ours may only be slightly above it)."""
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    accountant = pld_privacy_accountant.PLDAccountant()
    accountant.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), rounds)
    return float(accountant.get_epsilon(delta))


def _opacus_epsilon(q: float, z: float, rounds: int, delta: float) -> float:
    """Opacus' RDP accountant: an independent upper bound on the same mechanism."""
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    rdp = compute_rdp(q=q, noise_multiplier=z, steps=rounds, orders=orders)
    return float(get_privacy_spent(orders=orders, rdp=rdp, delta=delta)[0])


def test_a_numpy_client_trains_privately_on_the_users_arrays(dp_log) -> None:
    """Result.arrays has the user's keys, shapes and dtypes; evaluate_fn sees round 0..K; every epsilon printed
    is <= target and equal to an independent composition (dp-accounting PLD here, Opacus' RDP as an upper bound)."""
    strategy = DPFedAvg(algorithm="norm", clip=0.3, epsilon=4.0, delta=1e-5, clients_per_round=6.0)
    seen = {}

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        seen[server_round] = arrays
        return MetricRecord({"dist": float(np.linalg.norm(weights_of(arrays) - W_STAR))})

    result = _run(strategy, rounds=12, evaluate=evaluate)
    assert isinstance(strategy, AppDPFedAvg)
    assert sorted(seen) == list(range(13))
    init = initial_arrays()
    for arrays in (result.arrays, *seen.values()):
        assert list(arrays) == list(init)
        assert all(arrays[k].shape == init[k].shape and arrays[k].dtype == init[k].dtype for k in init)
    np.testing.assert_array_equal(result.arrays["bn.num_batches_tracked"].numpy(), 0)  # integer: not trained
    dists = [float(result.evaluate_metrics_serverapp[k]["dist"]) for k in (0, 12)]
    assert dists[1] < dists[0]
    eps = strategy.epsilon
    z, q = strategy.plan.noise_multiplier, 6.0 / 10
    assert eps <= 4.0
    assert _pld_epsilon(q, z, 12, 1e-5) <= eps <= _pld_epsilon(q, z, 12, 1e-5) * (1 + 1e-4)
    assert eps <= _opacus_epsilon(q, z, 12, 1e-5)
    assert float(result.train_metrics_clientapp[12]["epsilon"]) == eps
    printed = [float(x) for x in re.findall(r"epsilon spent: ([\d.]+) \(delta=1e-05\)", dp_log.text)]
    assert len(printed) == 12
    for k in (1, 6, 12):  # 4 significant digits printed
        assert printed[k - 1] == pytest.approx(_pld_epsilon(q, z, k, 1e-5), rel=1e-3)
    assert f"({eps:.4g}, 1e-05)-DP for each client's whole data (user level) after 12 rounds" in dp_log.text
    assert result.train_metrics_clientapp[12]["train_loss"] > 0  # the clients' own metric, weighted


def test_without_noise_and_with_every_client_it_is_flowers_fedavg() -> None:
    """algorithm 'none', q = 1: each round is the plain mean of the clients' new weights, as Flower's FedAvg."""
    ours = _run(DPFedAvg(algorithm="none", clip=1.0, epsilon=0.0, fraction_train=1.0), rounds=3)
    ensure_task_identity()
    plain = client_app(wrapped=False)
    flower = FedAvg(fraction_train=1.0, fraction_evaluate=0.0).start(
        grid=grid(plain), initial_arrays=initial_arrays(), num_rounds=3, train_config=lr()
    )
    for key in ("layer.weight", "layer.bias"):
        np.testing.assert_allclose(ours.arrays[key].numpy(), flower.arrays[key].numpy(), rtol=1e-5, atol=1e-6)


def test_sampling_is_poisson_over_the_sorted_node_ids() -> None:
    strategy = DPFedAvg(algorithm="clip", clip=1.0, epsilon=3.0, delta=1e-5, clients_per_round=4.0, seed=5)
    g = grid(client_app(), 10)
    strategy.start(grid=g, initial_arrays=initial_arrays(), num_rounds=3, train_config=lr())
    nodes = sorted(g.get_node_ids())
    sent = {}
    for msg in g.sent:
        sent.setdefault(int(msg.content["config"]["server-round"]), []).append(msg)
    for k in (1, 2, 3):
        expected = poisson_sample(10, 0.4, make_rng(5, Stream.SAMPLING, k - 1))
        assert sorted(m.metadata.dst_node_id for m in sent.get(k, [])) == [nodes[c] for c in expected]
        assert sorted(int(m.content["config"][CLIENT_ID]) for m in sent.get(k, [])) == list(expected)
        assert all(m.content["config"]["lr"] == 0.05 for m in sent.get(k, []))  # the user's train config


def test_a_clientapp_without_dp_mod_stops_the_run_in_round_1(dp_log) -> None:
    strategy = DPFedAvg(algorithm="norm", clip=0.3, epsilon=4.0, delta=1e-5, clients_per_round=6.0)
    with pytest.raises(TrainingStopped) as stopped:
        _run(strategy, app=client_app(wrapped=False), rounds=12)
    stop = stopped.value
    assert stop.server_round == 1 and len(stop.result.train_metrics_clientapp) == 1
    text = str(stop)
    assert "expected 1 ('update')" in text and "wrapped with dp_mod" in text
    # the round that ran is accounted, and the error says so
    one_round = _pld_epsilon(0.6, strategy.plan.noise_multiplier, 1, 1e-5)
    assert one_round <= stop.epsilon <= one_round * (1 + 1e-4)
    assert f"epsilon = {stop.epsilon:.4g}" in text
    errors = [r for r in dp_log.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].getMessage() == text


def test_replies_that_are_mostly_unusable_stop_the_run_after_the_window() -> None:
    health = ReplyHealth(max_failed_fraction=0.5, window=5)

    def rounds(bad: list[int], sampled: int = 4, dropped: int = 0) -> dict[int, RoundStats]:
        return {
            k + 1: RoundStats(
                round=k + 1,
                num_sampled=sampled,
                num_rejected=b,
                num_dropped=dropped,
                rejected_reasons=[f"client {k}: reply lacks 'update'"] * b,
            )  # fmt: skip
            for k, b in enumerate(bad)
        }

    assert health.verdict(1, rounds([4])) is not None  # every reply unusable: at once
    assert health.verdict(1, rounds([0], sampled=0)) is None  # nobody sampled: nothing to judge
    assert health.verdict(1, rounds([0], sampled=4, dropped=4)) is None  # dropouts are not failures
    assert health.verdict(4, rounds([3, 3, 3, 3])) is None  # the window is not full yet
    verdict = health.verdict(5, rounds([3, 3, 3, 3, 0]))
    assert verdict is not None and "12 of 20" in verdict and "commonest reason (12 of 12)" in verdict
    assert "dp_mod" in verdict
    assert health.verdict(5, rounds([2, 2, 2, 2, 2])) is None  # exactly half: tolerated
    failures = ["dp_mod: local training diverged: the returned arrays have NaN/Inf"] * 3
    mixed = {1: replace(rounds([1])[1], num_failed=3, failed_reasons=failures)}  # 1 rejected + 3 failed of 4
    verdict = health.verdict(1, mixed)  # the failures' reason is the commonest
    assert "commonest reason (3 of 4)" in verdict and "lower the ClientApp's learning rate" in verdict


def test_a_torch_state_dict_comes_back_loadable() -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))

    def train(msg: Message, context: Context) -> Message:
        local = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
        local.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        opt = torch.optim.SGD(local.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(int(context.node_config["partition-id"]))
        x, y = torch.randn(16, 4, generator=gen), torch.randint(0, 2, (16,), generator=gen)
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(local(x), y).backward()
            opt.step()
        reply = RecordDict({"arrays": ArrayRecord(local.state_dict()), "metrics": MetricRecord({"num-examples": 16})})
        return Message(reply, reply_to=msg)

    app = ClientApp()
    app.train(mods=[dp_mod])(train)
    strategy = DPFedAvg(algorithm="clip", clip=0.5, epsilon=5.0, delta=1e-5, fraction_train=0.5)
    initial = ArrayRecord(model.state_dict())
    result = strategy.start(grid=grid(app, 8), initial_arrays=initial, num_rounds=3)
    model.load_state_dict(result.arrays.to_torch_state_dict(), strict=True)
    assert int(model[1].num_batches_tracked) == 0  # the integer buffer is not averaged
    assert not torch.equal(model[0].weight, torch.from_numpy(initial["0.weight"].numpy()))


# ------------------------------------------------------------------ settings and configuration
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip": 1.0, "clients_per_round": 2.0, "epsilonn": 3.0}, "unknown key 'epsilonn' (did you mean 'epsilon'?)"),
        ({"clip": 1.0, "clients_per_round": 2.0, "local_steps": 3}, "'local_steps' does not apply"),
        ({"clients_per_round": 2.0}, "'clip' is required"),
        ({"clip": 1.0}, "give exactly one of 'clients_per_round'"),
        ({"clip": 1.0, "clients_per_round": 2.0, "fraction_train": 0.2}, "give exactly one of"),
        ({"clip": 1.0, "fraction_train": 1.5}, "'fraction_train' = 1.5: expected a fraction in (0, 1]"),
        ({"clip": 1.0, "clients_per_round": 2.0, "epsilon": -1.0}, "'epsilon' = -1.0: expected a float >= 0"),
        ({"clip": 1.0, "clients_per_round": 2.0, "server_lr": "eta"}, "already in the weights' units"),
        ({"clip": 1.0, "clients_per_round": 2.0, "algorithm": "nrom"}, "did you mean 'norm'?"),
    ],
)
def test_bad_settings_are_one_clear_error(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        DPFedAvg(**kwargs)
    assert message in str(err.value)


def test_rounds_come_from_start_and_a_second_source_must_agree() -> None:
    strategy = DPFedAvg(clip=0.3, clients_per_round=5.0, num_rounds=4, epsilon=4.0, delta=1e-5)
    with pytest.raises(ConfigError, match=r"start\(num_rounds=6\) differs from num-rounds = 4"):
        _run(strategy, rounds=6)
    # calibration happens in start(): the same target over more rounds needs more noise
    z = {}
    for rounds in (2, 8):
        strategy = DPFedAvg(clip=0.3, clients_per_round=5.0, epsilon=4.0, delta=1e-5)
        _run(strategy, rounds=rounds)
        z[rounds] = strategy.plan.noise_multiplier
        assert strategy.epsilon <= 4.0 and len(strategy.history) == rounds
    assert z[8] > z[2]


def test_the_dpfedavg_table_coexists_with_the_apps_own_keys(tmp_path, dp_log) -> None:
    """Flower flattens [tool.flwr.app.config.dpfedavg] to 'dpfedavg.<key>'; only those keys are dpfedavg's."""
    from flwr.common.config import get_fused_config_from_dir, parse_config_args

    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "userapp"\nversion = "1.0.0"\n\n[tool.flwr.app]\npublisher = "me"\n\n'
        '[tool.flwr.app.components]\nserverapp = "userapp.server_app:app"\nclientapp = "userapp.client_app:app"\n\n'
        '[tool.flwr.app.config]\nnum-server-rounds = 3\nlr = 0.1\nclip = "the app\'s own gradient clipping"\n\n'
        '[tool.flwr.app.config.dpfedavg]\nalgorithm = "clip"\nclip = 0.5\nepsilon = 4.0\nfraction-train = 0.5\n'
    )
    run_config = get_fused_config_from_dir(tmp_path, parse_config_args(["dpfedavg.epsilon=3.0"]))
    assert run_config["clip"] == "the app's own gradient clipping" and run_config["dpfedavg.clip"] == 0.5
    strategy = DPFedAvg.from_run_config(run_config)
    assert strategy.settings.options == {"algorithm": "clip", "clip": 0.5, "epsilon": 3.0, "fraction-train": 0.5}
    assert "'clip'" in dp_log.text and "not read by dpfedavg" in dp_log.text  # said once, not an error
    with pytest.raises(ConfigError) as err:
        DPFedAvg.from_run_config({**run_config, "dpfedavg.epsilonn": 1.0, "dpfedavgg.delta": 1e-5})
    assert "unknown key 'dpfedavg.epsilonn' (did you mean 'dpfedavg.epsilon'?)" in str(err.value)
    assert "'dpfedavgg.delta': did you mean 'dpfedavg.delta'?" in str(err.value)


def test_seeded_noise_is_a_loud_warning_secure_noise_is_not(dp_log) -> None:
    for secure in (False, True):
        dp_log.clear()
        strategy = DPFedAvg(clip=0.3, clients_per_round=5.0, epsilon=4.0, delta=1e-5, secure_noise=secure)
        _run(strategy, rounds=2)
        seeded = [r for r in dp_log.records if "SEEDED NOISE" in r.getMessage()]
        assert len(seeded) == (0 if secure else 1)
        assert not seeded or seeded[0].levelno == logging.WARNING
        rounds = [r.getMessage() for r in dp_log.records if r.getMessage().startswith("aggregate_train")]
        assert len(rounds) == 2 and all("epsilon spent" in m for m in rounds)
        assert ("unknown (the clients send no norms)" in rounds[0]) == secure


def test_initial_arrays_without_a_floating_array_are_refused() -> None:
    strategy = DPFedAvg(clip=0.3, clients_per_round=5.0)
    with pytest.raises(ConfigError, match="invalid initial_arrays: .*no floating array"):
        strategy.start(grid=grid(client_app()), initial_arrays=ArrayRecord({"n": Array(np.array([1]))}))


def test_the_noise_calibration_matches_the_budget_for_any_n() -> None:
    """n is the number of SuperNodes at the start; q = r/n enters the accountant."""
    for n in (5, 20):
        strategy = DPFedAvg(clip=0.3, clients_per_round=2.0, epsilon=2.0, delta=1e-5)
        _run(strategy, rounds=3, n=n)
        assert strategy.cfg.num_clients == n and strategy.cfg.sampling_rate == pytest.approx(2.0 / n)
        fine = _pld_epsilon(2.0 / n, strategy.plan.noise_multiplier, 3, 1e-5)
        assert fine <= strategy.epsilon <= fine * (1 + 1e-4)
        assert math.isfinite(strategy.epsilon) and strategy.epsilon <= 2.0


# ------------------------------------------------------------------ secure aggregation
def _secure_app(order: str) -> ClientApp:
    from flwr.client.mod import secaggplus_mod

    app = ClientApp()
    app.train(mods=[secaggplus_mod, dp_mod] if order == "inside" else [dp_mod, secaggplus_mod])(numpy_train)
    return app


def test_dp_mod_inside_secaggplus_mod_gives_the_server_the_exact_sum_only() -> None:
    """mods=[secaggplus_mod, dp_mod]: the server's w_1 is w_0 minus the sum of what each sampled client's dp_mod
    encoded (replayed here), over r; no reply the server receives holds one of those vectors."""
    settings = {"algorithm": "clip", "clip": 0.5, "epsilon": 4.0, "delta": 1e-5, "clients_per_round": 4.0,
                "secure_aggregation": True}  # fmt: skip
    strategy = DPFedAvg(**settings)
    spy = InProcessGrid(_secure_app("inside"), 6, {})
    result = strategy.start(grid=spy, initial_arrays=initial_arrays(), num_rounds=1, train_config=lr())
    stats = strategy.history[1]
    assert stats.num_received == stats.num_sampled >= 2
    # replay round 1: the same server opens the same round; each sampled node's dp_mod on the plain message
    layout = ArrayLayout.of(initial_arrays())
    replay = DPServer(strategy.cfg, layout.dim, setup=strategy.server.setup)
    opened = replay.begin_round(1, layout.flatten(initial_arrays()))
    nodes = sorted(spy.get_node_ids())
    config = instructions_to_config_record(opened.instructions)
    config["lr"] = 0.05
    for key, value in public_parameters(strategy.cfg).items():
        config[key] = value
    encoded = []
    for client in opened.clients:
        node = nodes[int(client)]
        msg = Message(RecordDict({"arrays": initial_arrays(), "config": config}), dst_node_id=node,
                      message_type=MessageType.TRAIN)  # fmt: skip
        reply = dp_mod(msg, spy.contexts[node], numpy_train)
        encoded.append(reply.content["arrays"]["update"].numpy())
    expected = layout.flatten(initial_arrays()) - np.sum(encoded, axis=0) / 4.0
    np.testing.assert_allclose(layout.flatten(result.arrays), layout.round_trip(expected), rtol=0, atol=1e-6)
    grid_step = opened.instructions.secagg_step
    assert grid_step > 0 and np.allclose(np.mod(encoded[0] / grid_step, 1), 0)  # on the round's grid
    seen = [a for msg in spy.received if not msg.has_error() for r in msg.content.array_records.values()
            for a in (arr.numpy() for arr in r.values())]  # fmt: skip
    for vector in encoded:
        assert not any(a.size == vector.size and np.allclose(a.astype(np.float64), vector) for a in seen)


def test_dp_mod_outside_secaggplus_mod_is_refused_with_the_right_order() -> None:
    ensure_task_identity()
    strategy = DPFedAvg(algorithm="clip", clip=0.5, epsilon=4.0, delta=1e-5, clients_per_round=4.0,
                        secure_aggregation=True)  # fmt: skip
    with pytest.raises(TrainingStopped) as stopped:
        strategy.start(grid=grid(_secure_app("outside"), 6), initial_arrays=initial_arrays(), num_rounds=3)
    assert "mods=[secaggplus_mod, dp_mod]" in str(stopped.value)
