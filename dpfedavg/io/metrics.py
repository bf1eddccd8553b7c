"""``metrics.csv``'s schema: one row per round, the training statistics and the task's metrics."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from operator import attrgetter

__all__ = ["MetricsRow", "RoundStats"]


@dataclass(frozen=True)
class RoundStats:
    """Per-round training statistics: the one definition of ``metrics.csv``'s training columns.

    Frozen: `dpfedavg.server.dp_server.DPServer.close_round()` makes a round's statistics once, and nothing edits
    them after (the reasons are tuples; lists given, e.g. by a checkpoint, are copied into tuples).

    The fields from ``num_sampled`` to ``skipped`` are the columns, in this order; the task's metrics
    are written after `METRICS_AFTER` (see `columns()`).
    """

    round: int
    num_sampled: int
    num_received: int = 0
    num_failed: int = 0
    num_dropped: int = 0
    num_rejected: int = 0
    eta: float = float("nan")
    beta: float = float("nan")
    snr: float = float("nan")
    frac_clipped: float = float("nan")
    #: The round's clipping threshold / scaling factor C (C_k with adaptive-clip; NaN without a bound).
    clip: float = float("nan")
    #: adaptive-clip: b_k, the released (noised) fraction of unclipped updates, 1/2 + T_k / r; it replaces
    #: ``frac_clipped``, which is not computed for adaptive-clip.
    frac_unclipped: float = float("nan")
    mean_update_norm: float = float("nan")
    noise_multiplier: float = float("nan")
    epsilon: float = float("nan")
    #: 1 if secure aggregation summed no update this round (the server's noise alone was released).
    skipped: int = 0
    rejected_reasons: tuple[str, ...] = ()
    #: Why sampled clients failed (error replies, diverged local training): what fail-fast reports.
    failed_reasons: tuple[str, ...] = ()

    #: The task's metric columns follow this one.
    METRICS_AFTER = "beta"

    def __post_init__(self) -> None:
        if type(self.rejected_reasons) is not tuple:
            object.__setattr__(self, "rejected_reasons", tuple(self.rejected_reasons))
        if type(self.failed_reasons) is not tuple:
            object.__setattr__(self, "failed_reasons", tuple(self.failed_reasons))

    @classmethod
    def columns(cls, metric_names: tuple[str, ...] = ()) -> tuple[str, ...]:
        """``metrics.csv``'s columns: ``round``, the training statistics with the task's metrics, ``elapsed_s``."""
        train = [f.name for f in fields(cls) if f.name not in ("round", "rejected_reasons", "failed_reasons")]
        cut = train.index(cls.METRICS_AFTER) + 1
        return ("round", *train[:cut], *metric_names, *train[cut:], "elapsed_s")

    def state_dict(self) -> dict[str, object]:
        """Every field, for a checkpoint: ``RoundStats(**state_dict())`` is an equal copy.

        ``dataclasses.asdict`` gives the same dict, but it deep-copies field by field: with a checkpoint every
        10 rounds that was most of the time a long run spent writing them (the benchmarks page).
        """
        state: dict[str, object] = {name: getattr(self, name) for name in _FIELD_NAMES}
        state["rejected_reasons"] = list(self.rejected_reasons)
        state["failed_reasons"] = list(self.failed_reasons)
        return state

    def as_metrics(self) -> dict[str, float]:
        """The numeric columns for the MetricRecord / CSV."""
        return {name: getattr(self, name) for name in _STAT_COLUMNS}

    def csv_parts(self) -> tuple[tuple, tuple]:
        """The statistics of ``metrics.csv``'s row before and after the task's metrics (`columns()`' order)."""
        return _HEAD(self), _TAIL(self)


#: `RoundStats`'s field names, in order.
_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(RoundStats))
#: The numeric statistics `RoundStats.as_metrics()` gives (``columns()`` without ``round`` and ``elapsed_s``).
_STAT_COLUMNS: tuple[str, ...] = RoundStats.columns()[1:-1]
_CUT = _STAT_COLUMNS.index(RoundStats.METRICS_AFTER) + 1
_HEAD, _TAIL = attrgetter(*_STAT_COLUMNS[:_CUT]), attrgetter(*_STAT_COLUMNS[_CUT:])
#: `RoundStats.csv_parts()` of a row without statistics (round 0): every cell empty.
NO_STATS: tuple[tuple, tuple] = ((math.nan,) * _CUT, (math.nan,) * (len(_STAT_COLUMNS) - _CUT))


class MetricsRow(dict):
    """One row of ``metrics.csv`` (column -> value, NaN where empty): a missing column says which columns there are.

    ``result.history[-1]["test_accuracy"]`` of a run that does not compute accuracy is a ``KeyError`` that names
    the run's columns and how a task reports accuracy, not the bare key.
    """

    def __missing__(self, key: object) -> float:
        hint = ""
        if key == "test_accuracy":
            hint = (
                "; test_accuracy is computed for a task with test data whose model outputs class scores for "
                "integer labels (TorchTask(..., test=(x, y), classification=True) forces it)"
            )
        raise KeyError(f"{key!r} is not a column of this run's metrics.csv (columns: {', '.join(self)}){hint}")
