"""Torch tasks (issue 18): the torch.func adapter, mini-batches, the logistic torch backend, user task modules.

Every equality is against an independent computation: `dpfedavg.core.client_update()`
(the step-by-step loop every engine shares) on the task's own single-client gradient, the
numpy backend's closed form, or a per-client loop. Tolerances: float64 1e-9 (observed ~1e-15),
float32 1e-5 relative to ``max |u|`` (observed ~1e-7). Runs on the CPU build; on a machine with a
GPU ``device = "auto"`` puts the same tests on CUDA.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dpfedavg.config import ConfigError, RunConfig  # noqa: E402
from dpfedavg.core import client_update  # noqa: E402
from dpfedavg.tasks import build_task, load_task_factory, resolve_task, torch_task  # noqa: E402
from dpfedavg.tasks.datasets import save_npy  # noqa: E402
from dpfedavg.tasks.torch_task import TorchTask, minibatch_indices  # noqa: E402

F32_RTOL = 1e-5
F64_TOL = 1e-9
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _uneven_clients(num_clients: int = 6, features: int = 5, classes: int = 3, seed: int = 0) -> list:
    """Clients with 3..8 examples each (so a block needs padding and masks)."""
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((m, features)).astype(np.float32), rng.integers(0, classes, m))
        for m in rng.integers(3, 9, num_clients)
    ]


def _mlp_task(dtype: str = "float64", batch_size: int = 0, **kw) -> TorchTask:
    clients = _uneven_clients()
    cfg = RunConfig(
        task="mlp-test",
        num_clients=len(clients),
        clients_per_round=3.0,
        torch_dtype=dtype,
        local_batch_size=batch_size,
        weight_decay=0.01,
        seed=3,
    )
    model = lambda: torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))  # noqa: E731
    return TorchTask(cfg, model=model, clients=clients, test=clients[0], **kw)


def test_block_update_equals_client_update_on_the_tasks_own_gradient() -> None:
    """vmap over a padded block == core.client_update on client_grad_fn, client by client (float64, 1e-9)."""
    task = _mlp_task("float64")
    w = task.initial_weights()
    ids = np.array([0, 2, 3, 5])
    block = task.client_batch_update_fn(ids)(w, 0.3, 6)
    loop = np.stack([client_update(w, task.client_grad_fn(int(i)), 0.3, 6) for i in ids])
    assert np.linalg.norm(loop, axis=1).min() > 0.1  # not trivially small
    np.testing.assert_allclose(block, loop, rtol=F64_TOL, atol=F64_TOL)
    # the same block one client at a time (blocks of one): the padding changes nothing
    single = np.concatenate([task.client_batch_update_fn(np.array([i]))(w, 0.3, 6) for i in ids])
    np.testing.assert_allclose(block, single, rtol=F64_TOL, atol=F64_TOL)


@pytest.mark.parametrize(("weight_decay", "lerp_from"), [(0.0, None), (0.01, None), (2.0, None), (0.01, 1.0)])
def test_runs_block_equals_client_update_for_any_weight_decay(
    weight_decay: float, lerp_from: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs (own w_k and eta_k) x a padded block == core.client_update per run and client (float64, 1e-9).

    The local steps split the iterate into a decayed w_k and the clients' displacement and take the weight decay
    in one lerp_ (TorchTask._chunk_steps): no decay, the tests' 0.01, eta lambda = 0.6 >= 0.5 (lerp_'s other
    formula), and 0.01 below a raised LERP_MIN_DECAY (the two-pass branch that small decays take).
    """
    if lerp_from is not None:
        monkeypatch.setattr(torch_task, "LERP_MIN_DECAY", lerp_from)
    task = _mlp_task("float64", weight_decay=weight_decay)
    w0 = task.initial_weights()
    weights, lrs, ids = np.stack([w0, 0.5 * w0 - 0.1]), np.array([0.3, 0.05]), np.array([0, 2, 3, 5])
    u = task.client_runs_update_fn(ids)(weights, lrs, 6)
    single = task.client_batch_update_fn(ids)(weights[1], lrs[1], 6)  # one run: no vmap over runs
    for r in range(2):
        loop = np.stack([client_update(weights[r], task.client_grad_fn(int(i)), lrs[r], 6) for i in ids])
        assert np.linalg.norm(loop, axis=1).min() > 0.1
        np.testing.assert_allclose(u[r], loop, rtol=F64_TOL, atol=F64_TOL)
    np.testing.assert_allclose(single, u[1], rtol=F64_TOL, atol=F64_TOL)


def test_gradient_is_the_objectives_derivative() -> None:
    """client_grad_fn against central differences of f_i = mean CE + lambda/2 ||w||^2 written out in torch."""
    task = _mlp_task("float64")
    w = task.initial_weights() + 0.1
    x, y = (torch.as_tensor(a) for a in _uneven_clients()[1])

    def f(flat: np.ndarray) -> float:
        params = dict(zip(task.layout.names, torch.split(torch.as_tensor(flat), task.layout.numels), strict=True))
        h = torch.tanh(x.double() @ params["0.weight"].view(7, 5).T + params["0.bias"])
        out = h @ params["2.weight"].view(3, 7).T + params["2.bias"]
        return float(torch.nn.functional.cross_entropy(out, y) + 0.005 * (torch.as_tensor(flat) ** 2).sum())

    eps = 1e-6
    numeric = np.array([(f(w + eps * e) - f(w - eps * e)) / (2 * eps) for e in np.eye(task.dim)])
    np.testing.assert_allclose(task.client_grad_fn(1)(w), numeric, rtol=1e-6, atol=1e-8)


def test_float32_block_agrees_with_the_float64_loop() -> None:
    task32, task64 = _mlp_task("float32"), _mlp_task("float64")
    w = task64.initial_weights()
    ids = np.arange(6)
    u32 = task32.client_batch_update_fn(ids)(w, 0.3, 6)
    u64 = np.stack([client_update(w, task64.client_grad_fn(int(i)), 0.3, 6) for i in ids])
    assert u32.dtype == np.float64
    np.testing.assert_allclose(u32, u64, atol=F32_RTOL * np.abs(u64).max())


def test_minibatches_are_deterministic_per_seed_client_and_round() -> None:
    task = _mlp_task("float64", batch_size=2)
    w = task.initial_weights()
    ids = np.array([1, 4])
    first = task.client_batch_update_fn(ids, server_round=5)(w, 0.3, 4)
    again = _mlp_task("float64", batch_size=2).client_batch_update_fn(ids, server_round=5)(w, 0.3, 4)
    np.testing.assert_array_equal(first, again)  # a fresh task (another process) draws the same batches
    other_round = task.client_batch_update_fn(ids, server_round=6)(w, 0.3, 4)
    assert np.abs(first - other_round).max() > 1e-3
    full = _mlp_task("float64").client_batch_update_fn(ids)(w, 0.3, 4)
    assert np.abs(first - full).max() > 1e-3  # mini-batches are not the full batch
    # the ClientApp's path (one client, core.client_update on the round's oracle) draws the same batches
    loop = np.stack([client_update(w, task.client_round_grad_fn(int(i), 5), 0.3, 4) for i in ids])
    np.testing.assert_allclose(first, loop, rtol=F64_TOL, atol=F64_TOL)
    # each step's batch: min(b, m_i) distinct examples
    batches = minibatch_indices(3, 1, 5, 4, 2)
    picks = [next(batches) for _ in range(50)]
    assert all(len(p) == 2 and len(set(p)) == 2 and p.max() < 4 for p in picks)
    assert len({tuple(p) for p in picks}) == 6  # every pair of the 4 examples comes up


def test_batch_size_at_least_the_client_size_is_the_full_batch() -> None:
    w = _mlp_task().initial_weights()
    ids = np.arange(6)
    big = _mlp_task("float64", batch_size=100).client_batch_update_fn(ids, server_round=1)(w, 0.3, 3)
    full = _mlp_task("float64").client_batch_update_fn(ids)(w, 0.3, 3)
    np.testing.assert_allclose(big, full, rtol=F64_TOL, atol=F64_TOL)


def test_initial_weights_follow_the_seed_and_evaluate_reports_metrics() -> None:
    a, b = _mlp_task(), _mlp_task()
    np.testing.assert_array_equal(a.initial_weights(), b.initial_weights())
    state = torch.random.get_rng_state()
    task = _mlp_task()
    _ = task.initial_weights()
    assert torch.equal(state, torch.random.get_rng_state())  # building a model leaves the global stream alone
    metrics = task.evaluate(task.initial_weights())
    assert set(metrics) == set(task.metric_names) == {"test_accuracy", "test_loss", "train_loss"}
    assert 0 <= metrics["test_accuracy"] <= 1 and metrics["train_loss"] > 0


# ------------------------------------------------------------------ logistic regression on torch
@pytest.mark.parametrize(("dtype", "tol"), [("float64", F64_TOL), ("float32", F32_RTOL)])
def test_logistic_torch_backend_equals_the_numpy_backend(tmp_path: Path, dtype: str, tol: float) -> None:
    """backend = torch (vmapped autograd steps) against numpy's exact closed form, same w layout."""
    cfg = RunConfig(task="digits", cache_dir=str(tmp_path), num_clients=20, clients_per_round=20.0)
    numpy_task = build_task(cfg)
    torch_task = build_task(cfg.replace(backend="torch", torch_dtype=dtype))
    ids = np.array([0, 7, 19])
    w = np.random.default_rng(1).standard_normal(numpy_task.dim) * 0.05
    u_np = numpy_task.client_batch_update_fn(ids)(w, 0.2, 20)
    u_torch = torch_task.client_batch_update_fn(ids)(w, 0.2, 20)  # the closed form, in torch
    assert np.linalg.norm(u_np, axis=1).min() > 1.0
    np.testing.assert_allclose(u_torch, u_np, rtol=0, atol=tol * np.abs(u_np).max())
    # the generic torch.func path (vmapped autograd steps, used with mini-batches) gives the same u
    u_vmap = torch_task.torch_task.client_batch_update_fn(ids)(w, 0.2, 20)
    np.testing.assert_allclose(u_vmap, u_np, rtol=0, atol=tol * np.abs(u_np).max())
    # and so does the ClientApp's path: core.client_update on the torch backend's autograd gradient
    u_loop = np.stack([client_update(w, torch_task.client_grad_fn(int(i)), 0.2, 20) for i in ids])
    np.testing.assert_allclose(u_loop, u_np, rtol=0, atol=tol * np.abs(u_np).max())
    np.testing.assert_allclose(
        torch_task.client_grad_fn(7)(w),
        numpy_task.client_grad_fn(7)(w),
        rtol=0,
        atol=tol * np.abs(numpy_task.client_grad_fn(7)(w)).max(),
    )
    # the forward pass on w (the module keeps W^T: flat_transposed) gives numpy's training loss
    train_loss = numpy_task.evaluate(w)["train_loss"]
    assert torch_task.torch_task.evaluate(w)["train_loss"] == pytest.approx(train_loss, rel=tol)


def test_flat_transposed_must_name_two_dimensional_parameters() -> None:
    class Bad(torch.nn.Module):
        flat_transposed = ("bias",)

        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(3, 4))
            self.bias = torch.nn.Parameter(torch.zeros(3))

        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight, self.bias)

    cfg = RunConfig(num_clients=2, clients_per_round=2.0)
    data = [(np.zeros((2, 4), np.float32), np.zeros(2, np.int64))] * 2
    with pytest.raises(ValueError, match="flat_transposed"):
        TorchTask(cfg, model=Bad(), clients=data).layout  # noqa: B018


def test_numpy_backend_rejects_minibatches(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'local-batch-size' = 4 with 'backend' = 'numpy'"):
        build_task(RunConfig(task="digits", cache_dir=str(tmp_path), local_batch_size=4))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_device_cuda_without_a_gpu_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'device' = 'cuda'.*no CUDA device"):
        build_task(RunConfig(task="mlp-digits", cache_dir=str(tmp_path), device="cuda"))
    with pytest.raises(ConfigError, match="'device' = 'gpu'"):
        RunConfig.from_run_config({"device": "gpu"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_block_update_agrees_with_cpu() -> None:
    cpu = _mlp_task("float64")
    gpu = TorchTask(
        cpu.cfg.replace(device="cuda"), model=cpu._model_source, clients=_uneven_clients(), test=_uneven_clients()[0]
    )
    assert gpu.device.type == "cuda"
    w, ids = cpu.initial_weights(), np.arange(6)
    np.testing.assert_allclose(
        gpu.client_batch_update_fn(ids)(w, 0.3, 5), cpu.client_batch_update_fn(ids)(w, 0.3, 5), atol=1e-9
    )


def _sharded_task(device: str = "cpu", batch_size: int = 0) -> TorchTask:
    """An MLP on `ShardedClients`: 8 clients owning 4 rows each of 32 generated examples."""
    from dpfedavg.tasks.torch_task import ShardedClients

    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((32, 5)).astype(np.float32), rng.integers(0, 3, 32)
    partition = rng.permutation(32).reshape(8, 4)
    cfg = RunConfig(task="mlp-test", num_clients=8, clients_per_round=4.0, torch_dtype="float64", device=device,
                    local_batch_size=batch_size, weight_decay=0.01, seed=3)  # fmt: skip
    model = lambda: torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))  # noqa: E731
    return TorchTask(cfg, model=model, clients=ShardedClients(lambda: (x, y, partition), 8), test=(x, y))


@pytest.mark.parametrize("batch_size", [0, 2])
def test_resident_shards_give_the_host_paths_updates(batch_size: int) -> None:
    """The device-resident gather (`TorchTask._device_block`, used on a GPU) gives the host gather's updates:
    planted here on the CPU, where the host path is the default."""
    host, resident = _sharded_task(batch_size=batch_size), _sharded_task(batch_size=batch_size)
    assert host._resident_shards is None  # the CPU keeps the host path
    x_all, y_all, _ = resident.data.arrays
    resident.__dict__["_resident_shards"] = (resident._x(x_all), resident._y(y_all))
    w, ids = host.initial_weights(), np.array([6, 1, 3])
    got = resident.client_batch_update_fn(ids, 2)(w, 0.3, 5)
    np.testing.assert_array_equal(got, host.client_batch_update_fn(ids, 2)(w, 0.3, 5))
    assert resident.evaluate(w) == host.evaluate(w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_resident_shards_agree_with_cpu() -> None:
    cpu, gpu = _sharded_task(), _sharded_task("cuda")
    assert gpu._resident_shards is not None
    w, ids = cpu.initial_weights(), np.array([6, 1, 3])
    np.testing.assert_allclose(gpu.client_batch_update_fn(ids)(w, 0.3, 5), cpu.client_batch_update_fn(ids)(w, 0.3, 5),
                               atol=1e-9)  # fmt: skip


# ------------------------------------------------------------------ tasks from the user's module
USER_MODULE = """
import numpy as np
import torch
from dpfedavg.tasks.torch_task import TorchTask

def make_task(cfg):
    rng = np.random.default_rng(cfg.seed)
    clients = [(rng.standard_normal((4, 3)).astype(np.float32), rng.integers(0, 2, 4)) for _ in range(cfg.num_clients)]
    return TorchTask(cfg, model=lambda: torch.nn.Linear(3, 2), clients=clients, test=clients[0])

def not_a_task(cfg):
    return object()

NOT_CALLABLE = 3
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "user_tasks_p18.py"
    path.write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield path
    sys.modules.pop("user_tasks_p18", None)


def test_task_from_a_module_or_a_file(user_module: Path) -> None:
    for spec in ("user_tasks_p18:make_task", f"{user_module}:make_task"):
        cfg = RunConfig.from_run_config({"task": spec, "num-clients": 4, "clients-per-round": 2.0})
        task = build_task(cfg)
        assert task.dim == 3 * 2 + 2 and task.num_clients == 4
        assert np.isfinite(task.client_batch_update_fn(np.array([0, 3]))(task.initial_weights(), 0.1, 2)).all()


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        ("no_such_module_p18:make_task", ["cannot import module 'no_such_module_p18'", "PYTHONPATH"]),
        ("user_tasks_p18:make_tsk", ["has no attribute 'make_tsk'", "did you mean 'make_task'"]),
        ("user_tasks_p18:NOT_CALLABLE", ["'NOT_CALLABLE' is a int, not a task factory"]),
        ("/no/such/dir/mytask.py:make_task", ["no file '/no/such/dir/mytask.py'"]),
        ("user_tasks_p18:", ["expected 'module:factory'"]),
        ("quadratc", ["'task' = 'quadratc'", "did you mean 'quadratic'", "'module:factory'"]),
    ],
)
def test_bad_task_specs_are_one_config_error(user_module: Path, spec: str, fragments: list[str]) -> None:
    """Checked where tasks are resolved (the config imports no task and no user code), before any start-up."""
    RunConfig.from_run_config({"task": spec})  # a string: the config does not import it
    with pytest.raises(ConfigError) as err:
        resolve_task(spec)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_a_factory_that_returns_no_task_is_a_config_error(user_module: Path) -> None:
    cfg = RunConfig.from_run_config({"task": "user_tasks_p18:not_a_task"})
    with pytest.raises(ConfigError, match="gave a object, not a Task: it lacks name, num_clients"):
        build_task(cfg)
    with pytest.raises(ConfigError, match="has num_clients = 4, but 'num-clients' = 5"):
        factory = load_task_factory("user_tasks_p18:make_task")
        fake = types.SimpleNamespace(
            **{
                k: getattr(factory(RunConfig(num_clients=4, clients_per_round=4.0)), k)
                for k in (
                    "name",
                    "dim",
                    "metric_names",
                    "headline_metric",
                    "initial_weights",
                    "client_grad_fn",
                    "evaluate",
                )
            },
            num_clients=4,
        )
        sys.modules["user_tasks_p18"].wrong_size = lambda cfg: fake
        build_task(RunConfig(task="user_tasks_p18:wrong_size", num_clients=5, clients_per_round=5.0))


# ------------------------------------------------------------------ the shipped examples
def _fake_prepared(cache: Path, dataset: str, features: str, train: int, dim: int, classes: int) -> None:
    """A prepared dataset of the right shape (FMNIST / CIFAR cannot be downloaded here)."""
    rng = np.random.default_rng(0)
    directory = cache / dataset / features
    directory.mkdir(parents=True)
    save_npy(directory / "train_x.npy", rng.random((train, dim), dtype=np.float32))
    save_npy(directory / "train_y.npy", np.repeat(np.arange(classes), train // classes).astype(np.int64))
    save_npy(directory / "test_x.npy", rng.random((50, dim), dtype=np.float32))
    save_npy(directory / "test_y.npy", rng.integers(0, classes, 50).astype(np.int64))
    (directory / "meta.json").write_text(json.dumps({"dataset": dataset}))


@pytest.mark.parametrize(
    ("task", "dataset", "features", "dim", "classes"),
    [
        ("mlp-fmnist", "fmnist", "pixels", 784, 10),
        ("cnn-fmnist", "fmnist", "pixels", 784, 10),
        ("mlp-cifar10", "cifar10", "resnet18-imagenet1k-v1-224px", 512, 10),
        ("mlp-cifar100", "cifar100", "resnet18-imagenet1k-v1-224px", 512, 100),
    ],
)
def test_examples_run_on_generated_data_of_the_right_shape(
    tmp_path: Path, task: str, dataset: str, features: str, dim: int, classes: int
) -> None:
    _fake_prepared(tmp_path, dataset, features, 1000, dim, classes)
    cfg = RunConfig(task=task, cache_dir=str(tmp_path), num_clients=10, clients_per_round=10.0, torch_dtype="float64")
    t = build_task(cfg)
    w = t.initial_weights()
    u = t.client_batch_update_fn(np.array([0, 9]))(w, 0.05, 2)
    assert u.shape == (2, t.dim) and np.isfinite(u).all() and np.abs(u).max() > 0
    np.testing.assert_allclose(u[1], client_update(w, t.client_grad_fn(9), 0.05, 2), rtol=F64_TOL, atol=F64_TOL)
    assert set(t.evaluate(w)) == {"test_accuracy", "test_loss", "train_loss"}


def test_mlp_digits_trains_two_rounds_with_the_batched_engine(tmp_path: Path) -> None:
    from dpfedavg.engines.batched import run_batched

    cfg = RunConfig(
        task="mlp-digits",
        cache_dir=str(tmp_path / "cache"),
        output_dir=str(tmp_path / "out"),
        run_name="r",
        num_rounds=2,
        num_clients=20,
        clients_per_round=10.0,
        local_steps=5,
        local_lr=0.3,
        clip=5.0,
        epsilon=0.0,
        noise_multiplier=0.5,
        checkpoint_every=0,
    )
    run_dir = run_batched(cfg, threads=2).directory
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + 3 and "test_accuracy" in rows[0]  # header, round 0 (w_0), rounds 1 and 2
    final = json.loads((run_dir / "config.json").read_text())["final"]
    assert final is not None


def test_torchvision_resnet18_is_preferred_when_it_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    from dpfedavg.tasks import features

    marker = torch.nn.Identity()
    fake = types.ModuleType("torchvision")
    fake.models = types.SimpleNamespace(resnet18=lambda weights=None: marker)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    assert features.resnet18() is marker
    monkeypatch.setitem(sys.modules, "torchvision", None)  # "import torchvision" fails: the hand-written one
    assert type(features.resnet18()).__name__ == "ResNet18"


def test_run_config_strings_parse_as_flwr_run_does() -> None:
    from dpfedavg.__main__ import main
    from dpfedavg.config import parse_run_config

    assert parse_run_config("task='/a b/m.py:f' num-clients=20 clients-per-round=20.0 diagnostics=true") == {
        "task": "/a b/m.py:f",
        "num-clients": 20,
        "clients-per-round": 20.0,
        "diagnostics": True,
    }
    with pytest.raises(ValueError, match="expected key=value"):
        parse_run_config("num-rounds=3 num-clients")
    with pytest.raises(ValueError, match="quote strings: task='...'"):
        parse_run_config("task=mytask:make_task")
    assert main(["--run-config", "task='quadratc'"]) == 2  # one ConfigError, exit status 2


def test_torch_task_modules_import_without_loading_torch() -> None:
    code = (
        "import sys\n"
        "import dpfedavg.config, dpfedavg.tasks, dpfedavg.tasks.torch_task, dpfedavg.tasks.torch_examples\n"
        "import dpfedavg.__main__\n"
        "import dpfedavg.engines.batched\n"
        "assert 'torch' not in sys.modules and 'flwr' not in sys.modules, 'torch or flwr imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})


# ------------------------------------------------------------------ the "Train your own model" tutorial
TUTORIAL = ROOT / "docs" / "tutorials" / "own-model.md"


def _tutorial_blocks():
    """The tutorial's blocks that this test runs (``run-by`` it), in page order."""
    from doc_blocks import page_blocks

    return [b for b in page_blocks(TUTORIAL) if b.kind == "run-by" and "test_own_model_tutorial" in b.attrs["test"]]


def test_own_model_tutorial_is_one_module_then_commands() -> None:
    blocks = _tutorial_blocks()
    module = [b for b in blocks if b.attrs.get("file") == "mytask.py"]
    assert len(module) == 1 and blocks[0] is module[0], "the page starts with mytask.py"
    assert "def make_task(cfg)" in module[0].source and "TorchTask(" in module[0].source
    commands = [line for b in blocks if b.is_shell for line in b.source.splitlines() if not line.startswith("#")]
    assert any(c.startswith('flwr run "$DPFEDAVG"') for c in commands)
    assert any(c.startswith("python -m dpfedavg") for c in commands)
    assert any("load_into" in b.source for b in blocks if b.is_python), "loading w_final into the model is shown"


@pytest.mark.slow
def test_own_model_tutorial(tmp_path: Path) -> None:
    """docs/tutorials/own-model.md, every block that names this test, as written and in order, from a
    folder outside the repository: ``mytask.py`` is written from its block, bash blocks run with
    ``bash -e``, Python blocks with the project folder as the working directory.

    ``dpfedavg`` is this checkout (``PYTHONPATH``, as an editable install); ``flwr run`` talks to a
    private SuperLink (``LocalSuperLink``: its own ports and FLWR_HOME, every process stopped by PID)
    with the per-run ``uv sync`` on, as a user's local SuperLink has it: torch comes from the
    environment that runs the SuperLink. A ``flwr run`` block whose output says Flower or Ray did not start
    in time runs once more, with a WARNING (``LocalSuperLink.run_command``). Both engines must finish
    (``config.json`` "final") and, one seed, follow the same trajectory; the model loaded back from ``w_final``
    must classify.
    """
    import csv
    import shutil

    from dpfedavg.engines.local_superlink import LocalSuperLink

    project = tmp_path / "project"
    project.mkdir()
    log = tmp_path / "blocks.log"
    sl = LocalSuperLink(tmp_path / "superlink", runtime_dependency_install=True)
    try:
        sl.start()
        env = dict(sl.env, PYTHONPATH=str(ROOT), PATH=f"{BIN}:{sl.env.get('PATH', '')}", MPLBACKEND="Agg")
        for block in _tutorial_blocks():
            if "file" in block.attrs:
                (project / block.attrs["file"]).write_text(block.source)
                continue
            argv = ["bash", "-e", "-c", block.source] if block.is_shell else [sys.executable, "-c", block.source]
            with log.open("a") as out:
                out.write(f"\n### {block.where}\n")
                out.flush()
                if "flwr run" in block.source:  # Flower or Ray slow to start: run once more, with a WARNING
                    before = set((project / "outputs").glob("*"))

                    def clean(before: set[Path] = before) -> None:  # what the start that timed out wrote
                        for run in set((project / "outputs").glob("*")) - before:
                            shutil.rmtree(run, ignore_errors=True)

                    proc = sl.run_command(argv, cwd=project, env=env, before_retry=clean)
                    out.write(proc.stdout)
                else:
                    proc = subprocess.run(argv, cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=600)
            assert proc.returncode == 0, f"{block.where} failed:\n{log.read_text()[-5000:]}"
    finally:
        sl.stop()
    assert sl.leftover_pids() == []
    curves = []
    for name in ("mytask-flower", "mytask-batched", "mytask-python"):
        run = project / "outputs" / name
        assert json.loads((run / "config.json").read_text())["final"] is not None, log.read_text()[-5000:]
        with (run / "metrics.csv").open() as fh:
            curves.append([float(row["test_accuracy"]) for row in csv.DictReader(fh)])
    assert len(curves[0]) == 11 and curves[0][-1] > 0.2
    np.testing.assert_allclose(curves[0], curves[1], atol=1e-6)
    assert curves[2] == curves[1]  # run() from Python is the batched engine: the same run
    accuracy = float(re.search(r"test accuracy of w_final: ([0-9.]+)", log.read_text()).group(1))
    assert accuracy > 0.2, log.read_text()[-3000:]
    assert (project / "mytask-dp.pt").exists()
    assert "mean update norm per round:" in log.read_text()


def test_compile_bucket_pads_at_most_a_quarter() -> None:
    from dpfedavg.tasks.torch_task import compile_bucket

    sizes = {b: compile_bucket(b) for b in range(1, 5000)}
    assert all(b <= s <= 1.25 * b + 1 for b, s in sizes.items())
    assert compile_bucket(600) == 640 and {compile_bucket(b) for b in range(577, 641)} == {640}


def test_compiled_local_steps_agree_with_eager(caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    """``torch-compile = true``: the compiled, padded steps give the eager steps' updates (float64, 1e-12 relative),
    for two sample counts (two padded sizes) and mini-batches; a model that cannot compile falls back with a log."""
    eager = _sharded_task(batch_size=2)
    compiled = _sharded_task(batch_size=2)
    compiled.cfg = compiled.cfg.replace(torch_compile=True)
    w = eager.initial_weights()
    calls = []
    original = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(1) or original(fn, **kw))
    with caplog.at_level("WARNING", logger="dpfedavg.tasks.torch_task"):
        for ids in (np.array([6, 1, 3]), np.array([0, 2, 4, 5, 7])):
            want = eager.client_batch_update_fn(ids, 1)(w, 0.3, 4)
            got = compiled.client_batch_update_fn(ids, 1)(w, 0.3, 4)
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert calls == [1] and "cannot be compiled" not in caplog.text

    def broken(*args, **kwargs):
        raise RuntimeError("Unsupported: a data-dependent branch")

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: broken)
    fallback = _sharded_task(batch_size=2)
    fallback.cfg = fallback.cfg.replace(torch_compile=True)
    with caplog.at_level("WARNING", logger="dpfedavg.tasks.torch_task"):
        got = fallback.client_batch_update_fn(ids, 1)(w, 0.3, 4)
    np.testing.assert_array_equal(got, want)
    assert caplog.text.count("cannot be compiled (RuntimeError: Unsupported: a data-dependent branch)") == 1
