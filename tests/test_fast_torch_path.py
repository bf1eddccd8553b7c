"""The fast torch path (``torch-compile = true`` with ``torch-dtype = float32``) against the eager float64 path.

The fast path compiles each local step of a chunk of clients (`TorchTask._compiled_step`, chunks of one size, the
last padded) and runs the device pipeline's bound, noise and sum in float32 (`dpfedavg.core.pipeline`). Its
trajectory must stay within the stated tolerance of the eager float64 path's, with the same seeded noise:
`dpfedavg.core.pipeline.FLOAT32_TOLERANCE` for the pipeline on one block, `TRAJECTORY_TOLERANCE` for a run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dpfedavg.config import RunConfig  # noqa: E402
from dpfedavg.core.pipeline import FLOAT32_TOLERANCE, client_normals, round_block_sum  # noqa: E402
from dpfedavg.core.types import RoundInstructions  # noqa: E402
from dpfedavg.engines import batched  # noqa: E402
from dpfedavg.engines.batched import run_batched  # noqa: E402
from dpfedavg.tasks import torch_task  # noqa: E402
from dpfedavg.tasks.torch_task import TorchTask  # noqa: E402

NUM_CLIENTS = 24
DIM = 5 * 7 + 7 + 7 * 3 + 3  # the model's parameters
#: The fast path's trajectory against the eager float64 path's: ``max_k |w_k - w_k^ref| <= TRAJECTORY_TOLERANCE *
#: max |w^ref|`` (float32 local steps and pipeline; a few rounds of a small model; measured 2.0e-8 to 2.5e-8, and
#: 1.2e-8 to 1.7e-8 for the eager float32 path).
TRAJECTORY_TOLERANCE = 1e-6


def _task(cfg: RunConfig) -> TorchTask:
    rng = np.random.default_rng(0)  # 6 examples each: one block shape (the compiled step is specialised on it)
    clients = [(rng.standard_normal((6, 5)).astype(np.float32), rng.integers(0, 3, 6)) for _ in range(NUM_CLIENTS)]
    model = lambda: torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))  # noqa: E731
    return TorchTask(cfg, model=model, clients=clients, name="tiny")


def _trajectory(tmp_path: Path, name: str, **values) -> np.ndarray:
    base = {"num-clients": NUM_CLIENTS, "clients-per-round": 12.0, "num-rounds": 4, "local-steps": 3,
            "local-lr": 0.3, "device": "cpu", "epsilon": 0.0, "noise-multiplier": 1.0, "delta": 1e-5, "clip": 0.5,
            "seed": 5, "eval-every": 4, "weight-decay": 1e-3, "server-momentum": 0.5, "output-dir": str(tmp_path),
            "cache-dir": str(tmp_path / "cache"), "run-name": name}  # fmt: skip
    seen: list[np.ndarray] = []
    cfg = RunConfig.from_run_config({**base, **values})
    run_batched(cfg, task=_task, on_round=lambda k, w: seen.append(np.array(w)))
    return np.stack(seen)


CASES = {"clip": {"algorithm": "clip"}, "adaptive-clip": {"algorithm": "adaptive-clip", "clip-count-stddev": 2.0}}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_path_trajectory_is_within_the_tolerance_of_eager_float64(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiled chunks (3 clients each, the last padded) and the float32 pipeline over several blocks a round."""
    monkeypatch.setattr(batched, "BLOCK_ELEMENTS", 5 * DIM)  # 5 clients per block: several blocks a round
    monkeypatch.setattr(torch_task, "COMPILE_CHUNK_CLIENTS", 3)  # blocks of 5: a full chunk and a padded one
    reference = _trajectory(tmp_path, "eager64", **CASES[case], **{"torch-dtype": "float64"})
    fast = _trajectory(tmp_path, "fast32", **CASES[case], **{"torch-dtype": "float32", "torch-compile": True})
    error = np.abs(fast - reference).max() / np.abs(reference).max()
    assert error <= TRAJECTORY_TOLERANCE, error
    assert np.abs(reference[-1] - reference[0]).max() > 1e-2  # the run moved
    # and the difference is float32's: the eager float32 path is as far from float64 (not a different algorithm)
    eager32 = _trajectory(tmp_path, "eager32", **CASES[case], **{"torch-dtype": "float32"})
    assert error <= 10 * max(np.abs(eager32 - reference).max() / np.abs(reference).max(), 1e-7)


def test_float32_pipeline_is_within_its_tolerance_and_keeps_the_noise_stream() -> None:
    """`round_block_sum` on a float32 block: the float64 sum to `FLOAT32_TOLERANCE`, the same clients' normals."""
    rng = np.random.default_rng(3)
    u = rng.standard_normal((40, 300)) * rng.uniform(0.1, 3.0, (40, 1))
    ids = rng.choice(1000, 40, replace=False)
    for algorithm, count_scale in (("clip", 0.0), ("norm", 0.0), ("adaptive-clip", 2.0)):
        ins = RoundInstructions(server_round=2, local_lr=0.1, local_steps=3, algorithm=algorithm, clip=1.5,
                                noise_std=0.7, noise_seed=11, diagnostics=False, count_scale=count_scale)  # fmt: skip
        want = round_block_sum(torch.as_tensor(u), ins, ids, keep_clean=True).to_host()
        sums = round_block_sum(torch.as_tensor(u[:25], dtype=torch.float32), ins, ids[:25], keep_clean=True)
        got = round_block_sum(torch.as_tensor(u[25:], dtype=torch.float32), ins, ids[25:], sums, keep_clean=True)
        got = got.to_host()
        assert got.noisy.dtype == np.float64 and got.clean.dtype == np.float64
        for a, b in ((got.noisy, want.noisy), (got.clean, want.clean), (got.norms, want.norms)):
            np.testing.assert_allclose(a, b, rtol=0, atol=FLOAT32_TOLERANCE * np.abs(b).max())
    # the noise is each client's own float64 stream, cast once: a zero block's noisy sum is their float32 sum
    ins = RoundInstructions(server_round=1, local_lr=0.1, local_steps=3, algorithm="clip", clip=1.0,
                            noise_std=0.5, noise_seed=4, diagnostics=False)  # fmt: skip
    noisy = round_block_sum(torch.zeros((6, 50), dtype=torch.float32), ins, ids[:6]).to_host().noisy
    zeta = (client_normals(4, ids[:6], 50) * 0.5).astype(np.float32)
    np.testing.assert_array_equal(noisy, torch.as_tensor(zeta).sum(0).double().numpy())
