"""Secure aggregation (SecAgg+): the encoding, the protocol round in-process, dropouts, what the server sees."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.quantization import quantize
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from dpfedavg import epsilon_for
from dpfedavg.config import ConfigError, RunConfig
from dpfedavg.core import SecAggGrid, Stream, client_round_update, gaussian_noise, make_rng, normalize
from dpfedavg.core.secagg import (
    conditional_round,
    ddg_tau,
    discrete_gaussian,
    encode,
    quantization_error_bound,
)
from dpfedavg.engines.batched import run_batched
from dpfedavg.flower import server_app
from dpfedavg.flower.app_strategy import DPFedAvg
from dpfedavg.flower.client_app import app as client_app
from dpfedavg.flower.secure_aggregation import workflow_for
from dpfedavg.flower.testing import InProcessGrid
from dpfedavg.privacy.setup import PrivacySetup
from dpfedavg.server.dp_server import DPServer
from dpfedavg.tasks import build_task

# ------------------------------------------------------------------ encoding


@pytest.mark.parametrize("sigma", [0.7, 1.3, 4.0, 2500.0])
def test_discrete_gaussian_matches_its_pmf(sigma: float) -> None:
    """Mean 0 and variance sum_x x^2 p(x) with p(x) ~ exp(-x^2/(2 sigma^2)); 200k draws, seed 0."""
    x = discrete_gaussian(200_000, sigma, np.random.default_rng(0))
    support = np.arange(-int(12 * sigma) - 2, int(12 * sigma) + 3)
    p = np.exp(-(support.astype(float) ** 2) / (2 * sigma**2))
    p /= p.sum()
    var = float(np.sum(support.astype(float) ** 2 * p))
    assert x.dtype == np.int64
    assert abs(x.mean()) < 5 * math.sqrt(var / len(x))
    assert abs(x.var() / var - 1) < 0.02  # the std of the sample variance is ~0.3% here
    if sigma < 5:  # the whole pmf, not just two moments: total variation distance
        counts = np.array([(x == k).sum() for k in support]) / len(x)
        assert 0.5 * np.abs(counts - p).sum() < 0.01


def test_grid_is_powers_of_two_and_covers_the_noise() -> None:
    grid = SecAggGrid.for_round(clip=3.0, noise_std=0.2, clip_stds=10.0, bits=16, modulus_bits=32)
    assert grid.clipping_range >= 3.0 + 10.0 * 0.2
    assert grid.clipping_range < 2 * (3.0 + 10.0 * 0.2)  # the power of two at most doubles it
    assert math.log2(grid.step) == int(math.log2(grid.step))
    assert grid.clipping_range == grid.levels * grid.step / 2
    assert grid.max_participants == (2**32 - 1) // 2**16
    assert grid.clip_probability(3.0, 0.2, 10**9) < 1e-10
    assert SecAggGrid.for_round(1.0, 1.0, 0.0, 8, 16).clip_probability(1.0, 1.0, 1) > 0.1  # k = 0: clips often


def test_conditional_rounding_keeps_the_norm_bound_and_is_unbiased() -> None:
    rng = np.random.default_rng(1)
    c, step = 5.0, 2.0**-6
    g = normalize(rng.standard_normal(300), c)  # ||g|| = C exactly: the hardest case
    draws = np.stack([conditional_round(g, step, c, rng) for _ in range(400)])
    assert np.all(np.linalg.norm(draws, axis=1) <= c)
    assert np.all(np.abs(draws - g) < step)
    np.testing.assert_array_equal(np.mod(draws / step, 1), 0)
    # unbiased up to the conditioning: the mean error is far below one step
    assert np.abs(draws.mean(axis=0) - g).max() < 0.2 * step
    with pytest.raises(ValueError, match="exceeds the bound"):
        conditional_round(2 * g, step, c, rng)


def test_encoding_is_exact_under_flowers_quantizer() -> None:
    """Flower's quantize maps our grid points to integers without rounding: the protocol adds no error."""
    rng = np.random.default_rng(2)
    c, s = 2.0, 0.3
    grid = SecAggGrid.for_round(c, s, 10.0, 16, 32)
    g = normalize(rng.standard_normal(500), c)
    y, clipped = encode(g, grid, c, s, rng)
    assert clipped == 0
    assert np.all(np.abs(y) <= grid.clipping_range)
    ints = (y + grid.clipping_range) / grid.step
    np.testing.assert_array_equal(ints, np.round(ints))
    for _ in range(3):  # Flower's stochastic rounding never moves an exact grid point
        (q,) = quantize([y], grid.clipping_range, grid.levels)
        np.testing.assert_array_equal(q, ints.astype(np.int64))
    # the noise has the requested std (discrete Gaussian on the grid)
    assert abs(np.std(y - conditional_round(g, grid.step, c, np.random.default_rng(3))) / s - 1) < 0.1


def test_tau_is_negligible_at_our_settings_and_large_for_coarse_grids() -> None:
    assert ddg_tau(sigma_steps=50.0, num_clients=5000) == 0.0
    assert ddg_tau(sigma_steps=0.3, num_clients=100) > 1.0


# -------------------------------------------------------------------- config


def _cfg(**overrides) -> RunConfig:
    base = {
        "num-clients": 10,
        "clients-per-round": 6.0,
        "num-rounds": 3,
        "dim": 12,
        "seed": 5,
        "epsilon": 0.0,
        "noise-multiplier": 1.0,
        "algorithm": "clip",
        "clip": 20.0,
        "secure-aggregation": True,
    }
    base.update(overrides)
    return RunConfig.from_run_config(base)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"noise-placement": "server"}, "'noise-placement' = 'server'"),
        ({"algorithm": "none"}, "'algorithm' = 'none'"),
        ({"diagnostics": True}, "'diagnostics' = True"),
        ({"secagg-quantization-bits": 30, "num-clients": 10}, "use secagg-quantization-bits <= 28"),
        ({"secagg-quantization-bits": 20, "secagg-modulus-bits": 20}, "must be below 'secagg-modulus-bits'"),
        ({"secagg-num-shares": 2.0}, "'secagg-num-shares' = 2.0"),
        ({"secagg-reconstruction-threshold": 0.5}, "a fraction in (0.5, 1]"),
        ({"secagg-modulus-bits": 40}, "'secagg-modulus-bits' = 40"),
    ],
)
def test_bad_secure_aggregation_config_is_one_clear_error(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _cfg(**overrides)


@pytest.mark.parametrize(
    ("num_shares", "num_clients", "expected"),
    [(11.0, 5, 1.0), (11.0, 11, 1.0), (11.0, 200, 11), (0.5, 200, 0.5), (1.0, 3, 1.0)],
)
def test_secagg_plus_neighbourhood(num_shares: float, num_clients: int, expected: float) -> None:
    """An integer k means k neighbours, or everyone when the round has at most k clients; (0, 1] is a fraction."""
    grid = SecAggGrid.for_round(1.0, 0.1, 10.0, 16, 32)
    workflow = workflow_for(grid, num_shares, 0.67, None, num_clients)
    assert workflow.num_shares == expected and type(workflow.num_shares) is type(expected)
    assert (workflow.clipping_range, workflow.quantization_range, workflow.modulus_range) == (
        grid.clipping_range,
        grid.levels,
        grid.modulus,
    )
    assert workflow.max_weight == 1.0  # every client weighs 1: the workflow's average times N is the sum


# ------------------------------------------------------- the protocol round


def _rows(run_dir) -> list[dict[str, str]]:
    """metrics.csv as dicts; row 0 is the initial point."""
    return list(csv.DictReader((run_dir / "metrics.csv").open()))


def _survivors_model(cfg: RunConfig, in_sum: set[int], beta: float) -> np.ndarray:
    """w_1 = w_0 - beta * (sum of the encoded updates of ``in_sum`` + the server's top-up) / r, replayed.

    The top-up is the noise the missing clients would have added (``core.mechanism``), drawn by the server
    after unmasking from its seeded stream.
    """
    task = build_task(cfg)
    strategy = DPFedAvg(cfg, dim=task.dim, setup=PrivacySetup.resolve(cfg))
    w0 = task.initial_weights()
    clients, ins, _ = strategy.server.begin_round(1, w0)
    total = sum(
        (client_round_update(w0, task.client_grad_fn(c), ins, c).noisy for c in sorted(in_sum)), np.zeros(task.dim)
    )
    top_up = strategy.server.noise_stds_for(len(clients), len(in_sum))[1]
    if top_up > 0:
        total = total + gaussian_noise(task.dim, top_up, make_rng(cfg.seed, Stream.SERVER_NOISE, 0))
    return w0 - beta * total / cfg.clients_per_round


def _run_flower(cfg: RunConfig, tmp_path, name: str, client=client_app, grid_cls=InProcessGrid, **grid_kwargs):
    cfg = cfg.replace(output_dir=str(tmp_path), run_name=name)
    grid = grid_cls(client, cfg.num_clients, cfg.to_run_config(), **grid_kwargs)
    return server_app.run(grid, cfg, setup=PrivacySetup.resolve(cfg)).directory, grid


def test_secure_aggregate_equals_the_plain_sum_of_the_encoded_updates(tmp_path) -> None:
    """Flower's SecAgg+ run gives exactly the batched engine's run, which sums the same encodings in the clear."""
    cfg = _cfg(**{"noise-placement": "client-calibrated", "server-momentum": 0.5, "num-rounds": 4})
    out, _ = _run_flower(cfg, tmp_path, "secure")
    plain = run_batched(cfg.replace(output_dir=str(tmp_path), run_name="batched"), threads=1).directory
    secure_w = np.load(out / "model.npz")["w_final"]
    np.testing.assert_allclose(secure_w, np.load(plain / "model.npz")["w_final"], rtol=1e-12, atol=1e-12)
    assert len(_rows(out)) == 1 + 4


def test_secure_aggregate_is_the_unquantized_aggregate_within_the_stated_error(tmp_path) -> None:
    """Without noise, secure minus plain aggregation is only the rounding: ||error|| <= beta N Delta sqrt(d) / r."""
    cfg = _cfg(**{"noise-multiplier": 0.0, "num-rounds": 1, "dim": 40, "secagg-quantization-bits": 12})
    out, _ = _run_flower(cfg, tmp_path, "secure")
    plain, _ = _run_flower(cfg.replace(secure_aggregation=False), tmp_path, "plain")
    w_secure = np.load(out / "model.npz")["w_final"]
    w_plain = np.load(plain / "model.npz")["w_final"]
    stats = _rows(out)[1]
    n_received, beta = int(stats["num_received"]), float(stats["beta"])
    grid = SecAggGrid.for_round(cfg.clip, 0.0, cfg.secagg_clip_stds, 12, 32)
    bound = beta * quantization_error_bound(grid, n_received, 40) / cfg.clients_per_round
    error = float(np.linalg.norm(w_secure - w_plain))
    assert 0 < error <= bound, (error, bound)
    # and the rounding is unbiased: the typical error is ~ sqrt(N d) Delta / 2, far below the worst case
    assert error < 0.25 * bound


def _arrays_in(msg: Message) -> list[np.ndarray]:
    """Every array a reply carries: array records, and bytes in config records decoded as numpy arrays."""
    out = []
    if msg.has_error():
        return out
    for record in msg.content.array_records.values():
        out.extend(arr.numpy() for arr in record.values())
    for record in msg.content.config_records.values():
        for value in record.values():
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, bytes):
                    try:
                        out.append(bytes_to_ndarray(item))
                    except Exception:  # noqa: BLE001 - keys, shares, ciphertexts are not arrays
                        continue
    return out


def test_the_server_never_receives_an_individual_unmasked_update(tmp_path, monkeypatch) -> None:
    cfg = _cfg(**{"num-rounds": 2, "dim": 16})
    # the per-client aggregation path must not be used at all
    close_round = DPServer.close_round

    def sums_only(server, server_round, replies):  # noqa: ANN001, ANN202
        assert not replies.results, "per-client updates reached the server under secure aggregation"
        return close_round(server, server_round, replies)

    monkeypatch.setattr(DPServer, "close_round", sums_only)
    out, grid = _run_flower(cfg, tmp_path, "spy")
    assert (out / "model.npz").exists()
    task = build_task(cfg)
    strategy = DPFedAvg(cfg, dim=task.dim, setup=PrivacySetup.resolve(cfg))
    # recompute what every sampled client encoded in round 1 (seeded noise: the test can replay it)
    w0 = task.initial_weights()
    clients, ins, _ = strategy.server.begin_round(1, w0)
    grid_r1 = strategy.server.secagg_grid(len(clients))
    secrets = []
    for cid in clients:
        y = client_round_update(w0, task.client_grad_fn(int(cid)), ins, int(cid)).noisy
        secrets += [y, (y + grid_r1.clipping_range) / grid_r1.step]  # the update and its quantized integers
    assert len(clients) >= 2
    seen = [a for msg in grid.received for a in _arrays_in(msg)]
    masked = [a for a in seen if a.size == task.dim]
    assert masked, "the masked vectors should be among the replies"
    for secret in secrets:
        for arr in seen:
            if arr.size == secret.size:
                assert not np.allclose(arr.astype(np.float64).ravel(), secret, rtol=0, atol=1e-6)
    # the masked vectors are full-range integers mod M, nothing like the small quantized values
    assert max(int(a.max()) for a in masked) > 2**31


def _failing_in_stage(stage: str, partition_ids: set[int]):
    """The real ClientApp, except that these partitions raise in one SecAgg+ stage (they drop out there)."""

    def fn(msg: Message, context: Context) -> Message | None:
        configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
        if configs is not None and configs.get(Key.STAGE) == stage:
            if int(context.node_config["partition-id"]) in partition_ids:
                raise RuntimeError(f"client lost power in stage {stage}")
        return client_app(msg, context)

    return fn


@pytest.mark.parametrize(
    ("stage", "dead"),
    [
        (Stage.SETUP, {2}),  # never sends its keys
        (Stage.SHARE_KEYS, {2}),  # sends its keys, dies before sharing them
        (Stage.COLLECT_MASKED_VECTORS, {2, 3, 7}),  # neighbours dying together after the keys were shared
        (Stage.UNMASK, {2}),  # sent its masked vector, dies before helping to unmask: still in the sum
    ],
)
def test_the_secure_sum_is_exactly_the_survivors_whenever_clients_drop(tmp_path, stage: str, dead: set[int]) -> None:
    """Every stage a client can die in: the round completes and the sum is over those that sent a masked vector."""
    cfg = _cfg(**{"clients-per-round": 10.0, "num-rounds": 1, "secagg-num-shares": 1.0})
    out, _ = _run_flower(cfg, tmp_path, f"drop-{stage}", client=_failing_in_stage(stage, dead))
    stats = _rows(out)[1]
    in_sum = set(range(10)) - (set() if stage == Stage.UNMASK else dead)
    assert (int(stats["num_received"]), int(stats["num_dropped"]), int(stats["skipped"])) == (
        len(in_sum),
        10 - len(in_sum),
        0,
    )
    expected = _survivors_model(cfg, in_sum, float(stats["beta"]))
    np.testing.assert_allclose(np.load(out / "model.npz")["w_final"], expected, atol=1e-12)


def test_too_few_survivors_release_the_servers_noise_only_and_are_charged(tmp_path) -> None:
    """Below the reconstruction threshold no update is summed: the round releases N(0, (zC)^2) alone.

    Releasing nothing would tell who took part (whether a round is skipped depends on the count), so the
    round is charged like every other: epsilon after k rounds is the nominal one.
    """
    cfg = _cfg(**{"clients-per-round": 10.0, "num-rounds": 1, "secagg-reconstruction-threshold": 0.9})
    dead = set(range(5))  # half the clients vanish after sending their keys
    out, _ = _run_flower(cfg, tmp_path, "halt", client=_failing_in_stage(Stage.SHARE_KEYS, dead))
    (row,) = _rows(out)[1:]
    assert (int(row["skipped"]), int(row["num_received"]), int(row["num_dropped"])) == (1, 0, 10)
    assert float(row["epsilon"]) == pytest.approx(epsilon_for(1.0, 1.0, 1, cfg.delta, "pld"), rel=1e-9)
    expected = _survivors_model(cfg, set(), float(row["beta"]))  # w_0 moved by the server's noise alone
    np.testing.assert_allclose(np.load(out / "model.npz")["w_final"], expected, atol=1e-12)


def test_a_malformed_reply_inside_the_protocol_skips_the_round_and_the_run_goes_on(tmp_path) -> None:
    """A client answering the masked-vector stage with garbage: the round releases nothing, the next runs."""
    garbage_in_round = {1}

    def fn(msg: Message, context: Context) -> Message | None:
        configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
        if (
            configs is not None
            and configs.get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS
            and int(context.node_config["partition-id"]) == 0
            and int(msg.metadata.group_id) in garbage_in_round
        ):
            return Message(RecordDict(), reply_to=msg)
        return client_app(msg, context)

    cfg = _cfg(**{"clients-per-round": 10.0, "num-rounds": 2})
    out, _ = _run_flower(cfg, tmp_path, "garbage", client=fn)
    rows = _rows(out)[1:]
    assert [(int(r["skipped"]), int(r["num_received"])) for r in rows] == [(1, 0), (0, 10)]


def test_secure_noise_and_secure_aggregation_compose(tmp_path) -> None:
    """With OS-seeded noise the run still completes and moves the model (no seed leaves the server)."""
    cfg = _cfg(**{"secure-noise": True, "num-rounds": 2})
    out, grid = _run_flower(cfg, tmp_path, "secure-noise")
    sent = [m for m in grid.sent if RECORD_KEY_CONFIGS in m.content.config_records]
    assert sent
    w = np.load(out / "model.npz")["w_final"]
    assert np.isfinite(w).all() and np.linalg.norm(w - build_task(cfg).initial_weights()) > 0


def test_single_client_round_is_skipped_not_exposed(tmp_path) -> None:
    """A round with one or two sampled clients cannot hide them in a sum (in a sum of two each client reads the
    other's vector; the nodes refuse cohorts below 3): skipped and logged, not sent in the clear."""
    cfg = _cfg(**{"num-clients": 4, "clients-per-round": 0.4, "num-rounds": 12, "seed": 1})
    out, grid = _run_flower(cfg, tmp_path, "single")
    rows = _rows(out)[1:]
    small = [r for r in rows if int(r["num_sampled"]) < 3]
    assert {int(r["num_sampled"]) for r in small} >= {1, 2}, "seed 1 should sample 1 and 2 clients in some rounds"
    assert all(int(r["skipped"]) == 1 for r in small)
    assert all(int(r["skipped"]) == 0 for r in rows if int(r["num_sampled"]) >= 3)
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert all(RECORD_KEY_CONFIGS in m.content.config_records for m in train)  # nothing outside SecAgg+


@pytest.mark.parametrize(
    ("values", "key", "term", "fix"),
    [
        ({"secagg-quantization-bits": 4}, "'secagg-quantization-bits' = 4", "tau = 4.51", "quantization-bits >= 6"),
        ({"secagg-clip-stds": 2.0}, "'secagg-clip-stds' = 2", "delta_including_clipping = 149", "clip-stds >= 9.13"),
    ],
)
def test_secure_aggregation_settings_that_void_the_guarantee_are_rejected(
    tmp_path, values: dict, key: str, term: str, fix: str
) -> None:
    """Issue 16's two cases at the default run (n = r = 100, d = 200, K = 200, (5, 1e-6)): one clear error each."""
    cfg = RunConfig.from_run_config(
        {"secure-aggregation": True, "output-dir": str(tmp_path), "run-name": "void", **values}
    )
    with pytest.raises(ConfigError) as err:
        run_batched(cfg)
    message = str(err.value)
    assert key in message and term in message and fix in message and "allowed" in message
    assert not (tmp_path / "void").exists()  # refused before anything was written
    default = RunConfig.from_run_config({"secure-aggregation": True})
    assert DPFedAvg(default, dim=200).server.placement.name == "client-calibrated"  # the defaults are accepted


def test_a_sampled_node_already_offline_leaves_the_round_to_the_connected_cohort(tmp_path) -> None:
    """Churn: partition 2's node went offline after discovery. |S_k| in the instructions is the 9 connected
    sampled clients (the SecAgg+ cohort, which every node checks), so the round sums 9 clients with the noise
    shares of a cohort of 9, the offline client is a dropout, and the model is that replay (not a halted round)."""

    class ChurnGrid(InProcessGrid):
        exchanges = 0

        def send_and_receive(self, messages, *, timeout=None):
            ChurnGrid.exchanges += 1  # the first two are the discovery's partition queries (one node, then all)
            return super().send_and_receive(messages, timeout=timeout)

        def get_node_ids(self):
            ids = list(self.contexts)
            return [n for n in ids if self.exchanges < 2 or self.contexts[n].node_config["partition-id"] != 2]

    cfg = _cfg(**{"clients-per-round": 10.0, "num-rounds": 1, "noise-placement": "client-calibrated"})
    out, grid = _run_flower(cfg, tmp_path, "churn", grid_cls=ChurnGrid)
    (row,) = _rows(out)[1:]
    assert (int(row["skipped"]), int(row["num_sampled"]), int(row["num_received"]), int(row["num_dropped"])) == (
        0, 10, 9, 1,
    )  # fmt: skip
    task = build_task(cfg)
    server = DPFedAvg(cfg, dim=task.dim, setup=PrivacySetup.resolve(cfg)).server
    w0 = task.initial_weights()
    server.begin_round(1, w0)
    ins = server.connected_cohort(1, 9)
    assert ins.cohort_size == 9 and ins.noise_std == pytest.approx(server.noise_stds(9)[0])
    in_sum = set(range(10)) - {2}
    total = sum((client_round_update(w0, task.client_grad_fn(c), ins, c).noisy for c in sorted(in_sum)), np.zeros(12))
    assert server.noise_stds_for(9, 9)[1] == 0.0  # client-calibrated: the 9 shares are all of (zC)^2
    expected = w0 - float(row["beta"]) * total / cfg.clients_per_round
    np.testing.assert_allclose(np.load(out / "model.npz")["w_final"], expected, atol=1e-12)
