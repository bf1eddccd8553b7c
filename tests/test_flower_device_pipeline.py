"""The Flower clients on the device pipeline (issue 37, item 4): a SuperNode hosting virtual clients.

A node with ``clients-per-node`` > 1 trains a torch task's sampled clients on the task's device
(`dpfedavg.engines.batched.device_client_results()`): local steps, bound and each client's own noise there,
and one crossing to the host per block. Each virtual client's ``g + zeta`` must be the vector that client
sends from a SuperNode of its own (the ClientApp's client-by-client path, `client_round_update()` on the
host): seeded mode, float64, to 1e-12 of the vector's scale; and a block must cross as one array holding
exactly the noisy rows the node replies with (a `torch.overrides.TorchFunctionMode` records the crossings).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flwr.app import ConfigRecord, MessageType  # noqa: E402
from test_device_pipeline import _HostCopies  # noqa: E402

from dpfedavg.config import RunConfig  # noqa: E402
from dpfedavg.core import seeding  # noqa: E402
from dpfedavg.engines import batched  # noqa: E402
from dpfedavg.flower import client_app  # noqa: E402
from dpfedavg.flower.app_strategy import DPFedAvg  # noqa: E402
from dpfedavg.flower.protocol import (  # noqa: E402
    ARRAYS,
    CLEAN_UPDATE_KEY,
    CLIENT_IDS,
    CONFIG,
    DIAGNOSTICS,
    DIVERGED_CLIENT_IDS,
    METRICS,
    UPDATE_KEY,
    UPDATE_NORM,
    UPDATE_NORMS,
    block_key,
    instructions_from_config_record,
    to_array_record,
)
from dpfedavg.flower.testing import InProcessGrid  # noqa: E402
from dpfedavg.tasks.torch_task import TorchTask  # noqa: E402

NUM_CLIENTS = 12
PER_NODE = 6  # two SuperNodes
DIM = 5 * 7 + 7 + 7 * 3 + 3
DIVERGING = 4  # the client whose data make its local steps NaN (in the cases that ask for it)


def _task(cfg: RunConfig, diverging: bool) -> TorchTask:
    rng = np.random.default_rng(1)
    clients = [(rng.standard_normal((m, 5)).astype(np.float32), rng.integers(0, 3, m))
               for m in rng.integers(3, 9, NUM_CLIENTS)]  # fmt: skip
    if diverging:
        clients[DIVERGING][0][0, 0] = np.nan
    model = lambda: torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))  # noqa: E731
    return TorchTask(cfg, model=model, clients=clients, name="tiny")


def _cfg(tmp_path: Path, **values) -> RunConfig:
    base = {"num-clients": NUM_CLIENTS, "clients-per-round": float(NUM_CLIENTS), "num-rounds": 2, "local-steps": 3,
            "local-lr": 0.3, "torch-dtype": "float64", "device": "cpu", "epsilon": 0.0, "noise-multiplier": 1.0,
            "delta": 1e-5, "clip": 0.5, "seed": 5, "output-dir": str(tmp_path),
            "cache-dir": str(tmp_path / "cache"), "clients-per-node": PER_NODE}  # fmt: skip
    return RunConfig.from_run_config({**base, **values})


def _replies(cfg: RunConfig, monkeypatch, diverging: bool, node_config: dict | None = None) -> tuple[dict, dict, list]:
    """Round 1 through the ClientApp (full participation): each client's noisy vector, its diagnostics, the grid."""
    tasks = {cfg: _task(cfg, diverging)}
    tasks[cfg].module  # noqa: B018 - built (and moved to the device) before the round: not a crossing of the round
    monkeypatch.setattr(client_app, "_task", lambda c: tasks.setdefault(c, _task(c, diverging)))
    w = np.random.default_rng(2).standard_normal(DIM) * 0.5
    grid = InProcessGrid(client_app.app, cfg.num_nodes, cfg.to_run_config(), node_config=node_config)
    strategy = DPFedAvg(cfg, dim=DIM)
    strategy.discover_clients(grid)
    messages = list(strategy.configure_train(1, to_array_record(w), ConfigRecord(), grid))
    noisy, extra = {}, {}
    for reply in grid.send_and_receive(messages):
        if reply.has_error():
            extra.setdefault("errors", []).append(reply.error.reason)
            continue
        metrics = reply.content[METRICS]
        ids = list(metrics[CLIENT_IDS]) if CLIENT_IDS in metrics else [int(metrics["partition-id"])]
        norms = list(metrics[UPDATE_NORMS]) if UPDATE_NORMS in metrics else [metrics.get(UPDATE_NORM)]
        norms = norms if norms != [None] else [None] * len(ids)  # secure noise: no norms are sent
        extra.setdefault("diverged", []).extend(metrics.get(DIVERGED_CLIENT_IDS, []))
        single = cfg.clients_per_node == 1
        for client_id, norm in zip(ids, norms, strict=True):
            key = UPDATE_KEY if single else block_key(UPDATE_KEY, client_id)
            noisy[client_id] = reply.content[ARRAYS][key].numpy()
            extra[("norm", client_id)] = norm
            if DIAGNOSTICS in reply.content:
                clean_key = CLEAN_UPDATE_KEY if single else block_key(CLEAN_UPDATE_KEY, client_id)
                extra[("clean", client_id)] = reply.content[DIAGNOSTICS][clean_key].numpy()
    return noisy, extra, grid.sent


CASES = {
    "clip-diagnostics-diverged": ({"algorithm": "clip", "diagnostics": True}, True, None),
    "norm-minibatches": ({"algorithm": "norm", "local-batch-size": 2}, False, None),
    "adaptive-clip": ({"algorithm": "adaptive-clip", "clip-count-stddev": 2.0}, False, None),
    "diverged-under-a-policy": ({"algorithm": "clip"}, True, {"allow-evaluate": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_virtual_clients_on_the_device_send_the_client_by_client_vectors(
    case: str, tmp_path: Path, monkeypatch
) -> None:
    """Seeded, float64: each virtual client's g + zeta (norm, clean g) equals its one-client node's to 1e-12."""
    values, diverging, policy = CASES[case]
    monkeypatch.setattr(batched, "BLOCK_ELEMENTS", 4 * DIM)  # 4 clients per block: blocks of 4 and 2 per node
    virtual = _cfg(tmp_path, **values)
    calls: list[int] = []
    device_results = batched.device_client_results
    monkeypatch.setattr(batched, "device_client_results", lambda *a, **k: calls.append(1) or device_results(*a, **k))
    got, got_extra, _ = _replies(virtual, monkeypatch, diverging, policy)
    assert len(calls) == virtual.num_nodes  # both nodes went through the device pipeline
    want, want_extra, _ = _replies(virtual.replace(clients_per_node=1), monkeypatch, diverging, policy)
    assert sorted(got) == sorted(want)
    expected_ids = set(range(NUM_CLIENTS)) - ({DIVERGING} if diverging and policy is None else set())
    assert set(got) == expected_ids
    release = DIM + (1 if values["algorithm"] == "adaptive-clip" else 0)
    for client_id in want:
        assert got[client_id].shape == (release,)
        scale = np.abs(want[client_id]).max()
        np.testing.assert_allclose(got[client_id], want[client_id], rtol=0, atol=1e-12 * scale)
        np.testing.assert_allclose(got_extra[("norm", client_id)], want_extra[("norm", client_id)], rtol=1e-12)
        if values.get("diagnostics"):
            np.testing.assert_allclose(got_extra[("clean", client_id)], want_extra[("clean", client_id)],
                                       rtol=0, atol=1e-12 * scale)  # fmt: skip
    if diverging and policy is None:  # the virtual node lists it; its own node's reply is an error
        assert got_extra["diverged"] == [DIVERGING] and len(want_extra["errors"]) == 1
    if policy is not None:  # under a policy the diverged client sends 0 + zeta, on both paths
        assert not got_extra.get("diverged") and not want_extra.get("errors")
        assert got_extra[("norm", DIVERGING)] == 0.0


def test_secure_noise_on_the_device_gives_each_client_its_own_os_seeded_generator(tmp_path: Path, monkeypatch) -> None:
    """A node's ``secure-noise``: each virtual client's noise comes from a fresh `secure_rng()`, not the seeded stream.

    ``secure_rng()`` is replaced by numbered seeded generators so that the draw can be checked: each client's
    ``(g + zeta_secure) - (g + zeta_seeded)`` divided by ``s`` plus its seeded normals (computed here with numpy
    from ``noise_rng``) must be the normals of exactly one of the generators, one generator per client.
    """
    monkeypatch.setattr(batched, "BLOCK_ELEMENTS", 4 * DIM)
    cfg = _cfg(tmp_path, algorithm="clip")
    seeded, _, sent = _replies(cfg, monkeypatch, diverging=False)
    handed: list[np.random.Generator] = []

    def numbered() -> np.random.Generator:
        handed.append(np.random.default_rng([77, len(handed)]))
        return handed[-1]

    monkeypatch.setattr(seeding, "secure_rng", numbered)
    calls: list[int] = []
    device_results = batched.device_client_results
    monkeypatch.setattr(batched, "device_client_results", lambda *a, **k: calls.append(1) or device_results(*a, **k))
    secure, _, _ = _replies(cfg, monkeypatch, diverging=False, node_config={"secure-noise": True})
    assert len(calls) == cfg.num_nodes  # on the device pipeline
    assert len(handed) == NUM_CLIENTS  # one generator per client, none shared
    (train, *_) = [m for m in sent if m.metadata.message_type == MessageType.TRAIN]  # after the partition queries
    ins = instructions_from_config_record(train.content[CONFIG])
    assert ins.noise_std > 0
    generators = np.stack([np.random.default_rng([77, j]).standard_normal(DIM) for j in range(NUM_CLIENTS)])
    used = []
    for client_id in range(NUM_CLIENTS):
        z_seeded = seeding.noise_rng(ins.noise_seed, client_id).standard_normal(DIM)
        z_secure = (secure[client_id] - seeded[client_id]) / ins.noise_std + z_seeded
        (match,) = np.flatnonzero(np.abs(generators - z_secure).max(axis=1) < 1e-9)
        used.append(int(match))
    assert sorted(used) == list(range(NUM_CLIENTS))


def test_a_virtual_node_brings_each_block_to_the_host_once(tmp_path: Path, monkeypatch) -> None:
    """One crossing per block, and what crosses is the block's noisy rows (plus norms and flags) the node replies with.

    Today's path before the device pipeline (`client_results()`) brought each block's ``u`` over instead and
    bounded and noised it on the host: this test failed there (the blocks of ``u`` crossed).
    """
    monkeypatch.setattr(batched, "BLOCK_ELEMENTS", 4 * DIM)  # blocks of 4 clients
    cfg = _cfg(tmp_path, **{"clients-per-node": NUM_CLIENTS})  # one node hosting every client
    shapes: list[tuple[int, ...]] = []
    arrays: list[np.ndarray] = []  # the values each crossing brought into numpy
    train_block = client_app._train_block

    class Kept(_HostCopies):
        """Also keeps what each conversion into numpy brought over."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = super().__torch_function__(func, types, args, kwargs)
            if getattr(func, "__name__", "") in ("__array__", "numpy") and isinstance(args[0], torch.Tensor):
                arrays.append(np.array(out, copy=True))
            return out

    def watched(*args, **kwargs):
        with Kept() as mode:
            reply = train_block(*args, **kwargs)
        shapes.extend(mode.shapes)
        return reply

    monkeypatch.setattr(client_app, "_train_block", watched)
    got, _, _ = _replies(cfg, monkeypatch, diverging=False)
    assert len(got) == NUM_CLIENTS
    # 12 clients in blocks of 4: three crossings of (4, d + 2) (the rows, one norm and one flag per client)
    assert [a.shape for a in arrays] == [(4, DIM + 2)] * 3
    assert set(shapes) == {(4, DIM + 2)}, shapes  # nothing else crossed (no row, no u, no per-client scalar)
    rows = np.concatenate([a[:, :DIM] for a in arrays])
    np.testing.assert_array_equal(rows, np.stack([got[c] for c in range(NUM_CLIENTS)]))
