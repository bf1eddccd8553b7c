"""The batched engine's device pipeline (issue 37): local steps, bound, noise and sum on the task's device.

The device round (`dpfedavg.engines.batched.device_round_sums()`) is checked against the client-by-client
path every other engine takes (`client_results()` -> `round_block_update()` -> `DPServer.close_round()`):
the same trajectory to 1e-12 (float64; the sums are formed per block instead of client by client, so they
agree to the rounding of a sum). And a round must not copy a block or a client's vector to the host: a
`torch.overrides.TorchFunctionMode` records every call that moves data off the device.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.overrides import TorchFunctionMode  # noqa: E402

from dpfedavg.config import RunConfig  # noqa: E402
from dpfedavg.engines import audit, batched  # noqa: E402
from dpfedavg.engines.batched import InProcessRunner, client_results, run_batched  # noqa: E402
from dpfedavg.tasks.torch_task import TorchTask  # noqa: E402

NUM_CLIENTS = 24
DIM = 5 * 7 + 7 + 7 * 3 + 3  # the model's parameters


def _clients(diverging: int | None = None) -> list:
    rng = np.random.default_rng(0)
    sizes = rng.integers(3, 9, NUM_CLIENTS)
    out = [(rng.standard_normal((m, 5)).astype(np.float32), rng.integers(0, 3, m)) for m in sizes]
    if diverging is not None:  # one client's data make its local steps NaN: it sends nothing
        out[diverging][0][0, 0] = np.nan
    return out


def _task(cfg: RunConfig, diverging: int | None = None) -> TorchTask:
    model = lambda: torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))  # noqa: E731
    return TorchTask(cfg, model=model, clients=_clients(diverging), name="tiny")


def _cfg(tmp_path: Path, name: str, **values) -> RunConfig:
    base = {"num-clients": NUM_CLIENTS, "clients-per-round": 12.0, "num-rounds": 3, "local-steps": 3,
            "local-lr": 0.3, "torch-dtype": "float64", "device": "cpu", "epsilon": 0.0, "noise-multiplier": 1.0,
            "delta": 1e-5, "clip": 0.5, "seed": 5, "eval-every": 3, "output-dir": str(tmp_path),
            "cache-dir": str(tmp_path / "cache"), "run-name": name}  # fmt: skip
    return RunConfig.from_run_config({**base, **values})


def _trajectory(cfg: RunConfig, diverging: int | None, **kw) -> tuple[np.ndarray, list]:
    seen: list[np.ndarray] = []
    result = run_batched(cfg, task=lambda c: _task(c, diverging), on_round=lambda k, w: seen.append(np.array(w)), **kw)
    return np.stack(seen), result


CASES = {
    "norm-minibatches": ({"algorithm": "norm", "local-batch-size": 2}, None),
    "clip-diverged-diagnostics": ({"algorithm": "clip", "diagnostics": True}, 7),
    "adaptive-clip": ({"algorithm": "adaptive-clip", "clip-count-stddev": 2.0}, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_device_round_gives_the_client_by_client_trajectory(case: str, tmp_path: Path, monkeypatch) -> None:
    """Seeded noise, float64: the device pipeline equals the path of every other engine to 1e-12."""
    values, diverging = CASES[case]
    monkeypatch.setattr(batched, "BLOCK_ELEMENTS", 5 * DIM)  # 5 clients per block: several blocks a round
    device, _ = _trajectory(_cfg(tmp_path, "device", **values), diverging)
    # the same run through client_results (a client_results_fn of the caller's keeps the host path)
    host, _ = _trajectory(_cfg(tmp_path, "host", **values), diverging,
                          client_results_fn=lambda *a, **k: client_results(*a, **k))  # fmt: skip
    np.testing.assert_allclose(device, host, rtol=0, atol=1e-12 * np.abs(host).max())
    assert np.abs(device[-1] - device[0]).max() > 1e-3  # the run moved
    metrics = [(tmp_path / n / "metrics.csv").read_text().splitlines() for n in ("device", "host")]
    for row_d, row_h in zip(metrics[0][1:], metrics[1][1:], strict=True):  # counts, norms, SNR; not elapsed_s
        a, b = row_d.split(",")[:-1], row_h.split(",")[:-1]
        np.testing.assert_allclose([float(x or "nan") for x in a], [float(x or "nan") for x in b], rtol=1e-9)
    if diverging is not None:  # client 7 was sampled and sent nothing, on both paths
        rows = list(csv.DictReader((tmp_path / "device" / "metrics.csv").open()))
        assert sum(int(r["num_failed"] or 0) for r in rows) >= 1


#: Calls that move a tensor's values to the host (or block on them): only the round's sums may make them.
_TO_HOST = {"cpu", "numpy", "item", "tolist", "__array__", "__float__", "__int__", "__bool__", "__index__"}


class _HostCopies(TorchFunctionMode):
    """Records the shape of every tensor whose values a call brings to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_cpu = name == "to" and any(str(a).startswith("cpu") for a in (*args[1:], kwargs.get("device")))
        if (name in _TO_HOST or to_cpu) and args and isinstance(args[0], torch.Tensor):
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **kwargs)


def test_a_round_copies_no_block_and_no_client_to_the_host(tmp_path: Path, monkeypatch) -> None:
    """Per round, only 1-D tensors (the sum, one norm and one flag per client) cross, as often for 1 block as for 5."""
    rounds: dict[int, list[list[tuple[int, ...]]]] = {}
    run_round = InProcessRunner.run_round

    def watched(self, server_round, clients, w, ins):
        with _HostCopies() as mode:
            replies = run_round(self, server_round, clients, w, ins)
        rounds.setdefault(block_elements, []).append(mode.shapes)
        return replies

    monkeypatch.setattr(InProcessRunner, "run_round", watched)
    for block_elements in (NUM_CLIENTS * DIM, 3 * DIM):  # one block a round; blocks of 3 clients
        monkeypatch.setattr(batched, "BLOCK_ELEMENTS", block_elements)
        _trajectory(_cfg(tmp_path, f"b{block_elements}", **{"clients-per-round": 15.0}), None)
    one, many = rounds[NUM_CLIENTS * DIM], rounds[3 * DIM]
    assert [len(s) for s in one] == [len(s) for s in many]  # no crossing per block or per client
    assert all(len(shape) <= 1 for shapes in one + many for shape in shapes), many  # no (B, d) block, no row
    assert max(len(s) for s in many) <= 8


def test_canary_rounds_run_on_the_device_with_the_host_trajectory(tmp_path: Path, monkeypatch) -> None:
    """With inserted canaries the real clients' round still runs on the device, the canaries' ``g + zeta`` (the
    server's, `dpfedavg.engines.canaries.WithCanaries`) are added to its sum: the host run's trajectory."""
    monkeypatch.setattr(batched, "BLOCK_ELEMENTS", 5 * DIM)
    sampled_canaries: list[int] = []
    device_round_sums = batched.device_round_sums

    def counted(task, clients, *args, **kwargs):
        sampled_canaries.append(int(np.sum(clients >= NUM_CLIENTS)))
        return device_round_sums(task, clients, *args, **kwargs)

    monkeypatch.setattr(batched, "device_round_sums", counted)
    monkeypatch.setattr(audit, "write_audit_plot", lambda *a, **k: None)  # the figure is not what is checked here
    values = {"algorithm": "clip", "canary-clients": 10, "num-rounds": 2}
    device, _ = _trajectory(_cfg(tmp_path, "device", **values), None)
    assert len(sampled_canaries) == 2 and sum(sampled_canaries) == 0  # every round on the device, real clients only
    host, _ = _trajectory(_cfg(tmp_path, "host", **values), None,
                          client_results_fn=lambda *a, **k: client_results(*a, **k))  # fmt: skip
    assert len(sampled_canaries) == 2  # the host run did not use the device pipeline
    np.testing.assert_allclose(device, host, rtol=0, atol=1e-12 * np.abs(host).max())
    assert np.abs(device[-1] - device[0]).max() > 1e-3  # the run moved


@pytest.mark.parametrize("algorithm", ["clip", "adaptive-clip"])
def test_block_rows_are_each_clients_private_update(algorithm: str) -> None:
    """`block_rows()` (numpy or a tensor) gives row by row what `round_block_update()` gives each client."""
    from dpfedavg.core import round_block_update
    from dpfedavg.core.pipeline import block_rows
    from dpfedavg.core.types import RoundInstructions

    adaptive = algorithm == "adaptive-clip"
    ins = RoundInstructions(server_round=2, local_lr=0.1, local_steps=1, algorithm=algorithm, clip=1.5, noise_std=0.7,
                            noise_seed=123, diagnostics=True, count_scale=0.4 if adaptive else 0.0)  # fmt: skip
    u = np.random.default_rng(3).standard_normal((6, 9)) * [[0.1], [1.0], [3.0], [0.5], [2.0], [1.0]]
    u[3, 4] = np.nan  # client 13 diverged: no result
    ids = np.arange(10, 16)
    want = round_block_update(u, ins, ids)
    for block in (u, torch.as_tensor(u)):
        results, failed = block_rows(block, ins, ids, keep_clean=True).to_host().client_results(ids)
        assert failed == [13] and [r.client_id for r in results] == [10, 11, 12, 14, 15]
        for r, w in zip(results, [w for w in want if w is not None], strict=True):
            assert r.noisy.shape == (10 if adaptive else 9,)
            np.testing.assert_allclose(r.noisy, w.noisy, rtol=0, atol=1e-14)
            np.testing.assert_allclose(r.clean, w.clean, rtol=0, atol=1e-14)
            assert r.update_norm == pytest.approx(w.update_norm, rel=1e-14)
