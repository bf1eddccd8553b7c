"""Real datasets for the logistic-regression tasks (paper §5): loading, features, a shared cache.

Each dataset is prepared once into float32 feature matrices and int64 labels,
saved as ``.npy`` files under ``<cache-dir>/<dataset>/<features>/`` and then
memory-mapped by every process (server and clients), so the operating system
shares one copy and a client only reads its own rows.

Sources, in order:

1. the prepared cache;
2. local files under ``data-dir`` (for offline use; a ``data-dir`` that is not a folder is a ConfigError at once,
   before any download): parquet or arrow files
   (the Hugging Face layout, e.g. ``<data-dir>/fmnist/train-00000-of-00001.parquet``)
   or, for Fashion-MNIST, the original IDX files ``train-images-idx3-ubyte.gz`` etc.;
3. flwr-datasets' ``FederatedDataset`` with the public dataset name
   (``zalando-datasets/fashion_mnist``, ``uoft-cs/cifar10``, ``uoft-cs/cifar100``);
4. otherwise one `DataUnavailableError` saying what to download and where.

``digits`` is scikit-learn's bundled 8x8 digits (1797 images): it needs no
download, so a real dataset runs offline and in CI.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpfedavg.errors import ConfigError
from dpfedavg.io.atomic import atomic_open, locked
from dpfedavg.tasks.errors import DataUnavailableError

__all__ = [
    "DATASETS",
    "DataUnavailableError",
    "DatasetSpec",
    "PreparedData",
    "check_data_dir",
    "default_cache_dir",
    "prepare_dataset",
    "read_idx",
    "locked",
    "save_npy",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DatasetSpec:
    """Where a dataset comes from and how it becomes features."""

    name: str
    hf_name: str | None
    image_column: str | None
    label_column: str
    num_classes: int
    features: str  # "pixels" (flattened, scaled to [0, 1]) or "resnet18"
    idx_prefix: str | None = None  # original IDX files (Fashion-MNIST)


DATASETS: dict[str, DatasetSpec] = {
    "digits": DatasetSpec("digits", None, None, "label", 10, "pixels"),
    "fmnist": DatasetSpec("fmnist", "zalando-datasets/fashion_mnist", "image", "label", 10, "pixels", idx_prefix=""),
    "cifar10": DatasetSpec("cifar10", "uoft-cs/cifar10", "img", "label", 10, "resnet18"),
    "cifar100": DatasetSpec("cifar100", "uoft-cs/cifar100", "img", "fine_label", 100, "resnet18"),
}

#: digits has no official split: 150 training images per class (the first 150 of
#: a fixed permutation; 1500 in all, so class boundaries fall on shard boundaries
#: for n = 100, 50, 30, 10, ... as in the paper) and the other 297 for testing.
DIGITS_TRAIN_PER_CLASS = 150


@dataclass(frozen=True)
class PreparedData:
    """Memory-mapped features and labels of one prepared dataset."""

    train_x: np.ndarray  # (N, d) float32, memory-mapped
    train_y: np.ndarray  # (N,) int64
    test_x: np.ndarray  # (M, d) float32, memory-mapped
    test_y: np.ndarray  # (M,) int64
    num_classes: int
    directory: Path


@dataclass(frozen=True)
class _RawSplits:
    train: np.ndarray  # images (N, H, W[, C]) uint8, or features (N, d) float
    train_y: np.ndarray
    test: np.ndarray
    test_y: np.ndarray
    source: str


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/dpfedavg`` or ``~/.cache/dpfedavg``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dpfedavg"


def _features_key(spec: DatasetSpec, image_size: int) -> str:
    return "pixels" if spec.features == "pixels" else f"resnet18-imagenet1k-v1-{image_size}px"


def save_npy(path: Path, array: np.ndarray) -> None:
    """``np.save`` to ``path``, atomically (a cache another process reads must never be half-written)."""
    with atomic_open(path) as fh:
        np.save(fh, array)


def _load(directory: Path, num_classes: int) -> PreparedData:
    return PreparedData(
        train_x=np.load(directory / "train_x.npy", mmap_mode="r"),
        train_y=np.load(directory / "train_y.npy"),
        test_x=np.load(directory / "test_x.npy", mmap_mode="r"),
        test_y=np.load(directory / "test_y.npy"),
        num_classes=num_classes,
        directory=directory,
    )


def prepare_dataset(
    name: str,
    *,
    data_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    image_size: int = 224,
    device: str | None = None,
) -> PreparedData:
    """Prepare (once, under a file lock) and memory-map dataset ``name``.

    Raises
    ------
    DataUnavailableError
        When the dataset is in neither the cache, ``data_dir`` nor reachable online.
    """
    spec = DATASETS[name]
    cache_root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    directory = cache_root / name / _features_key(spec, image_size)
    meta_path = directory / "meta.json"
    if meta_path.exists():
        return _load(directory, spec.num_classes)
    if data_dir and spec.name != "digits":
        check_data_dir(data_dir, spec)
    with locked(cache_root / name / ".lock"):
        if meta_path.exists():  # another process prepared it while we waited
            return _load(directory, spec.num_classes)
        raw = _load_raw(spec, Path(data_dir).expanduser() if data_dir else None)
        logger.info("Preparing %s from %s into %s", name, raw.source, directory)
        directory.mkdir(parents=True, exist_ok=True)
        train_x, test_x = _to_features(spec, raw, image_size=image_size, device=device, weights_dir=data_dir)
        save_npy(directory / "train_x.npy", train_x)
        save_npy(directory / "train_y.npy", raw.train_y.astype(np.int64))
        save_npy(directory / "test_x.npy", test_x)
        save_npy(directory / "test_y.npy", raw.test_y.astype(np.int64))
        meta = {
            "dataset": name,
            "source": raw.source,
            "features": _features_key(spec, image_size),
            "train": list(train_x.shape),
            "test": list(test_x.shape),
            "num_classes": spec.num_classes,
        }
        meta_path.write_text(json.dumps(meta, indent=2))
    return _load(directory, spec.num_classes)


def check_data_dir(data_dir: str | Path, spec: DatasetSpec) -> None:
    """A ConfigError unless ``data_dir`` is a folder: checked before any download (no hub retries for a typo).

    The message is one line: the key, the path, and what to download and where (as when the files are missing).
    """
    path = Path(data_dir).expanduser()
    if not path.is_dir():
        what = "is not a folder" if path.exists() else "does not exist"
        raise ConfigError(
            f"invalid run config: 'data-dir' = {str(data_dir)!r}: {path.absolute()} {what} (nothing was downloaded); "
            + _missing_message(spec, path, [f"data-dir {what}"])
        )


def _to_features(
    spec: DatasetSpec, raw: _RawSplits, *, image_size: int, device: str | None, weights_dir: str | Path | None
) -> tuple[np.ndarray, ...]:
    if spec.features == "pixels":
        scale = 16.0 if spec.name == "digits" else 255.0
        return tuple(
            (np.asarray(x, dtype=np.float32).reshape(len(x), -1) / scale).astype(np.float32)
            for x in (raw.train, raw.test)
        )
    from dpfedavg.tasks.features import extract_features, load_resnet18

    model = load_resnet18(pretrained=True, weights_dir=weights_dir)
    return tuple(
        extract_features(images, model, image_size=image_size, device=device, desc=f"{spec.name} {split}")
        for split, images in (("train", raw.train), ("test", raw.test))
    )


# ------------------------------------------------------------------ sources
def _load_raw(spec: DatasetSpec, data_dir: Path | None) -> _RawSplits:
    if spec.name == "digits":
        return _load_digits()
    tried: list[str] = []
    if data_dir is not None:
        for candidate in (data_dir / spec.name, data_dir):
            if spec.idx_prefix is not None:
                found = _load_idx_dir(candidate)
                if found is not None:
                    return found
            found = _load_table_dir(candidate, spec)
            if found is not None:
                return found
        tried.append(f"no IDX/parquet/arrow files in {data_dir / spec.name} or {data_dir}")
    else:
        tried.append("no data-dir given")
    try:
        return _load_flwr_datasets(spec)
    except Exception as err:  # noqa: BLE001 - any download failure ends in the one message below
        tried.append(f"downloading {spec.hf_name!r} with flwr-datasets failed ({type(err).__name__}: {err})")
    raise DataUnavailableError(_missing_message(spec, data_dir, tried))


def _missing_message(spec: DatasetSpec, data_dir: Path | None, tried: list[str]) -> str:
    where = data_dir / spec.name if data_dir is not None else Path("<data-dir>") / spec.name
    files = (
        "train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz "
        "(https://github.com/zalandoresearch/fashion-mnist) or the parquet files"
        if spec.idx_prefix is not None
        else "the train and test parquet files"
    )
    return (
        f"dataset {spec.name!r} is not available: {'; '.join(tried)}. "
        f"Download {files} of https://huggingface.co/datasets/{spec.hf_name} on a machine with internet access, "
        f"put them in {where}, and run with --run-config \"data-dir='{where.parent}'\""
    )


def _load_digits() -> _RawSplits:
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise DataUnavailableError("task 'digits' needs scikit-learn: pip install -e '.[data]'") from err
    bunch = load_digits()
    x, y = bunch.data.astype(np.float32), bunch.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    train = np.sort(np.concatenate([order[y[order] == c][:DIGITS_TRAIN_PER_CLASS] for c in range(10)]))
    test = np.setdiff1d(np.arange(len(y)), train)
    return _RawSplits(x[train], y[train], x[test], y[test], "scikit-learn load_digits")


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (``.gz`` or plain), the format of the original (Fashion-)MNIST files."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        data = fh.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file (header {data[:4]!r})")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    array = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if array.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says shape {shape} but holds {array.size} bytes")
    return array.reshape(shape)


def _load_idx_dir(directory: Path) -> _RawSplits | None:
    names = {
        "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
        "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
    }
    paths = {}
    for images, labels in names.values():
        for stem in (images, labels):
            match = next(
                (directory / f"{stem}{ext}" for ext in (".gz", "") if (directory / f"{stem}{ext}").exists()), None
            )
            if match is None:
                return None
            paths[stem] = match
    arrays = {stem: read_idx(path) for stem, path in paths.items()}
    return _RawSplits(
        arrays["train-images-idx3-ubyte"],
        arrays["train-labels-idx1-ubyte"],
        arrays["t10k-images-idx3-ubyte"],
        arrays["t10k-labels-idx1-ubyte"],
        f"IDX files in {directory}",
    )


def _split_files(directory: Path, split: str) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(
        p
        for ext in ("parquet", "arrow")
        for p in directory.rglob(f"*.{ext}")
        if p.name.startswith(split) or f"-{split}" in p.name
    )


def _read_table(paths: list[Path]):  # -> pyarrow.Table
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for path in paths:
        if path.suffix == ".parquet":
            tables.append(pq.read_table(path))
        else:  # Hugging Face datasets write arrow IPC streams
            with pa.memory_map(str(path)) as source:
                try:
                    tables.append(pa.ipc.open_stream(source).read_all())
                except pa.ArrowInvalid:
                    tables.append(pa.ipc.open_file(source).read_all())
    return pa.concat_tables(tables)


def _load_table_dir(directory: Path, spec: DatasetSpec) -> _RawSplits | None:
    train_files, test_files = _split_files(directory, "train"), _split_files(directory, "test")
    if not train_files or not test_files:
        return None
    train, test = _read_table(train_files), _read_table(test_files)
    tx, ty = _table_images(train, spec)
    vx, vy = _table_images(test, spec)
    return _RawSplits(tx, ty, vx, vy, f"{len(train_files) + len(test_files)} table files in {directory}")


def _table_images(table, spec: DatasetSpec) -> tuple[np.ndarray, np.ndarray]:
    missing = {spec.image_column, spec.label_column} - set(table.column_names)
    if missing:
        raise DataUnavailableError(
            f"{spec.name}: the table files lack column(s) {sorted(missing)} (have {table.column_names}); "
            f"expected {spec.image_column!r} (images) and {spec.label_column!r} (labels), as on the Hugging Face Hub"
        )
    labels = np.asarray(table.column(spec.label_column).to_numpy(), dtype=np.int64)
    images = _decode_images(table.column(spec.image_column).to_pylist(), desc=f"decoding {spec.name}")
    return images, labels


def _decode_images(cells: list, desc: str) -> np.ndarray:
    """PNG/JPEG bytes (Hugging Face ``Image`` cells: dicts with ``bytes``) to a uint8 array."""
    from PIL import Image
    from tqdm.auto import tqdm

    out = []
    for cell in tqdm(cells, desc=desc, unit="img", mininterval=2.0, disable=len(cells) < 5000):
        data = cell["bytes"] if isinstance(cell, dict) else cell
        with Image.open(io.BytesIO(data)) as img:
            out.append(np.asarray(img))
    return np.stack(out).astype(np.uint8)


def _load_flwr_datasets(spec: DatasetSpec) -> _RawSplits:
    if spec.hf_name is None:
        raise DataUnavailableError(f"{spec.name} has no public source")
    try:
        from flwr_datasets import FederatedDataset
    except ImportError as err:
        raise DataUnavailableError(f"task {spec.name!r} needs flwr-datasets: pip install -e '.[data]'") from err
    fds = FederatedDataset(dataset=spec.hf_name, partitioners={"train": 1})
    splits = {}
    for split in ("train", "test"):
        table = fds.load_split(split).with_format("arrow")[:]
        splits[split] = _table_images(table, spec)
    return _RawSplits(*splits["train"], *splits["test"], f"flwr-datasets {spec.hf_name}")
