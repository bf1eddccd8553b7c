"""The scale benchmark: seconds per round, ms per sampled client, start-up and peak memory, per engine.

The workload is FMNIST-shaped (multinomial logistic regression 784 x 10 + 10,
20 examples per client, E = 20, q = 0.2, DP-NormFedAvg at epsilon = 5) on
generated images written as the original Fashion-MNIST IDX files (this
machine cannot download the real ones; the cost does not depend on the
pixels). Three engines run the same rounds:

* ``flower``: ``flwr run`` on a private local SuperLink (Ray), by default with
  virtual clients (``clients-per-node`` from
  `dpfedavg.engines.flower.recommended_clients_per_node`: about 20
  simulated SuperNodes, each computing its sampled clients as a block);
  ``clients_per_node=1`` reproduces one SuperNode per client;
* ``batched``: `dpfedavg.engines.batched.run_batched()`, one process;
* ``loop``: the floor, a plain single-process loop over the sampled clients
  calling `dpfedavg.core.private_client_update()` one client at a time
  (the ClientApp's math without any framework).

Seconds per round is the median over the measured rounds that have no
server-side evaluation; start-up is from launching the engine to the start of
round 1 (the end of round 1, read from ``metrics.csv``, minus the median
round), with the dataset cache already prepared (features and the n-client
shard split: the one-time preparation a first run pays is timed before launch
and reported as ``prepare_seconds``); peak RSS sums every process of the engine (the SuperLink, the
ServerApp and simulation processes and the Ray workers for ``flower``),
sampled every 0.2 s.
"""

from __future__ import annotations

import csv
import gzip
import json
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import psutil

from dpfedavg.config import RunConfig
from dpfedavg.core import client_round_update
from dpfedavg.core.types import ClientResult, RoundInstructions, Vector
from dpfedavg.tasks import Task

__all__ = ["ENGINES", "ScaleResult", "make_fmnist_like", "measure", "scale_config"]

ENGINES = ("flower", "batched", "loop")
EXAMPLES_PER_CLIENT = 20


@dataclass
class ScaleResult:
    """One measurement (the ``--json`` keys are the first four)."""

    seconds_per_round: float
    ms_per_sampled_client: float
    startup_seconds: float
    peak_rss_mb: float
    engine: str
    num_clients: int
    clients_per_round: float
    rounds_measured: int
    mean_sampled: float
    wall_seconds: float
    clients_per_node: int = 1
    #: One-time preparation of the dataset cache before launch (0 when it was already there).
    prepare_seconds: float = 0.0
    #: Peak of the summed PSS (shared pages divided among the processes that map them; Linux).
    peak_pss_mb: float = 0.0


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb", compresslevel=1) as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def make_fmnist_like(root: Path, num_train: int = 60000, num_test: int = 10000, seed: int = 0) -> Path:
    """Random 28x28 images as Fashion-MNIST IDX files under ``root/fmnist`` (balanced labels); returns ``root``."""
    if num_train % 10 or num_test % 10:
        raise ValueError("num_train and num_test must be multiples of 10 (balanced classes)")
    folder = Path(root) / "fmnist"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for prefix, n in (("train", num_train), ("t10k", num_test)):
        _write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        _write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", rng.permutation(np.repeat(np.arange(10), n // 10)))
    return Path(root)


def scale_config(num_clients: int, rounds: int, workdir: Path, q: float = 0.2, **overrides) -> RunConfig:
    """The benchmark's run config: ``rounds`` measured rounds after one warm-up, then the 5 evaluated ones."""
    values = {
        "task": "fmnist",
        "num-clients": num_clients,
        "clients-per-round": q * num_clients,
        "num-rounds": 1 + rounds + 5,
        "eval-every": 10**6,
        "epsilon": 5.0,
        "delta": 1e-5,
        "local-lr": 0.01,
        "clip": 62.5,
        "checkpoint-every": 0,
        "data-dir": str(workdir / "data"),
        "cache-dir": str(workdir / "cache"),
        "output-dir": str(workdir / "out"),
        **overrides,
    }
    return RunConfig.from_run_config(values)


class _PeakRss:
    """Samples the summed RSS of ``roots`` and all their descendants in a background thread.

    Also the summed PSS (`peak_pss`, Linux): RSS counts a page shared by several processes (the
    memory-mapped dataset every ClientApp actor and the ServerApp read, the libraries) once per
    process, PSS divides it among them, so the PSS sum is the memory the process tree really holds.
    """

    def __init__(self, roots: list[psutil.Process], interval: float = 0.2) -> None:
        self.roots, self.interval, self.peak, self.peak_pss = roots, interval, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        seen: dict[int, tuple[int, int]] = {}
        for root in list(self.roots):
            try:
                for proc in [root, *root.children(recursive=True)]:
                    try:
                        info = proc.memory_full_info()
                        seen[proc.pid] = (info.rss, getattr(info, "pss", info.rss))
                    except psutil.Error:
                        pass
            except psutil.Error:
                pass
        total = sum(rss for rss, _ in seen.values())
        self.peak = max(self.peak, total)
        self.peak_pss = max(self.peak_pss, sum(pss for _, pss in seen.values()))
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def loop_client_results(
    task: Task, clients: np.ndarray, w: Vector, ins: RoundInstructions, **_: object
) -> Iterator[ClientResult]:
    """Alg. 1 / 2 lines 4-10, one client at a time, exactly as the ClientApp computes it (no batching, one thread).

    A ``client_results_fn`` of `dpfedavg.engines.batched.run_batched()`: its ``block``, ``failed`` and ``threads``
    keywords do not apply here.
    """
    cache = task.__dict__.setdefault("_loop_grad_fns", {})
    for client_id in clients:
        cid = int(client_id)
        if cid not in cache:
            cache[cid] = task.client_grad_fn(cid)  # built once per client, as the ClientApp does
        upd = client_round_update(w, cache[cid], ins, cid)  # what the ClientApp calls
        yield ClientResult(cid, upd.noisy, upd.update_norm, upd.clean if ins.diagnostics else None)


def _prepare_cache(cfg: RunConfig) -> float:
    """Prepare the dataset cache before the engine starts; returns its seconds.

    The cache (the prepared features and the ``n``-client shard split, `LogisticTask.partition`)
    is built by the first run of a dataset and size and read by every later one, so start-up is
    measured with it prepared; the seconds it took are reported beside (``ScaleResult.prepare_seconds``).
    """
    clock = time.monotonic()
    # in a child process, so that what the preparation allocates is not counted in the engine's peak memory
    subprocess.run([sys.executable, "-c", _PREPARE, json.dumps(cfg.to_run_config())], check=True)
    return time.monotonic() - clock


#: Builds the task of the run config in ``sys.argv[1]`` and its shard split (which prepares the features first).
_PREPARE = (
    "import json, sys; from dpfedavg.config import RunConfig; from dpfedavg.tasks import build_task; "
    "build_task(RunConfig.from_run_config(json.loads(sys.argv[1]))).partition"
)


def _summarize(run_dir: Path, cfg: RunConfig, launched: float, wall: float, peak: int, engine: str) -> ScaleResult:
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    elapsed = {int(r["round"]): float(r["elapsed_s"]) for r in rows}
    sampled = {int(r["round"]): int(r["num_sampled"]) for r in rows if r["num_sampled"]}
    evaluated = {int(r["round"]) for r in rows if r.get("test_accuracy")}
    measured = [k for k in range(2, cfg.num_rounds + 1) if k in elapsed and k - 1 in elapsed and k not in evaluated]
    per_round = statistics.median(elapsed[k] - elapsed[k - 1] for k in measured)
    mean_sampled = float(np.mean([sampled[k] for k in measured]))
    started = datetime.fromisoformat(json.loads((run_dir / "config.json").read_text())["started_utc"]).timestamp()
    startup = (started - launched) + elapsed[1] - per_round
    return ScaleResult(
        seconds_per_round=per_round,
        ms_per_sampled_client=1000.0 * per_round / mean_sampled,
        startup_seconds=startup,
        peak_rss_mb=peak / 2**20,
        engine=engine,
        num_clients=cfg.num_clients,
        clients_per_round=cfg.clients_per_round,
        rounds_measured=len(measured),
        mean_sampled=mean_sampled,
        wall_seconds=wall,
        clients_per_node=cfg.clients_per_node,
    )


def measure(
    engine: str,
    num_clients: int,
    rounds: int = 5,
    workdir: Path | None = None,
    num_cpus: int = 1,
    overrides: dict | None = None,
    clients_per_node: int | None = None,
) -> ScaleResult:
    """Run the benchmark once for ``engine`` at ``n = num_clients`` and return the measurement.

    ``overrides``: run_config keys to change (e.g. ``noise-placement``, ``accountant``).
    ``clients_per_node`` (``flower``): virtual clients per simulated SuperNode; ``None`` = the
    recommended setup (`recommended_clients_per_node()`), 1 = one
    SuperNode per client.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: allowed {', '.join(ENGINES)}")
    if num_clients < 10 or rounds < 1:
        raise ValueError("num_clients must be >= 10 and rounds >= 1")
    workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="dpfedavg-scale-"))
    num_train = EXAMPLES_PER_CLIENT * num_clients
    if not (workdir / "data" / "fmnist").exists():
        make_fmnist_like(workdir / "data", num_train=num_train, num_test=1000)
    values = {"run-name": f"{engine}-{num_clients}", **(overrides or {})}
    if engine == "flower":
        from dpfedavg.engines.flower import recommended_clients_per_node

        secure = bool(values.get("secure-aggregation", False))  # SecAgg+ keeps one client per node
        m = clients_per_node or (1 if secure else recommended_clients_per_node(num_clients))
        values.update({"clients-per-node": m, "run-name": f"{engine}-{num_clients}-m{m}"})
    cfg = scale_config(num_clients, rounds, workdir, **values)
    prepare_seconds = _prepare_cache(cfg)
    if engine == "flower":
        from dpfedavg.engines.flower import run_flower
        from dpfedavg.engines.local_superlink import LocalSuperLink

        with LocalSuperLink(workdir / f"superlink-{num_clients}") as link:
            with _PeakRss([psutil.Process(link.process.pid), psutil.Process()]) as rss:  # type: ignore[union-attr]
                launched = time.time()
                t0 = time.monotonic()
                run_dir = run_flower(cfg, link, num_cpus=num_cpus, timeout=3600)
                wall = time.monotonic() - t0
    else:
        from dpfedavg.engines.batched import client_results, run_batched

        results_fn = client_results if engine == "batched" else loop_client_results
        with _PeakRss([psutil.Process()]) as rss:
            launched = time.time()
            t0 = time.monotonic()
            run_dir = run_batched(cfg, client_results_fn=results_fn, engine=engine).directory
            wall = time.monotonic() - t0
    result = _summarize(run_dir, cfg, launched, wall, rss.peak, engine)
    result.prepare_seconds = prepare_seconds
    result.peak_pss_mb = rss.peak_pss / 2**20
    return result


def as_json(result: ScaleResult) -> str:
    return json.dumps(asdict(result))
