"""Real-data tasks: the paper's shard split, loaders (IDX, parquet, arrow), features, errors, the model."""

from __future__ import annotations

import gzip
import io
import json
import logging
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpfedavg.config import ConfigError, RunConfig
from dpfedavg.core import client_update
from dpfedavg.tasks import build_task
from dpfedavg.tasks import datasets as ds
from dpfedavg.tasks.datasets import DataUnavailableError, prepare_dataset, read_idx
from dpfedavg.tasks.logistic import _Client
from dpfedavg.tasks.partition import paper_shard_partition

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- partitioner
def _numpy_paper_split(labels: np.ndarray, n: int, seed: int) -> np.ndarray:
    """The paper's procedure written out: stable sort by label, 5n shards, a seeded permutation."""
    size = len(labels) // (5 * n)
    shards = np.argsort(labels, kind="stable")[: 5 * n * size].reshape(5 * n, size)
    perm = np.random.default_rng(seed).permutation(5 * n)
    return np.stack([shards[perm[5 * i : 5 * i + 5]].ravel() for i in range(n)])


@pytest.mark.parametrize(("n", "per_class"), [(20, 100), (50, 50), (12, 30)])
def test_shard_split_matches_the_paper(n: int, per_class: int) -> None:
    labels = np.random.default_rng(1).permutation(np.repeat(np.arange(10), per_class))
    split = paper_shard_partition(labels, n, seed=7)
    assert split.shape == (n, len(labels) // n)  # every client the same count
    assert np.array_equal(np.sort(split.ravel()), np.arange(len(labels)))  # each example exactly once
    assert max(len(np.unique(labels[row])) for row in split) <= 5  # at most 5 labels per client
    np.testing.assert_array_equal(split, _numpy_paper_split(labels, n, 7))  # exactly the paper's procedure


def test_shard_split_is_deterministic_by_seed() -> None:
    labels = np.repeat(np.arange(10), 50)
    a, b, c = (paper_shard_partition(labels, 20, s) for s in (3, 3, 4))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_shard_split_reports_unused_examples_and_rejects_too_many_clients(caplog) -> None:
    labels = np.repeat(np.arange(10), 31)  # 310 examples, n = 20 -> shards of 3, 10 examples unused
    logging.getLogger("dpfedavg").addHandler(caplog.handler)
    try:
        split = paper_shard_partition(labels, 20, seed=0)
    finally:
        logging.getLogger("dpfedavg").removeHandler(caplog.handler)
    assert split.shape == (20, 15) and len(np.unique(split)) == 300
    assert "10 of 310 training examples are in no client's shards" in caplog.text
    with pytest.raises(ValueError, match="needs at least 5 \\* 100 = 500 training examples"):
        paper_shard_partition(labels, 100, seed=0)


# -------------------------------------------------------------- local sources
def _write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def _images(n: int, shape: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, *shape), dtype=np.uint8), rng.integers(0, 10, size=n)


def test_fmnist_from_generated_idx_files(tmp_path: Path) -> None:
    data_dir = tmp_path / "data" / "fmnist"
    data_dir.mkdir(parents=True)
    train_x, train_y = _images(50, (28, 28), 0)
    test_x, test_y = _images(20, (28, 28), 1)
    _write_idx(data_dir / "train-images-idx3-ubyte.gz", train_x)
    _write_idx(data_dir / "train-labels-idx1-ubyte.gz", train_y)
    _write_idx(data_dir / "t10k-images-idx3-ubyte.gz", test_x)
    _write_idx(data_dir / "t10k-labels-idx1-ubyte.gz", test_y)
    data = prepare_dataset("fmnist", data_dir=tmp_path / "data", cache_dir=tmp_path / "cache")
    assert data.train_x.shape == (50, 784) and data.train_x.dtype == np.float32
    np.testing.assert_allclose(data.train_x, train_x.reshape(50, -1) / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(data.test_y, test_y)
    assert isinstance(data.train_x, np.memmap)  # shared, memory-mapped copy
    meta = json.loads((data.directory / "meta.json").read_text())
    assert "IDX files" in meta["source"]


def test_read_idx_rejects_garbage(tmp_path: Path) -> None:
    bad = tmp_path / "x.gz"
    with gzip.open(bad, "wb") as fh:
        fh.write(b"\x01\x02\x03\x04rest")
    with pytest.raises(ValueError, match="not an unsigned-byte IDX file"):
        read_idx(bad)


def _png_cells(images: np.ndarray) -> list[dict]:
    from PIL import Image

    cells = []
    for img in images:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG")
        cells.append({"bytes": buf.getvalue(), "path": None})
    return cells


def _write_table(path: Path, images: np.ndarray, labels: np.ndarray, image_col: str, label_col: str, fmt: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({image_col: _png_cells(images), label_col: labels.astype(np.int64)})
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        pq.write_table(table, path)
    else:  # the Hugging Face arrow cache format: an IPC stream
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_fmnist_from_generated_table_files(tmp_path: Path, fmt: str) -> None:
    train_x, train_y = _images(40, (28, 28), 2)
    test_x, test_y = _images(10, (28, 28), 3)
    root = tmp_path / "data" / "fmnist" / "fashion_mnist"
    _write_table(root / f"train-00000-of-00001.{fmt}", train_x, train_y, "image", "label", fmt)
    _write_table(root / f"test-00000-of-00001.{fmt}", test_x, test_y, "image", "label", fmt)
    data = prepare_dataset("fmnist", data_dir=tmp_path / "data", cache_dir=tmp_path / "cache")
    np.testing.assert_allclose(data.test_x, test_x.reshape(10, -1) / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(data.train_y, train_y)


def test_table_with_wrong_columns_is_a_clear_error(tmp_path: Path) -> None:
    x, y = _images(10, (28, 28), 4)
    root = tmp_path / "data" / "fmnist"
    _write_table(root / "train.parquet", x, y, "pixels", "label", "parquet")
    _write_table(root / "test.parquet", x, y, "pixels", "label", "parquet")
    with pytest.raises(DataUnavailableError, match=r"lack column\(s\) \['image'\]"):
        prepare_dataset("fmnist", data_dir=tmp_path / "data", cache_dir=tmp_path / "cache")


# ---------------------------------------------------------- ResNet-18 features
@pytest.fixture
def random_resnet(monkeypatch: pytest.MonkeyPatch):
    """ResNet-18 with random weights (no download), counting how often features are extracted."""
    import torch

    from dpfedavg.tasks import features

    calls = []
    real_extract = features.extract_features

    def fake_load(pretrained: bool = True, weights_dir=None):
        torch.manual_seed(0)
        return features.resnet18().eval()

    def counting_extract(images, model, **kwargs):
        calls.append(len(images))
        return real_extract(images, model, **kwargs)

    monkeypatch.setattr(features, "load_resnet18", fake_load)
    monkeypatch.setattr(features, "extract_features", counting_extract)
    return calls


def test_feature_extractor_shape_dtype_and_cache(tmp_path: Path, random_resnet: list) -> None:
    train_x, train_y = _images(12, (32, 32, 3), 5)
    test_x, test_y = _images(4, (32, 32, 3), 6)
    root = tmp_path / "data" / "cifar10" / "plain_text"
    _write_table(root / "train-00000-of-00001.parquet", train_x, train_y, "img", "label", "parquet")
    _write_table(root / "test-00000-of-00001.parquet", test_x, test_y, "img", "label", "parquet")
    kwargs = {"data_dir": tmp_path / "data", "cache_dir": tmp_path / "cache", "image_size": 64, "device": "cpu"}
    first = prepare_dataset("cifar10", **kwargs)
    assert first.train_x.shape == (12, 512) and first.test_x.shape == (4, 512)
    assert first.train_x.dtype == np.float32 and np.all(np.isfinite(first.train_x))
    assert random_resnet == [12, 4]
    assert first.directory.name == "resnet18-imagenet1k-v1-64px"  # keyed by dataset, features and image size
    second = prepare_dataset("cifar10", **kwargs)
    assert random_resnet == [12, 4]  # cached: not extracted again
    np.testing.assert_array_equal(np.asarray(first.train_x), np.asarray(second.train_x))


def test_resnet18_matches_torchvision_layout() -> None:
    """Same parameter count and state-dict size as torchvision's resnet18 (11,689,512 and 122 entries)."""
    from dpfedavg.tasks.features import resnet18

    model = resnet18()
    assert sum(p.numel() for p in model.parameters()) == 11_689_512
    assert len(model.state_dict()) == 122
    assert "layer2.0.downsample.0.weight" in model.state_dict() and "fc.bias" in model.state_dict()


def test_missing_weights_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from dpfedavg.tasks import features

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", offline)
    with pytest.raises(DataUnavailableError, match="resnet18-f37072fd.pth in the run's data-dir"):
        features.load_resnet18(pretrained=True, weights_dir=tmp_path)


# ---------------------------------------------------------- missing data
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hub is unreachable (as on this machine; the real attempt takes ~25 s of retries)."""

    def unreachable(spec):
        raise ConnectionError(f"Couldn't reach '{spec.hf_name}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(ds, "_load_flwr_datasets", unreachable)


def test_missing_dataset_says_what_to_download_and_where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _offline(monkeypatch)
    (tmp_path / "empty").mkdir()  # a folder without the files (a data-dir that does not exist: test_reporting.py)
    with pytest.raises(DataUnavailableError) as info:
        prepare_dataset("fmnist", data_dir=tmp_path / "empty", cache_dir=tmp_path / "cache")
    message = str(info.value)
    assert "zalando-datasets/fashion_mnist" in message and "train-images-idx3-ubyte.gz" in message
    assert str(tmp_path / "empty" / "fmnist") in message and "data-dir=" in message
    assert "Couldn't reach" in message  # the download failure is named too


def test_missing_dataset_through_the_server_app_is_one_error_line(tmp_path: Path, monkeypatch) -> None:
    from flwr.app import Context, RecordDict

    from dpfedavg.flower import server_app
    from dpfedavg.flower.client_app import app as client_app
    from dpfedavg.flower.testing import InProcessGrid

    _offline(monkeypatch)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("dpfedavg").addHandler(handler)
    try:
        run_config = {
            "task": "cifar100",
            "data-dir": str(tmp_path / "nothing"),
            "cache-dir": str(tmp_path / "c"),
            "output-dir": str(tmp_path / "out"),
        }
        # a federation of the run's size (asked only how many nodes it has: the data error comes before any message)
        grid = InProcessGrid(client_app, RunConfig.from_run_config(run_config).num_nodes, {})
        server_app.main(grid=grid, context=Context(1, 1, {}, RecordDict(), run_config))
    finally:
        logging.getLogger("dpfedavg").removeHandler(handler)
    errors = [r for r in records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "uoft-cs/cifar100" in errors[0].getMessage()
    assert grid.sent == []


# ------------------------------------------------------------------ the model
def test_logistic_gradient_matches_finite_differences() -> None:
    rng = np.random.default_rng(0)
    client = _Client(
        rng.standard_normal((7, 5)).astype(np.float32), rng.integers(0, 3, 7), num_classes=3, weight_decay=0.1
    )
    w = rng.standard_normal(5 * 3 + 3)
    grad = client.grad(w)
    eps = 1e-6
    numeric = np.array([(client.loss(w + eps * e) - client.loss(w - eps * e)) / (2 * eps) for e in np.eye(len(w))])
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("weight_decay", "lr", "steps"), [(1e-4, 0.05, 20), (0.3, 0.2, 7), (0.0, 1.0, 1)])
def test_logistic_closed_form_update_equals_local_steps(
    tmp_path: Path, weight_decay: float, lr: float, steps: int
) -> None:
    """The batched engine's closed form of the E local steps gives core.client_update's u, per client."""
    task = build_task(RunConfig(task="digits", cache_dir=str(tmp_path), weight_decay=weight_decay))
    ids = np.array([0, 3, 17, 42, 99])
    w = np.random.default_rng(1).standard_normal(task.dim) * 0.05
    closed = task.client_batch_update_fn(ids)(w, lr, steps)
    stepwise = np.stack([client_update(w, task.client_grad_fn(int(i)), lr, steps) for i in ids])
    assert np.linalg.norm(stepwise, axis=1).min() > 1.0  # the update is not trivially small
    np.testing.assert_allclose(closed, stepwise, rtol=1e-9, atol=1e-9)
    batched = client_update(np.repeat(w[None], len(ids), axis=0), task.client_batch_grad_fn(ids), lr, steps)
    np.testing.assert_allclose(closed, batched, rtol=1e-9, atol=1e-9)


def test_digits_task_clients_hold_only_their_rows(tmp_path: Path) -> None:
    cfg = RunConfig(task="digits", cache_dir=str(tmp_path))
    task = build_task(cfg)
    assert task.dim == 64 * 10 + 10
    client = task.client(7)
    assert client.x.shape == (15, 64)  # 1500 training images / 100 clients
    assert len(np.unique(client.y)) <= 5
    assert isinstance(task.data.train_x, np.memmap)
    with pytest.raises(ConfigError, match="'num-clients' = 400"):
        _ = build_task(
            RunConfig(task="digits", cache_dir=str(tmp_path), num_clients=400, clients_per_round=4.0)
        ).partition


def test_non_cifar_tasks_never_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from dpfedavg.config import RunConfig\n"
        "from dpfedavg.tasks import build_task\n"
        f"task = build_task(RunConfig(task='digits', cache_dir={str(tmp_path)!r}))\n"
        "task.client_grad_fn(0)(task.initial_weights())\n"
        "task.evaluate(task.initial_weights())\n"
        "import dpfedavg.flower.client_app, dpfedavg.flower.server_app\n"
        "assert 'torch' not in sys.modules and 'torchvision' not in sys.modules, 'torch imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_digits_training_is_far_above_chance(tmp_path: Path) -> None:
    from dpfedavg.flower import server_app
    from dpfedavg.flower.client_app import app as client_app
    from dpfedavg.flower.testing import InProcessGrid

    accuracy = {}
    for algorithm in ("norm", "none"):
        cfg = RunConfig.from_run_config(
            {
                "task": "digits",
                "algorithm": algorithm,
                "epsilon": 5.0,
                "num-rounds": 30,
                "eval-every": 10,
                "cache-dir": str(tmp_path / "cache"),
                "output-dir": str(tmp_path),
                "run-name": algorithm,
            }
        )
        out = server_app.run(InProcessGrid(client_app, 100, cfg.to_run_config()), cfg).directory
        accuracy[algorithm] = json.loads((out / "config.json").read_text())["final"]["last5_test_accuracy"]
    assert accuracy["norm"] > 0.5 and accuracy["none"] > 0.8  # chance is 0.1
