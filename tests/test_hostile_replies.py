"""Malicious or broken clients against the ServerApp: every bad reply is a counted rejection (issue 29, part 2).

One registered node of twelve replies with a hostile message every round; the other eleven run the real
ClientApp. The run must finish, count that node's client as rejected with its reason in the log, and end
with a finite model. Then the plausibility bound (checked against scipy's chi distribution), adaptive
clipping's count coordinate and ``C_k``'s floor and ceiling, and what one client can do under SecAgg+.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from scipy import stats

from dpfedavg.config import RunConfig
from dpfedavg.flower import server_app
from dpfedavg.flower.client_app import app as client_app
from dpfedavg.flower.protocol import ARRAYS, UPDATE_KEY, to_array_record
from dpfedavg.flower.testing import InProcessGrid

DIM = 30
BASE = {
    "task": "quadratic",
    "dim": DIM,
    "num-clients": 12,
    "clients-per-round": 12.0,
    "num-rounds": 3,
    "epsilon": 4.0,
    "delta": 1e-5,
    "algorithm": "clip",
    "clip": 1.0,
    "seed": 2,
    "checkpoint-every": 1,
}


def _cfg(tmp: Path, **overrides) -> RunConfig:
    return RunConfig.from_run_config({**BASE, "output-dir": str(tmp), "run-name": "hostile", **overrides})


def _reply(msg: Message, **records) -> Message:
    return Message(RecordDict(records), reply_to=msg)


def _update(vec) -> ArrayRecord:
    return to_array_record(np.asarray(vec), UPDATE_KEY)


def _metrics(**values) -> MetricRecord:
    return MetricRecord({"num-examples": 1, **values})


def _garbage_array() -> ArrayRecord:
    return ArrayRecord({UPDATE_KEY: Array(dtype="float64", shape=(DIM,), stype="numpy.ndarray", data=b"not an npy")})


#: name -> what node 0 sends instead of its update (``msg`` is the TRAIN message it answers).
HOSTILE: dict[str, Callable[[Message], Message]] = {
    "update-norm-is-a-list": lambda m: _reply(
        m, arrays=_update(np.zeros(DIM)), metrics=_metrics(**{"update-norm": [1.0, 2.0]})
    ),
    "metric-record-under-arrays": lambda m: _reply(m, arrays=MetricRecord({"update": 1.0}), metrics=_metrics()),
    "config-record-under-arrays": lambda m: _reply(m, arrays=ConfigRecord({"update": b"\x00" * 8}), metrics=_metrics()),
    "array-record-under-metrics": lambda m: _reply(m, arrays=_update(np.zeros(DIM)), metrics=_update(np.zeros(3))),
    "config-record-under-metrics": lambda m: _reply(
        m, arrays=_update(np.zeros(DIM)), metrics=ConfigRecord({"update-norm": b"1"})
    ),
    "bytes-that-do-not-parse": lambda m: _reply(m, arrays=_garbage_array(), metrics=_metrics()),
    "integer-dtype": lambda m: _reply(m, arrays=_update(np.zeros(DIM, dtype=np.int64)), metrics=_metrics()),
    "complex-dtype": lambda m: _reply(m, arrays=_update(np.zeros(DIM, dtype=np.complex128)), metrics=_metrics()),
    "bool-dtype": lambda m: _reply(m, arrays=_update(np.zeros(DIM, dtype=bool)), metrics=_metrics()),
    "two-dimensional": lambda m: _reply(m, arrays=_update(np.zeros((DIM, 1))), metrics=_metrics()),
    "scalar": lambda m: _reply(m, arrays=_update(np.float64(1.0)), metrics=_metrics()),
    "nan": lambda m: _reply(m, arrays=_update(np.full(DIM, np.nan)), metrics=_metrics()),
    "inf": lambda m: _reply(m, arrays=_update(np.full(DIM, np.inf)), metrics=_metrics()),
    "1e150-update": lambda m: _reply(m, arrays=_update(1e150 * np.ones(DIM)), metrics=_metrics()),
    "1.7e308-update": lambda m: _reply(m, arrays=_update(np.full(DIM, 1.7e308)), metrics=_metrics()),
    "norm-1000-at-C-1": lambda m: _reply(m, arrays=_update(np.full(DIM, 1000 / math.sqrt(DIM))), metrics=_metrics()),
    "extra-record": lambda m: _reply(
        m, arrays=_update(np.zeros(DIM)), metrics=_metrics(), extra=ConfigRecord({"x": 1})
    ),
    "nothing-at-all": lambda m: _reply(m),
    "nan-update-norm": lambda m: _reply(
        m, arrays=_update(np.zeros(DIM)), metrics=_metrics(**{"update-norm": float("nan")})
    ),
    "diagnostics-nobody-asked-for": lambda m: _reply(
        m, arrays=_update(np.zeros(DIM)), metrics=_metrics(), diagnostics=to_array_record(np.ones(DIM), "clean-update")
    ),
}


def _hostile_node(kind: str) -> Callable[[Message, Context], Message | None]:
    def fn(msg: Message, context: Context) -> Message | None:
        if msg.metadata.message_type == "train" and int(context.node_config["partition-id"]) == 0:
            return HOSTILE[kind](msg)
        return client_app(msg, context)

    return fn


def _rows(out: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((out / "metrics.csv").open()))[1:]


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_reply_is_a_counted_rejection_never_a_crash(kind: str, tmp_path: Path, dpfedavg_log) -> None:
    cfg = _cfg(tmp_path)
    out = server_app.run(InProcessGrid(_hostile_node(kind), 12, cfg.to_run_config()), cfg).directory
    rows = _rows(out)
    assert [(int(r["num_rejected"]), int(r["num_received"]), int(r["num_failed"])) for r in rows] == [(1, 11, 0)] * 3
    rejected = [r.getMessage() for r in dpfedavg_log if "rejected reply" in r.getMessage()]
    assert len(rejected) == 3 and all(len(line) < 600 for line in rejected)  # one readable line per round
    w = np.load(out / "model.npz")["w_final"]
    assert np.all(np.isfinite(w)) and np.abs(w).max() < 100  # the quadratic's iterates stay near w* = O(1)


def test_hostile_reply_in_a_virtual_node_block_rejects_that_node_only(tmp_path: Path) -> None:
    """clients-per-node = 3: one node's block reply has metrics where its arrays belong, one a 1e150 update."""
    cfg = _cfg(tmp_path, **{"clients-per-node": 3})

    def fn(msg: Message, context: Context) -> Message | None:
        pid = int(context.node_config["partition-id"])
        reply = client_app(msg, context)
        if msg.metadata.message_type != "train" or pid not in (0, 1) or reply.has_error():
            return reply
        if pid == 0:  # a MetricRecord where the node's ArrayRecord belongs
            reply.content[ARRAYS] = MetricRecord(dict.fromkeys(reply.content[ARRAYS], 1.0))
        else:
            arrays = reply.content[ARRAYS]
            key = sorted(arrays)[0]
            arrays[key] = Array(1e150 * np.ones(DIM))
        return reply

    out = server_app.run(InProcessGrid(fn, 4, cfg.to_run_config(), num_partitions=4), cfg).directory
    rows = _rows(out)
    assert [(int(r["num_rejected"]), int(r["num_received"])) for r in rows] == [(4, 8)] * 3
    assert np.all(np.isfinite(np.load(out / "model.npz")["w_final"]))


# ------------------------------------------------------------ plausibility bound
@pytest.mark.parametrize("dim", [1, 30, 1000, 1_000_000])
@pytest.mark.parametrize("p", [1e-9, 1e-30])
def test_plausibility_bound_is_exceeded_by_an_honest_client_with_probability_below_p(dim: int, p: float) -> None:
    """B = C + s (sqrt(d) + sqrt(2 ln(1/p))): ||g + zeta|| <= ||g|| + ||zeta|| and P(||zeta|| / s > sqrt(d) + t)
    is scipy's chi(d) survival function, checked against p (it is 1e-13 to 1e-62 here: the sub-Gaussian bound
    of Hsu, Kakade, Zhang 2012 also holds for secure aggregation's discrete Gaussians, and is loose for Gaussians)."""
    from dpfedavg.privacy.plausibility import norm_bound

    c, s = 2.0, 0.7
    bound = norm_bound(c, s, dim, p)
    noise_part = (bound - c * (1 + 1e-5)) / s  # the bound less C and its float-rounding slack, in units of s
    assert stats.chi(dim).sf(noise_part) <= p  # worst case ||g|| = C with the noise pushing straight outwards
    assert noise_part <= math.sqrt(dim) + math.sqrt(2 * math.log(1 / p)) + 1e-9
    assert norm_bound(c, 0.0, dim, p) == pytest.approx(c, rel=1e-4)  # no noise: the bound is C


def test_false_rejection_probability_keeps_delta_slack_small() -> None:
    """p is at most 1e-9 and small enough that (1 + e^eps) K n p <= 1e-3 delta (the delta the run adds)."""
    from dpfedavg.privacy.plausibility import false_rejection_probability

    for eps, k, n, delta in [(5.0, 500, 3000, 1e-5), (100.0, 100_000, 10**6, 1e-12), (0.5, 1, 1, 1e-2)]:
        p = false_rejection_probability(epsilon=eps, rounds=k, num_clients=n, delta=delta)
        assert p <= 1e-9
        assert math.log1p(math.exp(eps)) + math.log(k * n) + math.log(p) <= math.log(1e-3 * delta) + 1e-9


def test_honest_clients_are_never_rejected_over_many_rounds(tmp_path: Path) -> None:
    """50 rounds of 12 honest clients at a small C with noise: no rejection (P(any) <= 600 p <= 6e-7)."""
    cfg = _cfg(tmp_path, **{"num-rounds": 50, "checkpoint-every": 0, "clip": 0.05})
    out = server_app.run(InProcessGrid(client_app, 12, cfg.to_run_config()), cfg).directory
    assert sum(int(r["num_rejected"]) for r in _rows(out)) == 0
    checks = json.loads((out / "config.json").read_text())["privacy"]["reply_checks"]
    assert checks["false_rejection_probability"] <= 1e-9
    assert checks["delta_added_at_most"] <= 1e-3 * cfg.delta * (1 + 1e-9)


# ------------------------------------------------------------- adaptive clipping
def _adaptive(tmp: Path, **overrides) -> RunConfig:
    return _cfg(tmp, algorithm="adaptive-clip", **{"clip-count-stddev": 2.0, "clip": 1.0, **overrides})


def test_count_coordinate_of_1e6_is_rejected_and_the_run_goes_on(tmp_path: Path) -> None:
    """The attack of issue 29: one count of 1e6 set C_1 = 0 and round 2 raised ZeroDivisionError."""
    cfg = _adaptive(tmp_path, **{"num-rounds": 4})

    def fn(msg: Message, context: Context) -> Message | None:
        reply = client_app(msg, context)
        if msg.metadata.message_type == "train" and int(context.node_config["partition-id"]) == 0:
            vec = reply.content[ARRAYS][UPDATE_KEY].numpy().copy()
            vec[-1] = 1e6
            reply.content[ARRAYS][UPDATE_KEY] = Array(vec)
        return reply

    out = server_app.run(InProcessGrid(fn, 12, cfg.to_run_config()), cfg).directory
    rows = _rows(out)
    assert [int(r["num_rejected"]) for r in rows] == [1] * 4
    clips = [float(r["clip"]) for r in rows]
    assert all(0.2 < c < 5.0 for c in clips), clips


def test_count_coordinate_within_the_norm_bound_but_not_plausible_is_rejected(tmp_path: Path) -> None:
    """A vector whose whole norm sits in the count coordinate passes the norm bound but not the count's own."""
    from dpfedavg.privacy.plausibility import count_bound, norm_bound
    from dpfedavg.server.dp_server import DPServer

    cfg = _adaptive(tmp_path, **{"num-rounds": 1})
    server = DPServer(cfg, DIM)
    client_std = server.noise_stds(12)[0]
    limit_norm = norm_bound(server.sensitivity, client_std, DIM + 1, 1e-9)
    limit_count = count_bound(server.adaptive.scale, client_std, 1e-9)
    assert limit_count < 0.9 * limit_norm
    value = 0.5 * (limit_count + limit_norm)

    def fn(msg: Message, context: Context) -> Message | None:
        if msg.metadata.message_type == "train" and int(context.node_config["partition-id"]) == 0:
            vec = np.zeros(DIM + 1)
            vec[-1] = value
            return _reply(msg, arrays=_update(vec), metrics=_metrics())
        return client_app(msg, context)

    out = server_app.run(InProcessGrid(fn, 12, cfg.to_run_config()), cfg).directory
    assert int(_rows(out)[0]["num_rejected"]) == 1


def test_clip_threshold_stays_between_its_floor_and_ceiling_whatever_the_count() -> None:
    from dpfedavg.core.adaptive_clip import AdaptiveClip

    for count in (1e12, -1e12, 1e300, -1e300):
        state = AdaptiveClip(clip=2.0, target_quantile=0.5, clip_lr=0.2, count_stddev=2.0, noise_multiplier=1.0,
                             clip_floor=2.0 / 1000, clip_ceiling=2.0 * 1000)  # fmt: skip
        for _ in range(50):
            state.step(count, 10.0)
            assert 2.0 / 1000 <= state.clip <= 2.0 * 1000 and state.scale > 0


# ------------------------------------------------------------------- SecAgg+
def test_secure_sum_one_client_could_not_have_produced_is_skipped(tmp_path: Path, dpfedavg_log) -> None:
    """Under SecAgg+ the server sees only the sum: a sum no N honest clients can produce (norm beyond
    N C + s sqrt(N) (sqrt(d) + t)) skips the round (noise only), with the reason in the log."""
    from dpfedavg.flower.secure_aggregation import SecureSum
    from dpfedavg.flower.app_strategy import DPFedAvg
    from dpfedavg.flower.strategy import FlowerRunner

    cfg = _cfg(tmp_path, **{"secure-aggregation": True, "epsilon": 0.0, "noise-multiplier": 1.0})
    strategy = DPFedAvg(cfg, dim=DIM)
    start = strategy.server.begin_round(1, np.zeros(DIM))
    runner = FlowerRunner(strategy, strategy.edge, None, ConfigRecord(), 1.0)  # type: ignore[arg-type]
    runner.sampled = {i: [int(c)] for i, c in enumerate(start.clients)}
    runner.num_sampled = len(start.clients)
    poisoned = SecureSum(np.full(DIM, 1e6), contributors=list(runner.sampled))
    record = strategy.server.close_round(1, runner.secure_replies(1, poisoned))
    assert strategy.history[1].skipped == 1 and record.stats.skipped == 1
    assert "implausible" in " ".join(r.getMessage() for r in dpfedavg_log)
    assert np.abs(record.w).max() < 10
