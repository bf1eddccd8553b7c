"""Any ``torch.nn.Module`` as a `Task`, vectorized over clients with ``torch.func``.

The model is a flat parameter vector ``w`` (the parameters of ``model.named_parameters()``
in order, each flattened row-major), the protocol's ``w_k``. Client ``i``'s objective is

    ``f_i(w) = (1/m_i) sum_j loss(model(w, x_j), y_j) + (lambda/2) ||w||^2``

over its ``m_i`` examples (``lambda`` = ``weight-decay``, PyTorch's ``weight_decay`` on every
parameter). Alg. 1 / Alg. 2 lines 5-9: ``E`` local gradient steps
``w_{k,t+1} = w_{k,t} - eta_k grad f_i(w_{k,t})`` and ``u = (w_k - w_{k,E}) / eta_k``.

* `TorchTask.client_grad_fn()`: one client's full-batch gradient (the ClientApp calls
  `dpfedavg.core.client_update()` on it, in float64 numpy, as for every task);
* `TorchTask.client_batch_update_fn()`: the ``u`` of a block of clients in one call, for the
  batched engine: ``torch.func.grad`` of the loss through ``functional_call``, ``vmap`` over the
  clients (each with its own copy of ``w``), the E steps a loop over that vmapped step. Clients
  with different example counts are padded to the block's largest and masked. The iterates are
  kept in float64 and cast to the working dtype (``torch-dtype``) for each gradient, which is what
  the ClientApp path does, so the two engines agree to the rounding of one gradient;
* `TorchTask.device_block_update()`: the same ``u`` left on the task's device as a float64 tensor (with
  ``torch-compile``: in ``torch-dtype``, the local steps compiled over chunks of a fixed size); the
  batched engine bounds, noises and sums it there (`dpfedavg.core.pipeline`, issue 37), so a round
  copies no block of updates to the host;
* `TorchTask.evaluate()`: server-side test accuracy / loss and the training objective
  ``f = (1/n) sum_i f_i``.

Device: ``device = "auto"`` uses CUDA when torch sees a GPU (in a Ray simulation, the GPU share
``client-resources-num-gpus`` gives each ClientApp; Ray hides the GPUs from ClientApps that got
none), else the CPU; ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` choose. ``torch-dtype`` is float32
(default) or float64 (exact-equality tests).

Local mini-batches (``local-batch-size = b > 0``; 0 is the paper's full batch): each of the E
steps of round ``k`` uses ``min(b, m_i)`` of client ``i``'s examples drawn without replacement
from ``make_rng(seed, Stream.MINIBATCH, i, k)``, the same draws in every engine. The update is
still one client's, so the DP accounting (user-level, on ``||g|| <= C``) does not change.

Models must keep their state in parameters: buffers (e.g. BatchNorm's running statistics and its
``num_batches_tracked`` counter) are constants at their initial values: the module runs in eval mode, no
client's data changes them, and they are never sent (``w`` holds the trainable parameters only); building
the task warns when a model has any (use GroupNorm / LayerNorm for a normalization that learns). torch is
imported lazily: this module imports without it, and only a torch task loads it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from dpfedavg.config import ConfigError, RunConfig
from dpfedavg.core.seeding import Stream, make_rng
from dpfedavg.core.threads import single_threaded
from dpfedavg.core.types import BatchUpdateFn, GradFn, RunsUpdateFn, Vector
from dpfedavg.tasks.base import runs_step_sizes

__all__ = [
    "ArrayClients",
    "ShardedClients",
    "TorchTask",
    "linear_softmax_model",
    "load_weights",
    "minibatch_indices",
    "resolve_device",
]

logger = logging.getLogger(__name__)


#: Rows per chunk when the server evaluates (bounds memory).
EVAL_CHUNK = 4096
#: The local steps take clients this many bytes of examples at a time through all E steps (each step is one vmapped
#: call, about a millisecond of Python and dispatch: fewer, larger calls pay more than keeping a chunk in cache).
CLIENT_CHUNK_BYTES = 32 * 1024**2
#: Clients per chunk of the compiled local steps on the CPU (``torch-compile``, `TorchTask._compiled_chunk_steps`):
#: on two threads each core takes half a chunk, about 2 MiB of FMNIST examples, which stays in its cache through a
#: step. Measured on 2 cores for ``nn.Linear(784, 10)`` (the benchmarks page): 16, 32, 64 and 128 clients.
COMPILE_CHUNK_CLIENTS = 64
#: The local steps fold ``-1 / lambda`` into the gradient (`TorchTask._chunk_steps`) from this weight decay up (below
#: it, the scaled gradient could overflow float32; they scale by ``-eta`` and take a second pass).
LERP_MIN_DECAY = 1e-8
#: Clients per block when the server computes the training objective.
EVAL_CLIENT_BLOCK = 256
#: A sharded dataset is kept on the GPU when it takes at most this share of the device's free memory
#: (`TorchTask._resident_shards`).
RESIDENT_FRACTION = 0.25


class _EagerFallback(Exception):
    """Raised inside `TorchTask._runs_update` when a block's local steps run eagerly instead of compiled."""


def _torch() -> Any:
    try:
        import torch
    except ImportError as err:
        raise ConfigError(
            "invalid run config: this task runs on torch, which is not installed: pip install -e '.[torch]' "
            "(torch is an extra; docs: tutorials/own-model.md)"
        ) from err
    return torch


def resolve_device(name: str) -> Any:
    """The ``torch.device`` for the ``device`` key (``auto``: CUDA when available)."""
    torch = _torch()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"invalid run config: 'device' = {name!r}, but torch sees no CUDA device here "
            f"(torch {torch.__version__}, cuda {torch.version.cuda}); allowed: 'auto' (CUDA when present) or 'cpu'"
        )
    return torch.device(name)


def minibatch_indices(seed: int, client_id: int, server_round: int, num_examples: int, batch_size: int) -> Any:
    """An endless stream of sorted mini-batches of ``min(b, m)`` indices of client ``i``'s examples in round ``k``.

    Drawn without replacement from ``make_rng(seed, Stream.MINIBATCH, i, k)``; the ClientApp and
    the batched engine draw the same batches for the same (seed, client, round).
    """
    rng = make_rng(seed, Stream.MINIBATCH, client_id, server_round)
    size = min(batch_size, num_examples)
    while True:
        yield np.sort(rng.choice(num_examples, size=size, replace=False))


# ---------------------------------------------------------------------------------------------- client data
class ArrayClients:
    """Per-client examples as arrays or tensors: ``clients[i] = (x_i, y_i)``, or a function ``i -> (x_i, y_i)``.

    A function is called only for the clients a process needs (a ClientApp: its own), so data can be
    loaded lazily; the examples' leading dimension is the example index.
    """

    def __init__(self, clients: Sequence[tuple[Any, Any]] | Callable[[int], tuple[Any, Any]], num_clients: int) -> None:
        if not callable(clients) and len(clients) != num_clients:
            raise ConfigError(
                f"invalid run config: 'num-clients' = {num_clients}, but the task has data for {len(clients)} clients"
            )
        self.num_clients = num_clients
        # a function may load data: call it once per client (the server's training objective needs them all)
        self._clients = lru_cache(maxsize=4096)(clients) if callable(clients) else clients

    def client(self, client_id: int) -> tuple[np.ndarray, np.ndarray]:
        """``(x_i, y_i)`` of client ``i`` as numpy arrays."""
        if not 0 <= client_id < self.num_clients:
            raise ValueError(f"client id {client_id} outside [0, {self.num_clients})")
        x, y = self._clients(client_id) if callable(self._clients) else self._clients[client_id]
        x, y = _numpy(x), _numpy(y)
        if len(x) != len(y) or len(x) == 0:
            raise ValueError(f"client {client_id}: {len(x)} inputs and {len(y)} targets (need equal, >= 1)")
        return x, y

    def block(self, client_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The clients' examples padded to the largest: ``x (B, m_max, ...)``, ``y (B, m_max, ...)``, ``m (B,)``."""
        parts = [self.client(int(i)) for i in client_ids]
        counts = np.array([len(y) for _, y in parts])
        m_max = int(counts.max())
        x = np.zeros((len(parts), m_max, *parts[0][0].shape[1:]), dtype=parts[0][0].dtype)
        y = np.zeros((len(parts), m_max, *parts[0][1].shape[1:]), dtype=parts[0][1].dtype)
        for b, (xi, yi) in enumerate(parts):
            x[b, : len(xi)], y[b, : len(yi)] = xi, yi
        return x, y, counts


class ShardedClients(ArrayClients):
    """Clients that own rows of shared arrays: client ``i`` has rows ``partition[i]`` of ``(x, y)``.

    ``load() -> (x, y, partition)`` is called on first use (building a task stays cheap);
    ``partition`` is ``(n, m)`` (every client has ``m`` examples, e.g. the paper's shard split
    `dpfedavg.tasks.partition.paper_shard_partition()`); ``x`` may be memory-mapped, only the
    rows asked for are read. ``x_shape`` reshapes each example (e.g. ``(1, 28, 28)`` for a CNN).
    """

    def __init__(
        self, load: Callable[[], tuple[Any, Any, np.ndarray]], num_clients: int, x_shape: tuple[int, ...] | None = None
    ) -> None:
        self._load, self.num_clients, self.x_shape = load, num_clients, x_shape
        self._clients = self.client

    @cached_property
    def arrays(self) -> tuple[Any, Any, np.ndarray]:
        x, y, partition = self._load()
        partition = np.asarray(partition)
        if len(partition) != self.num_clients:
            raise ValueError(f"the partition has {len(partition)} clients, expected {self.num_clients}")
        return x, y, partition

    def _rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x_all, y_all, _ = self.arrays
        x = np.asarray(x_all[rows.ravel()])
        y = np.asarray(y_all[rows.ravel()])
        if self.x_shape is not None:
            x = x.reshape(len(x), *self.x_shape)
        return x, y

    def client(self, client_id: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= client_id < self.num_clients:
            raise ValueError(f"client id {client_id} outside [0, {self.num_clients})")
        return self._rows(np.sort(self.arrays[2][client_id]))

    def block_rows(self, client_ids: np.ndarray) -> np.ndarray:
        """``(B, m)``: each client's rows of ``(x, y)``, sorted (the order every block gathers them in)."""
        return np.sort(self.arrays[2][np.asarray(client_ids)], axis=1)

    def block(self, client_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = self.block_rows(client_ids)
        x, y = self._rows(rows)
        b, m = rows.shape
        return x.reshape(b, m, *x.shape[1:]), y.reshape(b, m, *y.shape[1:]), np.full(b, m)


def linear_softmax_model(num_features: int, num_classes: int) -> Any:
    """``x -> x W + b`` with ``W`` of shape ``(d, c)`` and ``b`` of shape ``(c,)``, both zero.

    The parameters flatten to ``[vec(W), b]``, the layout of `LogisticTask`;
    the module stores ``W^T`` (``flat_transposed``).
    """
    torch = _torch()

    class LinearSoftmax(torch.nn.Module):
        #: The flat vector holds ``vec(W)`` with ``W`` of shape ``(d, c)``; the module keeps ``W^T``, PyTorch's
        #: ``(out, in)`` layout, whose gradient under ``vmap`` is a product of contiguous operands (1.7x faster
        #: per step than a ``(d, c)`` weight; the benchmarks page). See `TorchTask.layout`.
        flat_transposed = ("weight",)

        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(num_classes, num_features))
            self.bias = torch.nn.Parameter(torch.zeros(num_classes))

        def forward(self, x: Any) -> Any:
            return torch.nn.functional.linear(x, self.weight, self.bias)

    return LinearSoftmax()


def decay_offsets(decay: float | np.ndarray, num_steps: int) -> list[Any]:
    """``c_0 .. c_E`` of `TorchTask._chunk_steps()`'s split ``w_t - w_k = c_t w_k + m_t``: ``c_0 = 0`` and
    ``c_{t+1} = (1 - a) c_t - a`` with ``a = eta lambda`` (a float, or one per run), on the host."""
    offsets = [np.zeros_like(decay, dtype=np.float64)]
    for _ in range(num_steps):
        offsets.append((1.0 - decay) * offsets[-1] - decay)
    return offsets


def compile_bucket(b: int) -> int:
    """The padded block size of ``b`` clients under ``torch-compile``: ``b`` rounded up to a multiple of a
    quarter of its power of two (at most 25 % padding; a Poisson sample's counts fall into one or two sizes)."""
    step = max(1, 2 ** (max(b, 1).bit_length() - 1) // 4)
    return -(-b // step) * step


def load_weights(module: Any, w: Vector) -> Any:
    """Copy the flat vector ``w`` into ``module``'s trainable parameters, in place; returns the module.

    ``w`` is laid out as `TorchTask` lays out every run's model (``model.npz``, ``RunResult.weights``): the
    parameters with ``requires_grad`` in ``named_parameters()`` order, each raveled, 2-D ones named in the module's
    ``flat_transposed`` transposed. Buffers are left as they are (a run never changes them).

    Raises
    ------
    ValueError
        When ``w``'s length is not the module's number of trainable entries (another architecture).
    """
    torch = _torch()
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    flipped = set(getattr(module, "flat_transposed", ()))
    w = np.asarray(w, dtype=np.float64).reshape(-1)
    dim = sum(p.numel() for _, p in named)
    if w.shape[0] != dim:
        raise ValueError(
            f"the run's model has {w.shape[0]} weights, {type(module).__name__} has {dim} trainable entries "
            f"({len(named)} parameters): load it into the architecture the run trained"
        )
    offset = 0
    with torch.no_grad():
        for name, param in named:
            shape = tuple(param.shape)[::-1] if name in flipped else tuple(param.shape)
            chunk = torch.as_tensor(w[offset : offset + param.numel()].reshape(shape))
            param.copy_(chunk.t() if name in flipped else chunk)
            offset += param.numel()
    return module


def _numpy(a: Any) -> np.ndarray:
    if hasattr(a, "detach"):  # a torch tensor
        return a.detach().cpu().numpy()
    return np.asarray(a)


# ---------------------------------------------------------------------------------------------- the task
@dataclass(frozen=True)
class _Layout:
    """The flat vector's parameters, in order: names, the module's shapes, sizes, and which 2-D ones it holds
    transposed (a module's ``flat_transposed``)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    numels: tuple[int, ...]
    transposed: tuple[bool, ...]

    @property
    def dim(self) -> int:
        return int(sum(self.numels))

    def flat_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Each parameter's shape in the flat vector's order (reversed for a transposed one)."""
        return tuple(shape[::-1] if t else shape for shape, t in zip(self.shapes, self.transposed, strict=True))

    def is_transposed(self, index: int) -> bool:
        return self.transposed[index]


class TorchTask:
    """A task from a torch model, per-client data and a loss (see the module docstring).

    Parameters
    ----------
    cfg:
        The run config: ``num-clients``, ``seed`` (initial weights: the model is built under
        ``torch.manual_seed(seed)``), ``weight-decay``, ``device``, ``torch-dtype``, ``local-batch-size``.
    model:
        An ``nn.Module`` or a zero-argument factory returning one (called under the seed). ``w`` is its
        trainable parameters raveled in ``named_parameters()`` order; a module may list 2-D parameters in a
        ``flat_transposed`` attribute, which ``w`` then holds transposed (`layout`).
    clients:
        Per-client examples: a sequence of ``(x_i, y_i)`` (arrays or tensors), a function
        ``i -> (x_i, y_i)`` (called only for the clients a process needs), or an
        `ArrayClients` / `ShardedClients`.
    loss:
        ``"cross_entropy"`` (integer class targets), ``"mse"``, or a function
        ``loss(outputs, targets) -> per-example losses`` of shape ``(m,)``.
    test:
        ``(x, y)`` held by the server, or a zero-argument function returning it; ``None``: no test metrics.
    name:
        The task's name (default: ``cfg.task`` when it names a user's ``module:factory``, else the model's
        class name); a run given this task records it as its ``task``.
    weight_decay:
        ``lambda``; default ``cfg.weight_decay``.
    classification:
        Report test accuracy. Default: with ``loss = "cross_entropy"``, and with a loss function of yours when the
        model outputs class scores ``(m, c)`` for integer labels ``(m,)`` (checked on the first test example);
        ``False`` turns it off, ``True`` forces it (``argmax`` of the outputs against the labels).
    """

    #: Computed from the clients' training data: withheld with secure-noise (see Task).
    training_data_metrics = ("train_loss",)
    #: The local steps run on torch's own threads: the batched engine computes one block of clients at a time.
    parallel_steps = True

    def __init__(
        self,
        cfg: RunConfig,
        *,
        model: Any,
        clients: Any,
        loss: str | Callable[[Any, Any], Any] = "cross_entropy",
        test: tuple[Any, Any] | Callable[[], tuple[Any, Any]] | None = None,
        name: str | None = None,
        weight_decay: float | None = None,
        classification: bool | None = None,
    ) -> None:
        self.torch = _torch()
        self.cfg = cfg
        self.name = name or (cfg.task if ":" in cfg.task else getattr(model, "__name__", type(model).__name__))
        self.num_clients = cfg.num_clients
        self.device = resolve_device(cfg.device)
        if single_threaded() and self.device.type == "cpu":  # parallelism comes from the Ray actors
            self.torch.set_num_threads(1)
        self.dtype = getattr(self.torch, cfg.torch_dtype)
        self.batch_size = cfg.local_batch_size
        self.weight_decay = cfg.weight_decay if weight_decay is None else float(weight_decay)
        if isinstance(loss, str) and loss not in ("cross_entropy", "mse"):
            raise ValueError(f"loss = {loss!r}: expected 'cross_entropy', 'mse' or a function (outputs, y) -> (m,)")
        self.loss = loss
        self.classification = (loss == "cross_entropy") if classification is None else classification
        self.data = clients if isinstance(clients, ArrayClients) else ArrayClients(clients, cfg.num_clients)
        if self.data.num_clients != cfg.num_clients:
            raise ConfigError(
                f"invalid run config: 'num-clients' = {cfg.num_clients}, but task {self.name!r} has "
                f"{self.data.num_clients} clients"
            )
        self._test_source = test
        self._model_source = model
        self._client_tensors = lru_cache(maxsize=4096)(self._load_client)  # a ClientApp serves many clients
        self._lock = threading.Lock()  # functional_call swaps the module's parameters: one call at a time
        self._classification_given = classification is not None

    @cached_property
    def metric_names(self) -> tuple[str, ...]:
        """The server's metrics: ``test_accuracy`` (classification), ``test_loss`` (with test data), ``train_loss``.

        With ``classification = None`` and a loss function of the user's, accuracy is reported when the model
        outputs class scores (shape ``(m, c)``, ``c >= 2``) for integer labels (shape ``(m,)``): decided here, from
        the first test example, when the server first asks (a ClientApp never loads the test data).
        """
        if self._test_source is None:
            return ("train_loss",)
        if not self._classification_given and callable(self.loss):
            self.classification = self._outputs_class_scores()
            if self.classification:
                logger.info("task %r: the model outputs class scores for integer labels: test_accuracy is reported "
                            "(TorchTask(classification=False) turns it off)", self.name)  # fmt: skip
        if self.classification:
            return ("test_accuracy", "test_loss", "train_loss")
        return ("test_loss", "train_loss")

    @property
    def headline_metric(self) -> str:
        """The metric ``metrics.png`` plots and the run's last line reports: the first of ``metric_names``."""
        return self.metric_names[0]

    def _outputs_class_scores(self) -> bool:
        """Integer labels of shape ``(m,)`` and model outputs of shape ``(m, c)`` with ``c >= 2`` (one forward pass)."""
        assert self.test_data is not None
        x_all, y_all = self.test_data
        if not np.issubdtype(y_all.dtype, np.integer) or y_all.ndim != 1:
            return False
        with self._lock, self.torch.no_grad():
            out = self._forward(self._flat(self.initial_weights()), self._x(x_all[:1]))
        return out.ndim == 2 and out.shape[1] >= 2

    def check_model(self) -> None:
        """One forward pass of the model on one example, before anything is written (`build_task()`).

        A model whose ``forward`` fails raises one `ConfigError` naming the model, the input's shape and dtype,
        the task and torch's first line, instead of a torch traceback halfway through a run whose folder is
        already made. The example is the first test example when ``test`` was given as arrays (nothing to load),
        else client 0's first. Where client 0's data cannot be loaded here (a node that holds other clients'
        data), the check is skipped: the data's own error comes where the data is used.
        """
        if self._test_source is not None and not callable(self._test_source):
            assert self.test_data is not None
            x_np, where = self.test_data[0], "the first test example"
        else:
            try:
                x_np, _ = self.data.client(0)
            except Exception as err:  # noqa: BLE001 - not the model's fault; reported where the data is used
                logger.debug("task %r: model check skipped, client 0's data did not load here: %s", self.name, err)
                return
            where = "client 0's first example"
        x = self._x(np.asarray(x_np)[:1])
        flat = self._flat(self.initial_weights())
        try:
            with self._lock, self.torch.no_grad():
                self._forward(flat, x)
        except Exception as err:  # noqa: BLE001 - the user's forward failed: one line with its context
            first = (str(err).strip().splitlines() or [""])[0]
            named = "" if self.name == self.cfg.task else f" (task {self.name!r})"
            raise ConfigError(
                f"invalid run config: 'task' = {self.cfg.task!r}: the model {type(self.module).__name__}{named} "
                f"failed its first forward pass, on an input of shape {tuple(x.shape)} "
                f"({str(x.dtype).removeprefix('torch.')}, {where}): {type(err).__name__}: {first}"
            ) from err

    # ------------------------------------------------------------------ model
    @cached_property
    def module(self) -> Any:
        """The model on the task's device and dtype, built under ``torch.manual_seed(seed)``."""
        torch = self.torch
        source = self._model_source
        if isinstance(source, torch.nn.Module):
            module = source
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.cfg.seed)
                module = source()
            if not isinstance(module, torch.nn.Module):
                raise TypeError(f"the model factory returned {type(module).__name__}, not a torch.nn.Module")
        return module.to(device=self.device, dtype=self.dtype).eval()

    @cached_property
    def layout(self) -> _Layout:
        """The flat vector ``w``: the trainable parameters in ``named_parameters()`` order, each raveled.

        A module may name 2-D parameters in ``flat_transposed``: ``w`` then holds their transpose's ravel (the
        logistic model keeps PyTorch's fast ``(out, in)`` weight while ``w`` keeps the numpy task's order).
        """
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"task {self.name!r}: the model has no trainable parameters")
        buffers = [f"{n} ({str(b.dtype).removeprefix('torch.')})" for n, b in self.module.named_buffers()]
        if buffers:
            logger.warning(
                "task %r: the model's buffers %s are constants at their initial values: the clients' data never "
                "changes them and they are never sent (the model runs in eval mode, e.g. BatchNorm normalizes with "
                "its initial running statistics); w holds the trainable parameters only. Use GroupNorm / LayerNorm "
                "for a normalization that learns",
                self.name,
                ", ".join(buffers[:6]) + (" ..." if len(buffers) > 6 else ""),
            )
        flipped = set(getattr(self.module, "flat_transposed", ()))
        bad = sorted(n for n, p in named if n in flipped and p.dim() != 2)
        if bad or not flipped <= {n for n, _ in named}:
            raise ValueError(f"task {self.name!r}: flat_transposed = {sorted(flipped)}: each must name a 2-D parameter")
        return _Layout(
            tuple(n for n, _ in named),
            tuple(tuple(p.shape) for _, p in named),
            tuple(p.numel() for _, p in named),
            tuple(n in flipped for n, _ in named),
        )

    @property
    def dim(self) -> int:
        """Length of the flat parameter vector ``w``."""
        return self.layout.dim

    @cached_property
    def _buffers(self) -> dict[str, Any]:
        return {n: b.detach() for n, b in self.module.named_buffers()}

    def initial_weights(self) -> Vector:
        """``w_0``: the model's initial parameters (built under the seed), flattened, float64."""
        params, layout = dict(self.module.named_parameters()), self.layout
        flat = [params[n].detach().t() if layout.is_transposed(i) else params[n].detach()
                for i, n in enumerate(layout.names)]  # fmt: skip
        return np.concatenate([p.cpu().double().numpy().ravel() for p in flat])

    def _params(self, flat: Any) -> dict[str, Any]:
        layout, params = self.layout, {}
        chunks = self.torch.split(flat, layout.numels)
        for i, (name, chunk, shape) in enumerate(zip(layout.names, chunks, layout.flat_shapes(), strict=True)):
            params[name] = chunk.view(shape).t() if layout.is_transposed(i) else chunk.view(shape)
        params.update(self._buffers)
        return params

    def _flat(self, w: Vector) -> Any:
        """``w`` as a tensor on the task's device, in the working dtype."""
        return self.torch.as_tensor(np.asarray(w, dtype=np.float64), device=self.device).to(self.dtype)

    def _forward(self, flat: Any, x: Any) -> Any:
        return self.torch.func.functional_call(self.module, self._params(flat), (x,))

    def _per_example(self, out: Any, y: Any) -> Any:
        functional = self.torch.nn.functional
        if self.loss == "cross_entropy":
            if out.ndim == 2 and y.ndim == 1 and not y.is_floating_point():
                # -log softmax(out)_y, F.cross_entropy's loss for class labels in [0, c): on the CPU 2-3x faster for
                # few classes (log_softmax's kernel is slow on rows of ~10 scores; the benchmarks page)
                return self.torch.logsumexp(out, dim=1) - out.gather(1, y[:, None])[:, 0]
            return functional.cross_entropy(out, y, reduction="none")
        if self.loss == "mse":
            return functional.mse_loss(out, y.reshape(out.shape), reduction="none").reshape(out.shape[0], -1).mean(1)
        per = self.loss(out, y)
        if per.ndim != 1 or per.shape[0] != out.shape[0]:
            raise ValueError(
                f"task {self.name!r}: the loss returned shape {tuple(per.shape)}; it must return one loss per "
                f"example, shape ({out.shape[0]},) (e.g. reduction='none')"
            )
        return per

    def _objective(self, flat: Any, x: Any, y: Any, mask: Any) -> Any:
        """``f_i(w)`` on the examples where ``mask`` is true (padding excluded)."""
        per = self._per_example(self._forward(flat, x), y)
        mean = self.torch.where(mask, per, self.torch.zeros_like(per)).sum() / mask.sum()
        return mean + 0.5 * self.weight_decay * (flat * flat).sum()

    @cached_property
    def _grad(self) -> Callable[..., Any]:
        return self.torch.func.grad(self._objective)

    # ------------------------------------------------------------------ tensors
    def _x(self, x: np.ndarray) -> Any:
        return self.torch.tensor(x, device=self.device, dtype=self.dtype)  # a copy (x may be a read-only memmap)

    def _y(self, y: np.ndarray) -> Any:
        if np.issubdtype(y.dtype, np.integer):
            return self.torch.tensor(y, device=self.device, dtype=self.torch.long)
        return self.torch.tensor(y, device=self.device, dtype=self.dtype)

    # ------------------------------------------------------------------ clients
    def _load_client(self, client_id: int) -> tuple[Any, Any, Any]:
        x_np, y_np = self.data.client(client_id)
        mask = self.torch.ones(len(y_np), dtype=self.torch.bool, device=self.device)
        return self._x(x_np), self._y(y_np), mask

    def client_grad_fn(self, client_id: int) -> GradFn:
        """``grad f_i`` (full batch) of client ``i``: float64 numpy in and out, computed in ``torch-dtype``."""
        tensors = self._client_tensors(client_id)
        return self._single_grad_fn(lambda: tensors)

    def client_round_grad_fn(self, client_id: int, server_round: int) -> GradFn:
        """Client ``i``'s gradient oracle in round ``k``: full batch, or the round's mini-batches one per call.

        The engines call this (not `client_grad_fn()`) when a task has it, so that mini-batches
        follow the round (``local-batch-size``); with full batches it is `client_grad_fn()`.
        """
        if self.batch_size <= 0:
            return self.client_grad_fn(client_id)
        x, y, _ = self._client_tensors(client_id)
        batches = minibatch_indices(self.cfg.seed, client_id, server_round, len(y), self.batch_size)

        def next_batch() -> tuple[Any, Any, Any]:
            idx = self.torch.as_tensor(next(batches), device=self.device)
            return x[idx], y[idx], self.torch.ones(len(idx), dtype=self.torch.bool, device=self.device)

        return self._single_grad_fn(next_batch)

    def _single_grad_fn(self, batch: Callable[[], tuple[Any, Any, Any]]) -> GradFn:
        torch = self.torch
        self.layout  # noqa: B018 - build the module before any torch.func transform

        def grad(w: Vector) -> Vector:
            flat = torch.as_tensor(np.asarray(w, dtype=np.float64), device=self.device).to(self.dtype)
            with self._lock:
                g = self._grad(flat, *batch())
            return g.detach().to(torch.float64).cpu().numpy()

        return grad

    def client_batch_update_fn(self, client_ids: np.ndarray, server_round: int = 0) -> BatchUpdateFn:
        """``u = (w_k - w_{k,E}) / eta_k`` of E local steps for a block of clients in one call (``(B, dim)``).

        `client_runs_update_fn()` for one run. ``server_round`` picks the round's mini-batches.
        """
        runs_update = self.client_runs_update_fn(client_ids, server_round)
        return lambda w, lr, num_steps: runs_update(np.asarray(w)[None, :], np.array([lr]), num_steps)[0]

    def _data_objective(self, params: dict[str, Any], x: Any, y: Any, mask: Any) -> Any:
        """The mean loss on the examples where ``mask`` is true (``f_i`` without the weight decay)."""
        out = self.torch.func.functional_call(self.module, {**params, **self._buffers}, (x,))
        per = self._per_example(out, y)
        return self.torch.where(mask, per, self.torch.zeros_like(per)).sum() / mask.sum()

    def _scaled_objective(self, params: dict[str, Any], x: Any, y: Any, mask: Any, scale: Any) -> Any:
        """``scale`` times `_data_objective()`: its gradient is ``scale * grad L_i``, the step's increment as the
        backward pass writes it (`_chunk_steps()`), so no separate pass scales the gradient."""
        return self._data_objective(params, x, y, mask) * scale

    @cached_property
    def _clients_grad(self) -> Callable[..., Any]:
        """``grad`` of `_scaled_objective()` vmapped over a chunk of clients (one run; ``scale`` shared)."""
        func = self.torch.func
        return func.vmap(func.grad(self._scaled_objective), in_dims=(0, 0, 0, 0, None))

    #: Set when ``torch.compile`` failed on this task's step: the rest of the run is eager (`_compiled_step`).
    _compile_failed: bool = False

    @cached_property
    def _compiled_step(self) -> Callable[..., Any]:
        """One local step of a chunk of clients through ``torch.compile`` (``torch-compile = true``).

        ``(m, base, x, y, mask, alpha, weight, scale, lerp) -> m'``: the step of `_chunk_steps()` for one run, in one
        compiled call: ``w_t = m_t + alpha w_k`` (``alpha = 1 + c_t``), the vmapped gradient of `_scaled_objective()`
        and the update of ``m`` (``lerp`` with ``weight = eta lambda``, else ``(1 - weight) m + scale grad``), so
        inductor fuses the elementwise passes into the products' loops. The numbers come as 0-d tensors (a Python
        float is a constant to Dynamo: each step's ``alpha`` would compile again) and every chunk has one shape
        (`_compiled_chunk_steps()`), so a run compiles once. If a call raises (it compiles at its first call for a
        shape), one log line says so, the whole block runs again eagerly (`_EagerFallback`), and so does the rest of
        the run.
        """
        torch = self.torch
        names = self.layout.names
        grad = self._clients_grad
        self._buffers  # noqa: B018 - cached here: a cached_property's first look-up inside the region breaks its graph

        def step(m: list[Any], base: list[Any], x: Any, y: Any, mask: Any, alpha: Any, weight: Any, scale: Any,
                 lerp: bool) -> list[Any]:  # fmt: skip
            g = grad({n: mi + bi * alpha for n, mi, bi in zip(names, m, base, strict=True)}, x, y, mask, scale)
            if lerp:
                return [mi.lerp(g[n], weight) for n, mi in zip(names, m, strict=True)]
            return [mi * (1.0 - weight) + g[n] for n, mi in zip(names, m, strict=True)]

        compiled = torch.compile(step, dynamic=False)

        def call(*args: Any) -> list[Any]:
            if not self._compile_failed:
                try:
                    return compiled(*args)
                except Exception as err:  # noqa: BLE001 - any failure to compile: the eager steps
                    logger.warning("torch-compile: %s cannot be compiled (%s: %s); the local steps run eagerly",
                                   self.cfg.task, type(err).__name__, (str(err).splitlines() or [""])[0])  # fmt: skip
                    self._compile_failed = True
            raise _EagerFallback

        return call

    def _compile_size(self, clients: int) -> int:
        """The compiled chunk's number of clients: `COMPILE_CHUNK_CLIENTS` on the CPU (every block cut into chunks
        of that size), a block's `compile_bucket()` on an accelerator (the whole block one chunk)."""
        return COMPILE_CHUNK_CLIENTS if self.device.type == "cpu" else compile_bucket(clients)

    def _compiled_chunk_steps(self, start: dict[str, Any], lrs: np.ndarray, x: Any, y: Any, mask: Any,
                              batches: Callable[[], tuple[Any, Any, Any]] | None, num_steps: int, *, size: int,
                              ) -> dict[str, Any]:  # fmt: skip
        """`_chunk_steps()` for one run through `_compiled_step`, the chunk padded to ``size`` clients.

        The padded rows are copies of the chunk's first client (real data: no 0/0 in a masked mean) and are
        dropped from the result; each step is one compiled call.
        """
        torch = self.torch
        names = list(start)
        clients = x.shape[0]

        def pad(t: Any) -> Any:
            extra = size - t.shape[0]
            return t if extra == 0 else torch.cat([t, t[:1].expand(extra, *t.shape[1:])])

        x, y, mask = pad(x), pad(y), pad(mask)
        base = [start[n][0] for n in names]
        decay = float(lrs[0]) * self.weight_decay  # a = eta lambda
        lerp = self.weight_decay >= LERP_MIN_DECAY
        number = lambda v: torch.tensor(v, dtype=self.dtype, device=self.device)  # noqa: E731
        scale = number(-1.0 / self.weight_decay if lerp else -float(lrs[0]))
        weight = number(decay)
        m = [torch.zeros((size, *bi.shape[1:]), dtype=self.dtype, device=self.device) for bi in base]
        offsets = decay_offsets(decay, num_steps)
        # each step's 1 + c_t in one copy to the device (a new tensor each step was a host-to-device copy, which on a
        # GPU waits for the queued steps); each step takes a 0-d view, which does not recompile the step
        steps_on_device = number([1.0 + float(c) for c in offsets[:-1]])
        c = float(offsets[-1])
        for step in range(num_steps):
            xb, yb, mb = (x, y, mask) if batches is None else (pad(t) for t in batches())
            m = self._compiled_step(m, base, xb, yb, mb, steps_on_device[step], weight, scale, lerp)
        return {n: torch.add(mi[:clients], bi, alpha=c)[None] for n, mi, bi in zip(names, m, base, strict=True)}

    @cached_property
    def _runs_grad(self) -> Callable[..., Any]:
        """`_clients_grad` over an ``(R, B)`` block: clients inside, runs outside (data shared, one scale a run)."""
        return self.torch.func.vmap(self._clients_grad, in_dims=(0, None, None, None, 0))

    def _runs_update(
        self, client_ids: np.ndarray, server_round: int = 0, out_dtype: Any = None
    ) -> Callable[[Any, np.ndarray, int], Any]:
        """``u`` of E local steps for ``R`` runs x ``B`` clients: ``(W_k (R, dim), eta_k (R,), E) -> (R, B, dim)``.

        Alg. 1/2 lines 5-9: ``w_{t+1} = w_t - eta_k (grad L_i(w_t) + lambda w_t)``, ``u = (w_k - w_{k,E}) / eta_k``
        (`_chunk_steps()`: each step one ``vmap`` over the clients, inside one over the runs when there are
        several, of ``torch.func.grad`` of the data loss; the weight decay outside autograd). The iterate is kept
        as its displacement from the run's ``w_k``, one tensor per parameter (no flattening per step), in
        ``torch-dtype``: with float64 the steps are `dpfedavg.core.client_update()`'s to the rounding of a sum;
        with float32 ``u`` keeps float32's relative precision (the displacement is small next to ``w``; tested
        within 1e-5 of the float64 loop). On the CPU, clients are processed `CLIENT_CHUNK_BYTES` of data at a
        time through all E steps (which bounds a step's working set); on a GPU the whole block is one chunk
        (one vmapped call per step). With ``torch-compile`` (one run), each step of a chunk is one compiled call
        instead (`_compiled_chunk_steps()`: chunks of `_compile_size()` clients, the last one padded). Each chunk's
        displacements are copied into the result in place and the result is divided by ``-eta_k`` once.
        ``server_round`` picks the round's mini-batches. The result is a tensor on the task's device, float64
        unless ``out_dtype`` says otherwise.
        """
        torch = self.torch
        layout = self.layout  # builds the module before any torch.func transform
        ids = np.asarray(client_ids)
        x, y, counts = self._device_block(ids)
        m_max = x.shape[1]
        full_mask = torch.as_tensor(np.arange(m_max)[None, :] < counts[:, None], device=self.device)
        per_client = max(1, x[0].numel() * x.element_size())
        chunk = len(ids) if self.device.type != "cpu" else max(1, min(len(ids), CLIENT_CHUNK_BYTES // per_client))
        offsets = np.concatenate([[0], np.cumsum(layout.numels)]).tolist()

        def update(w: Any, lrs: np.ndarray, num_steps: int) -> Any:
            """``(R, B, dim)`` float64 on the task's device; ``w`` a numpy array or a tensor (already there)."""
            lrs = runs_step_sizes(lrs, num_steps)
            if isinstance(w, np.ndarray | list):
                w = np.atleast_2d(np.asarray(w, dtype=np.float64))
            w0 = torch.as_tensor(w, device=self.device)
            w0 = (w0[None, :] if w0.dim() == 1 else w0).to(self.dtype)
            runs = w0.shape[0]
            start = {}  # w_k per parameter, (R, 1, ...) in the module's layout
            pieces = torch.split(w0, layout.numels, dim=1)
            for i, (name, piece, shape) in enumerate(zip(layout.names, pieces, layout.flat_shapes(), strict=True)):
                start[name] = piece.reshape(runs, 1, *shape)
                if layout.is_transposed(i):
                    start[name] = start[name].transpose(-1, -2).contiguous()
            out = torch.empty((runs, len(ids), layout.dim), dtype=out_dtype or torch.float64, device=self.device)

            def chunks(size: int, steps: Callable[..., dict[str, Any]]) -> None:
                for lo in range(0, len(ids), size):
                    hi = min(lo + size, len(ids))
                    batches = self._minibatches(ids[lo:hi], counts[lo:hi], server_round, x[lo:hi], y[lo:hi])
                    moved = steps(start, lrs, x[lo:hi], y[lo:hi], full_mask[lo:hi], batches, num_steps)
                    for i, (name, shape) in enumerate(zip(layout.names, layout.flat_shapes(), strict=True)):
                        part = moved[name].transpose(-1, -2) if layout.is_transposed(i) else moved[name]
                        out[:, lo:hi, offsets[i] : offsets[i + 1]].view(runs, hi - lo, *shape).copy_(part)

            with self._lock:
                try:
                    if runs > 1 or not self.cfg.torch_compile or self._compile_failed:
                        raise _EagerFallback
                    size = self._compile_size(len(ids))
                    chunks(size, lambda *args: self._compiled_chunk_steps(*args, size=size))
                except _EagerFallback:  # the eager steps (a sweep's runs, or a model inductor cannot compile)
                    chunks(chunk, self._chunk_steps)
            return out.div_(-torch.as_tensor(lrs, device=self.device)[:, None, None])

        return update

    def client_runs_update_fn(self, client_ids: np.ndarray, server_round: int = 0) -> RunsUpdateFn:
        """``u`` of E local steps for ``R`` runs x ``B`` clients: ``(W_k (R, dim), eta_k (R,), E) -> (R, B, dim)``.

        `_runs_update()`'s tensor as a float64 numpy array (the engines that work on the host).
        """
        update = self._runs_update(client_ids, server_round)
        return lambda w, lrs, num_steps: update(w, lrs, num_steps).cpu().numpy()

    def device_block_update(self, client_ids: np.ndarray, server_round: int = 0) -> Callable[[Any, float, int], Any]:
        """``(w_k, eta_k, E) -> u``, ``(B, dim)`` left on the task's device (the batched engine's pipeline).

        `_runs_update()` for one run; ``w_k`` a numpy vector or a tensor on the device. The engine bounds,
        noises and sums ``u`` there (`dpfedavg.core.pipeline.round_block_sum()`), in ``u``'s dtype: float64, or
        with ``torch-compile`` the working dtype (``torch-dtype``; float32 by default, which the pipeline then
        runs in: within `dpfedavg.core.pipeline.FLOAT32_TOLERANCE` of float64).
        """
        update = self._runs_update(client_ids, server_round, self.dtype if self.cfg.torch_compile else None)
        return lambda w, lr, num_steps: update(w, np.array([lr]), num_steps)[0]

    def _chunk_steps(
        self,
        start: dict[str, Any],
        lrs: np.ndarray,
        x: Any,
        y: Any,
        mask: Any,
        batches: Callable[[], tuple[Any, Any, Any]] | None,
        num_steps: int,
    ) -> dict[str, Any]:
        """E steps of a chunk of clients for every run; returns the displacements ``w_{k,E} - w_k`` per parameter.

        With ``a = eta lambda``, a step is ``w_{t+1} = (1 - a) w_t - eta grad L_i(w_t)`` (Alg. 1/2 line 7). The
        displacement is split as ``w_t - w_k = c_t w_k + m_t``: ``c_t`` a number per run
        (``c_{t+1} = (1 - a) c_t - a``, the decay of ``w_k``) and ``m_t`` the clients' own part,
        ``m_{t+1} = (1 - a) m_t - eta grad L_i(w_t)``. The gradient comes out of the backward pass already scaled
        (`_scaled_objective()` with ``scale = -1 / lambda``), so ``m`` takes one ``lerp_`` a step,
        ``m + a (scale grad L_i - m)`` (without weight decay, or below `LERP_MIN_DECAY`, ``scale = -eta`` and
        ``m`` takes an ``add_``), and ``w_t`` one ``add`` into a reused buffer: two passes over the chunk's
        parameters a step where there were five.
        """
        torch = self.torch
        names = list(start)
        runs, clients = next(iter(start.values())).shape[0], x.shape[0]
        decay = lrs * self.weight_decay  # a = eta lambda, per run
        lerp = self.weight_decay >= LERP_MIN_DECAY
        scale = -1.0 / self.weight_decay if lerp else -lrs  # scale * grad L_i: see above
        if runs == 1:  # one run: no vmap over runs
            grad_fn, lead, base = self._clients_grad, (clients,), [start[n][0] for n in names]
            scale, weight = float(np.atleast_1d(scale)[0]), float(decay[0])
        else:
            grad_fn, lead, base = self._runs_grad, (runs, clients), [start[n] for n in names]
            scale = torch.as_tensor(np.full(runs, scale) if lerp else scale, dtype=self.dtype, device=self.device)
            weight = torch.as_tensor(decay, dtype=self.dtype, device=self.device)
        per_run = (-1,) + (1,) * 9  # one value per run, broadcast over (clients, parameter dims)
        m = [torch.zeros((*lead, *base[i].shape[len(lead) :]), dtype=self.dtype, device=self.device)
             for i in range(len(names))]  # fmt: skip
        w = [torch.empty_like(mi) for mi in m]  # w_t, rewritten each step
        cs = decay_offsets(decay, num_steps)  # c_0 .. c_E, one per run
        # several runs: every step's 1 + c_t (one per run) go to the device in one copy (a copy per step and
        # parameter would be a host-to-device copy each, which on a GPU waits for the queued steps)
        factors = torch.as_tensor(1.0 + np.stack(cs), dtype=self.dtype, device=self.device) if runs > 1 else None
        for step in range(num_steps):
            for wi, mi, bi in zip(w, m, base, strict=True):
                if factors is None:
                    torch.add(mi, bi, alpha=1.0 + float(cs[step][0]), out=wi)
                else:
                    torch.add(mi, bi * factors[step].reshape(per_run[: bi.dim()]), out=wi)
            xb, yb, mb = (x, y, mask) if batches is None else batches()
            grads = grad_fn(dict(zip(names, w, strict=True)), xb, yb, mb, scale)
            grads = [grads[n] for n in names]
            if lerp:
                for mi, g in zip(m, grads, strict=True):
                    mi.lerp_(g, weight if runs == 1 else weight.reshape(per_run[: mi.dim()]))
            else:  # no (or a tiny) weight decay: scale = -eta
                if self.weight_decay:
                    for mi in m:
                        mi.mul_(1.0 - weight if runs == 1 else 1.0 - weight.reshape(per_run[: mi.dim()]))
                torch._foreach_add_(m, grads)
        c = cs[-1]
        if runs == 1:
            return {n: torch.add(mi, bi, alpha=float(c[0]))[None] for n, mi, bi in zip(names, m, base, strict=True)}
        factor = torch.as_tensor(c, dtype=self.dtype, device=self.device)
        return {n: mi + bi * factor.reshape(per_run[: bi.dim()]) for n, mi, bi in zip(names, m, base, strict=True)}

    def _minibatches(
        self, ids: np.ndarray, counts: np.ndarray, server_round: int, x: Any, y: Any
    ) -> Callable[[], tuple[Any, Any, Any]] | None:
        """The round's mini-batches of a chunk of clients, one call per step (``None``: full batches)."""
        if self.batch_size <= 0:
            return None
        torch = self.torch
        streams = [minibatch_indices(self.cfg.seed, int(i), server_round, int(c), self.batch_size)
                   for i, c in zip(ids, counts, strict=True)]  # fmt: skip
        rows = torch.arange(len(ids), device=self.device)[:, None]

        def next_batches() -> tuple[Any, Any, Any]:
            picks = [next(s) for s in streams]
            width = max(len(p) for p in picks)
            idx = np.zeros((len(ids), width), dtype=np.int64)
            valid = np.zeros((len(ids), width), dtype=bool)
            for b, p in enumerate(picks):
                idx[b, : len(p)], valid[b, : len(p)] = p, True
            idx_t = torch.as_tensor(idx, device=self.device)
            return x[rows, idx_t], y[rows, idx_t], torch.as_tensor(valid, device=self.device)

        return next_batches

    @cached_property
    def _resident_shards(self) -> tuple[Any, Any] | None:
        """A sharded dataset's ``(x, y)`` copied to the accelerator once (``None``: not used).

        On a GPU, gathering a block's rows on the host and copying them over every round costs more than the
        round's steps (about 37 MB a round at r = 600 on FMNIST shapes); a `ShardedClients` whose arrays take at
        most `RESIDENT_FRACTION` of the device's free memory is moved there whole, in ``torch-dtype``, and each
        block is gathered on the device (`_device_block()`): the same values as the host path, one copy fewer.
        CPU tasks (and other client sources) keep the host path.
        """
        if self.device.type != "cuda" or not isinstance(self.data, ShardedClients):
            return None
        torch = self.torch
        x_all, y_all, _ = self.data.arrays
        shape = (len(x_all), *self.data.x_shape) if self.data.x_shape is not None else tuple(np.shape(x_all))
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        need = int(np.prod(shape)) * itemsize + np.asarray(y_all).nbytes * 2
        free, _ = torch.cuda.mem_get_info(self.device)
        if need > RESIDENT_FRACTION * free:
            logger.info("the clients' data (%.2f GiB) stay on the host: more than %g of the device's free memory",
                        need / 2**30, RESIDENT_FRACTION)  # fmt: skip
            return None
        return self._x(np.asarray(x_all).reshape(shape)), self._y(np.asarray(y_all))

    def _device_block(self, ids: np.ndarray) -> tuple[Any, Any, np.ndarray]:
        """A block's ``(x, y)`` tensors on the task's device and the clients' example counts.

        `ShardedClients.block()`'s rows (each client's sorted), gathered on the device when the dataset is
        resident there (`_resident_shards`), else on the host and copied.
        """
        resident = self._resident_shards
        if resident is None:
            x_np, y_np, counts = self.data.block(ids)
            return self._block_x(x_np), self._y(y_np), counts
        x_all, y_all = resident
        rows = self.torch.as_tensor(self.data.block_rows(ids), device=self.device)
        return x_all[rows], y_all[rows], np.full(len(ids), rows.shape[1])

    def _block_x(self, x: np.ndarray) -> Any:
        """A block's inputs as a tensor: shares the gathered array's memory when it can (no second copy)."""
        if (
            x.flags.writeable
            and x.flags.c_contiguous
            and self.device.type == "cpu"
            and x.dtype == np.dtype(str(self.dtype).removeprefix("torch."))
        ):
            return self.torch.from_numpy(x)
        return self._x(x)

    # ------------------------------------------------------------------ evaluation
    @cached_property
    def test_data(self) -> tuple[np.ndarray, np.ndarray] | None:
        source = self._test_source
        if source is None:
            return None
        x, y = source() if callable(source) else source
        return _numpy(x), _numpy(y)

    def _test_scores(self, flat: Any) -> tuple[float, float]:
        assert self.test_data is not None
        x_all, y_all = self.test_data
        loss_sum, correct = 0.0, 0
        for start in range(0, len(y_all), EVAL_CHUNK):
            x, y = self._x(x_all[start : start + EVAL_CHUNK]), self._y(y_all[start : start + EVAL_CHUNK])
            out = self._forward(flat, x)
            loss_sum += float(self._per_example(out, y).double().sum())
            if self.classification:
                correct += int((out.argmax(dim=1) == y).sum())
        return loss_sum / len(y_all), correct / len(y_all)

    def _train_objective(self, flat: Any) -> float:
        """``f(w) = (1/n) sum_i f_i(w)``."""
        torch = self.torch
        objective = torch.func.vmap(self._objective, in_dims=(None, 0, 0, 0))
        total = 0.0
        for start in range(0, self.num_clients, EVAL_CLIENT_BLOCK):
            ids = np.arange(start, min(start + EVAL_CLIENT_BLOCK, self.num_clients))
            x, y, counts = self._device_block(ids)
            mask = torch.as_tensor(np.arange(x.shape[1])[None, :] < counts[:, None], device=self.device)
            total += float(objective(flat, x, y, mask).double().sum())
        return total / self.num_clients

    def evaluate(self, w: Vector) -> dict[str, float]:
        """Test accuracy / loss (with test data) and the training objective ``f(w)`` over the clients' data."""
        torch = self.torch
        self.layout  # noqa: B018 - build the module before any torch.func transform
        flat = self._flat(w)
        names = self.metric_names  # decides classification (the first call) outside the lock
        out: dict[str, float] = {}
        with self._lock, torch.no_grad():
            if self.test_data is not None:
                test_loss, test_acc = self._test_scores(flat)
                if "test_accuracy" in names:
                    out["test_accuracy"] = test_acc
                out["test_loss"] = test_loss
            out["train_loss"] = self._train_objective(flat)
        return out
