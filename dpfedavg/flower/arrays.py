"""A user's model (any ``state_dict`` in an ``ArrayRecord``) as the server's flat vector, and back.

dpfedavg's server works on one flat float64 vector ``w`` (`DPServer`);
a Flower user's app sends and receives its own ``ArrayRecord``: a PyTorch ``state_dict``, a list of
numpy arrays, any keys, shapes and dtypes. `ArrayLayout` is the one map between the two, used
by the client mod (`dpfedavg.flower.mod.dp_mod()`, which flattens what its client received and
what it returns) and by the strategy (`dpfedavg.flower.app_strategy.DPFedAvg`, which
flattens ``initial_arrays`` and rebuilds the user's record from every ``w_k``).

* **Trained arrays**: every array with a floating dtype, flattened in **sorted key order** (the same
  order on both sides, whatever order a transport keeps), each as float64.
* **Frozen arrays**: arrays of any other dtype (e.g. BatchNorm's ``num_batches_tracked``, int64) are not
  part of ``w``: the server keeps their initial values for the whole run, and what a client returns for
  them is ignored and never sent (a count of local steps is not an update that can be averaged or noised).
* **Float buffers** (BatchNorm's ``running_mean`` and ``running_var`` in a ``state_dict``) are floating arrays,
  so they are trained like weights: a client's change of them on its data is part of its update, clipped
  and noised with it (it counts against ``C``), and the server averages the noised change. Nothing computed
  from a client's data leaves it without noise; the layout says so in a warning (``buffer_note``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord

from dpfedavg.core.types import Vector

__all__ = ["RUNNING_STATISTICS", "ArrayLayout", "LayoutMismatch", "warn_buffers_once"]

logger = logging.getLogger(__name__)

#: The last part of the ``state_dict`` keys of torch's running statistics (BatchNorm, InstanceNorm) and their counter.
RUNNING_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")
#: Layouts whose buffers were already explained in this process (one warning per model).
_WARNED: set[tuple[str, ...]] = set()


class LayoutMismatch(ValueError):
    """A record's arrays do not match the model's (keys, shapes or dtypes); the message names what differs."""


def _is_float(dtype: str) -> bool:
    return np.issubdtype(np.dtype(dtype), np.floating)


@dataclass(frozen=True)
class ArrayLayout:
    """Keys, shapes and dtypes of a model's arrays; which are trained (floating) and in which order.

    Attributes
    ----------
    keys:
        Every key, in the record's own order (the order the rebuilt record keeps).
    shapes, dtypes:
        Per key (same order as ``keys``).
    trained:
        The floating keys in sorted order: the layout of the flat vector ``w``.
    """

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    trained: tuple[str, ...]

    @classmethod
    def of(cls, record: ArrayRecord) -> ArrayLayout:
        """The layout of ``record``; ``ValueError`` if it has no floating array (nothing to train)."""
        keys = tuple(record.keys())
        shapes = tuple(tuple(int(s) for s in record[k].shape) for k in keys)
        dtypes = tuple(str(record[k].dtype) for k in keys)
        trained = tuple(sorted(k for k, d in zip(keys, dtypes, strict=True) if _is_float(d)))
        if not trained:
            raise ValueError(
                f"the model's arrays ({', '.join(f'{k}: {d}' for k, d in zip(keys, dtypes, strict=True)) or 'none'}) "
                "have no floating array: there is nothing to train"
            )
        return cls(keys, shapes, dtypes, trained)

    # ------------------------------------------------------------------ info
    @property
    def dim(self) -> int:
        """Length of ``w``: the number of floating entries."""
        shape = self._shape
        return int(sum(int(np.prod(shape[k], dtype=np.int64)) for k in self.trained))

    @property
    def frozen(self) -> tuple[str, ...]:
        """The non-floating keys (kept at their initial values)."""
        return tuple(k for k in self.keys if k not in set(self.trained))

    @property
    def _shape(self) -> dict[str, tuple[int, ...]]:
        return dict(zip(self.keys, self.shapes, strict=True))

    def describe(self) -> str:
        """One line for the logs: how many arrays and entries are trained, which are frozen."""
        frozen = self.frozen
        dtype = dict(zip(self.keys, self.dtypes, strict=True))
        text = f"{len(self.trained)} floating arrays, d = {self.dim} entries"
        if frozen:
            text += "; not trained (kept at their initial values): " + ", ".join(f"{k} ({dtype[k]})" for k in frozen)
        note = self.buffer_note()
        return text + (f"; {note}" if note else "")

    def buffer_note(self) -> str | None:
        """What happens to the model's running statistics, in one line (``None`` when it has none)."""
        floats = [k for k in self.trained if k.rsplit(".", 1)[-1] in RUNNING_STATISTICS]
        counters = [k for k in self.frozen if k.rsplit(".", 1)[-1] in RUNNING_STATISTICS]
        if not floats and not counters:
            return None
        parts = []
        if floats:
            parts.append(
                f"running statistics {', '.join(floats[:4])}{' ...' if len(floats) > 4 else ''} are floating arrays, "
                "so each client's change of them is part of its update: clipped and noised with the weights "
                "(it counts against C) and averaged by the server"
            )
        if counters:
            parts.append(
                f"{', '.join(counters[:4])}{' ...' if len(counters) > 4 else ''} (not floating) are never sent: the "
                "server keeps their initial values"
            )
        return "; ".join(parts) + " (GroupNorm / LayerNorm keep no statistics of the data)"

    # ---------------------------------------------------------------- checks
    def check(self, record: ArrayRecord, *, what: str = "the reply's arrays") -> None:
        """``LayoutMismatch`` naming the first difference: missing or extra keys, a shape, a non-float dtype."""
        got = list(record.keys())
        missing = [k for k in self.keys if k not in record]
        extra = [k for k in got if k not in set(self.keys)]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing {', '.join(repr(k) for k in missing[:5])}{' ...' if len(missing) > 5 else ''}")
            if extra:
                parts.append(f"unexpected {', '.join(repr(k) for k in extra[:5])}{' ...' if len(extra) > 5 else ''}")
            raise LayoutMismatch(f"{what} do not have the model's keys: {'; '.join(parts)}")
        shape = self._shape
        for key in self.keys:
            got_shape = tuple(int(s) for s in record[key].shape)
            if got_shape != shape[key]:
                raise LayoutMismatch(f"{what}: {key!r} has shape {got_shape}, the model's is {shape[key]}")
        for key in self.trained:
            if not _is_float(str(record[key].dtype)):
                raise LayoutMismatch(f"{what}: {key!r} has dtype {record[key].dtype}, expected a floating dtype")

    # ------------------------------------------------------------- converting
    def flatten(self, record: ArrayRecord, *, what: str = "the arrays") -> Vector:
        """``w``: the trained arrays of ``record`` (checked first), in sorted key order, as one float64 vector."""
        self.check(record, what=what)
        return self.flatten_arrays({k: record[k].numpy() for k in self.trained})

    def flatten_arrays(self, arrays: Mapping[str, np.ndarray]) -> Vector:
        """``w`` from numpy arrays by key (no checks beyond the shapes)."""
        parts = [np.asarray(arrays[k], dtype=np.float64).reshape(-1) for k in self.trained]
        return np.concatenate(parts) if parts else np.zeros(0)

    def unflatten(self, w: Vector, frozen_from: ArrayRecord) -> ArrayRecord:
        """The user's record for ``w``: trained arrays cast to their dtypes, frozen ones copied from ``frozen_from``.

        Keys come in the layout's order (the user's), so ``result.arrays.to_torch_state_dict()`` loads with
        ``model.load_state_dict``.
        """
        w = np.asarray(w)
        if w.shape != (self.dim,):
            raise ValueError(f"w has shape {w.shape}, expected ({self.dim},)")
        shape = self._shape
        dtype = dict(zip(self.keys, self.dtypes, strict=True))
        trained: dict[str, np.ndarray] = {}
        offset = 0
        for key in self.trained:
            size = int(np.prod(shape[key], dtype=np.int64))
            trained[key] = w[offset : offset + size].reshape(shape[key]).astype(dtype[key])
            offset += size
        out: dict[str, Array] = {}
        for key in self.keys:
            value = trained[key] if key in trained else frozen_from[key].numpy()
            out[key] = Array(np.require(value, requirements="C"))
        return ArrayRecord(out)

    def round_trip(self, w: Vector) -> Vector:
        """``w`` as the clients will see it: each trained entry rounded to its array's dtype, back in float64."""
        shape = self._shape
        dtype = dict(zip(self.keys, self.dtypes, strict=True))
        parts, offset = [], 0
        for key in self.trained:
            size = int(np.prod(shape[key], dtype=np.int64))
            parts.append(np.asarray(w[offset : offset + size]).astype(dtype[key]).astype(np.float64))
            offset += size
        return np.concatenate(parts)


def warn_buffers_once(layout: ArrayLayout) -> None:
    """Log ``layout.buffer_note()`` as a warning, once per model in this process."""
    note = layout.buffer_note()
    if note is not None and layout.keys not in _WARNED:
        _WARNED.add(layout.keys)
        logger.warning("the model's buffers: %s", note)
