"""The clients' own metrics of a round, averaged as Flower's FedAvg does, with no client able to poison the average.

A user's app (``dp_mod`` around its train function) returns its own metrics beside the update, for example
``{"train_loss": 0.3, "num-examples": 600}``; ``DPFedAvg`` for a user's app reports their average over the
round's usable replies, weighted by ``num-examples`` as FedAvg does. They are not private (the DP guarantee
covers the model). One reply must not make the average meaningless, so a client's metrics are left out of it,
with the reason logged and returned, when:

* its ``num-examples`` is not a number in ``[1, MAX_NUM_EXAMPLES]`` (NaN, infinite, 0, negative, a boolean,
  ``1e12``: one such weight would carry the whole average, or make it NaN);
* one of its metric values is NaN or infinite.

A reply without ``num-examples`` weighs 1. A key is averaged when every kept client sends it as a number.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MAX_NUM_EXAMPLES", "average_client_metrics", "metrics_violation"]

#: The largest ``num-examples`` one client may report: a billion examples on one SuperNode.
MAX_NUM_EXAMPLES = 1e9


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def metrics_violation(metrics: Mapping[str, Any], weight_key: str) -> str | None:
    """Why one client's metrics cannot enter the average (``None`` when they can)."""
    weight = metrics.get(weight_key, 1)
    if not (_is_number(weight) and 1 <= weight <= MAX_NUM_EXAMPLES):
        return f"'{weight_key}' = {weight!r}: expected a number in [1, {MAX_NUM_EXAMPLES:g}]"
    for key, value in sorted(metrics.items()):
        if _is_number(value) and not math.isfinite(value):
            return f"metric '{key}' = {value!r}: expected a finite number"
    return None


def average_client_metrics(
    clients: Sequence[tuple[str, Mapping[str, Any]]], weight_key: str, skip: frozenset[str] = frozenset()
) -> tuple[dict[str, float], list[str]]:
    """The weighted average of the clients' metrics, and the reasons of the clients left out.

    Parameters
    ----------
    clients:
        ``(who, metrics)`` for each usable reply, ``who`` naming it in the reasons (``"node 3"``).
    weight_key:
        The weight's key (``"num-examples"``); it is not averaged.
    skip:
        Keys that are not averaged (dpfedavg's own).
    """
    rows: list[tuple[float, Mapping[str, Any]]] = []
    rejected: list[str] = []
    for who, metrics in clients:
        reason = metrics_violation(metrics, weight_key)
        if reason is not None:
            rejected.append(f"{who}: {reason}; its metrics are left out of the round's average")
            continue
        rows.append((float(metrics.get(weight_key, 1)), metrics))
    total = sum(w for w, _ in rows)
    out: dict[str, float] = {}
    for key in sorted({k for _, m in rows for k in m} - {weight_key, *skip}):
        values = [(w, m.get(key)) for w, m in rows]
        if all(_is_number(v) for _, v in values):
            mean = float(sum(w * v for w, v in values) / total)
            if math.isfinite(mean):
                out[key] = mean
            else:  # finite values near the float range can still overflow
                rejected.append(f"metric '{key}': the weighted sum of the clients' values overflows; it is left out")
    return out, rejected
