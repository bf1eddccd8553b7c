"""The message schema shared by the ServerApp strategy and the ClientApp.

Flower glue only: how the global model, the round's instructions and a
client's reply are laid out in Flower records. Keys are kebab-case as in
Flower's examples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.compat.common import recorddict_compat as compat

from dpfedavg.core.types import RoundInstructions, Vector
from dpfedavg.privacy.node_guard import CLIENT_IDS

__all__ = [
    "MODEL_KEY",
    "UPDATE_KEY",
    "CLEAN_UPDATE_KEY",
    "ARRAYS",
    "CONFIG",
    "METRICS",
    "DIAGNOSTICS",
    "REFUSED",
    "RoundInstructions",
    "from_array_record",
    "instructions_from_config_record",
    "instructions_to_config_record",
    "to_array_record",
    "parse_train_reply",
    "train_reply",
    "NUM_EXAMPLES",
    "PARTITION_ID",
    "NUM_PARTITIONS",
    "UPDATE_NORM",
    "QUERY",
    "CLIENT_IDS",
    "UPDATE_NORMS",
    "DIVERGED_CLIENT_IDS",
    "BlockReply",
    "block_key",
    "parse_block_reply",
]

#: The error code of a ClientApp's reply that refuses a round (`dpfedavg.privacy.policy`: the node's policy or
#: the run config forbids what the server asked); the reason names the rule. The server counts a rejection.
REFUSED = 4029

#: RecordDict keys.
ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"
DIAGNOSTICS = "diagnostics"

#: Array keys: the global model ``w_k`` (server -> client), the noisy update
#: ``g + zeta`` (client -> server) and, with ``diagnostics``, the clean ``g``.
MODEL_KEY = "w"
UPDATE_KEY = "update"
CLEAN_UPDATE_KEY = "clean-update"

#: Metric keys of a TRAIN reply (``update-norm`` only in seeded mode) and of the partition query's reply;
#: ``partition-id`` / ``num-partitions`` are also the SuperNode's ``--node-config`` keys.
NUM_EXAMPLES = "num-examples"
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
UPDATE_NORM = "update-norm"
#: The QUERY message the server sends each node before round 1 (config ``{"query": "partition"}``).
QUERY = ("query", "partition")

#: Virtual clients (``clients-per-node`` m > 1, simulation): the train config names the node's sampled
#: clients (``client-ids``, ascending, all hosted by that node); the reply's ARRAYS hold one update per
#: client under ``block_key(UPDATE_KEY, id)`` (DIAGNOSTICS: ``block_key(CLEAN_UPDATE_KEY, id)``), and its
#: METRICS list the clients that replied (``client-ids``, the arrays' order), their ``update-norms``
#: (seeded mode only) and the clients whose local training diverged (``diverged-client-ids``).
UPDATE_NORMS = "update-norms"
DIVERGED_CLIENT_IDS = "diverged-client-ids"


def block_key(key: str, client_id: int) -> str:
    """Client ``client_id``'s array key in a block reply (``key``: `UPDATE_KEY` or `CLEAN_UPDATE_KEY`)."""
    return f"{key}-{int(client_id)}"


def to_array_record(vector: Vector, key: str = MODEL_KEY) -> ArrayRecord:
    """Wrap a flat vector as a one-array ArrayRecord."""
    return ArrayRecord({key: Array(np.ascontiguousarray(vector))})


def from_array_record(record: ArrayRecord, key: str = MODEL_KEY) -> Vector:
    """The flat vector stored under ``key``; ``KeyError`` if absent."""
    return record[key].numpy()


def instructions_to_config_record(ins: RoundInstructions) -> ConfigRecord:
    """The train config the server sends with ``w_k`` (`RoundInstructions.to_config()`)."""
    return ConfigRecord(ins.to_config())  # type: ignore[arg-type]


#: The inverse of `instructions_to_config_record()` on the client, read strictly (`RoundInstructions.from_config()`).
instructions_from_config_record = RoundInstructions.from_config


def train_reply(
    msg: Message,
    updates: Mapping[str, Vector],
    metrics: Mapping[str, Any] | None = None,
    clean: Mapping[str, Vector] | None = None,
) -> Message:
    """A client's reply to the train message ``msg``: every train reply of the ClientApp and ``dp_mod`` is built here.

    ``updates``: array key -> ``g + zeta`` (`UPDATE_KEY`, or `block_key()` per virtual client) in `ARRAYS`, with
    ``metrics`` in `METRICS` and, with diagnostics, ``clean`` (key -> ``g``) in `DIAGNOSTICS` (what
    `parse_train_reply()` / `parse_block_reply()` read). ``metrics = None``: the masked-vector stage of SecAgg+,
    a legacy ``FitRes`` holding only the one encoded vector (weight ``num_examples = 1``: the server needs the
    plain sum, and nothing per client), which ``secaggplus_mod`` masks before it leaves the node.
    """
    if metrics is None:
        (vector,) = updates.values()
        fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([vector]), num_examples=1, metrics={})
        return Message(compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)
    content = RecordDict(
        {
            ARRAYS: ArrayRecord({key: Array(np.ascontiguousarray(v)) for key, v in updates.items()}),
            METRICS: MetricRecord(dict(metrics)),
        }
    )
    if clean is not None:
        content[DIAGNOSTICS] = ArrayRecord({key: Array(np.ascontiguousarray(v)) for key, v in clean.items()})
    return Message(content, reply_to=msg)


def _check_update(update: np.ndarray, dim: int) -> None:
    """``ValueError`` unless ``update`` is a finite float vector of length ``dim``."""
    if update.shape != (dim,):
        raise ValueError(f"update has shape {update.shape}, expected ({dim},)")
    if not np.issubdtype(update.dtype, np.floating):
        raise ValueError(f"update has dtype {update.dtype}, expected a float type")
    if not np.all(np.isfinite(update)):
        raise ValueError("update contains NaN or Inf")


def _check_clean(clean: np.ndarray, dim: int, clip: float) -> None:
    """``ValueError`` unless the clean update is a finite float vector of length ``dim`` and norm at most ``clip``."""
    if clean.shape != (dim,) or not np.issubdtype(clean.dtype, np.floating):
        raise ValueError(f"clean update has shape {clean.shape} and dtype {clean.dtype}, expected ({dim},) floats")
    clean_norm = float(np.linalg.norm(clean))
    if not clean_norm <= clip * (1 + 1e-9):  # also catches NaN
        raise ValueError(
            f"clean update has norm {clean_norm:.6g}, above C = {clip:g} (updates are bounded before noise)"
        )


def _record(content: RecordDict, key: str, kind: type) -> Any:
    """``content[key]``, which must be a ``kind`` record; ``ValueError`` naming what is there instead."""
    if key not in content:
        raise ValueError(f"reply lacks {key!r}")
    record = content[key]
    if not isinstance(record, kind):
        raise ValueError(f"reply's {key!r} is a {type(record).__name__}, expected a {kind.__name__}")
    return record


def _array(record: ArrayRecord, key: str) -> np.ndarray:
    """The array stored under ``key``; ``ValueError`` if absent or its bytes do not parse."""
    if key not in record:
        raise ValueError(f"reply lacks the array {key!r}")
    try:
        return np.asarray(record[key].numpy())
    except Exception as err:  # noqa: BLE001 - a client's bytes: any failure to decode them is a malformed reply
        raise ValueError(f"array {key!r} does not parse ({type(err).__name__}: {str(err)[:120]})") from None


def _check_records(content: RecordDict, diagnostics: bool) -> None:
    """Exactly `ARRAYS` and `METRICS` (and `DIAGNOSTICS` when it is on): nothing else is accepted."""
    expected = {ARRAYS, METRICS} | ({DIAGNOSTICS} if diagnostics else set())
    extra = sorted(set(content) - expected)
    if DIAGNOSTICS in extra:
        raise ValueError("reply carries a clean update, but diagnostics is off (nothing but g + zeta is accepted)")
    if extra:
        raise ValueError(f"reply has unexpected records {', '.join(map(repr, extra[:5]))}")


def _norm_value(value: object, key: str) -> float:
    """A reported ``||u||``: a finite number >= 0 (``ValueError`` otherwise: a list, NaN, a string...)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"reply's {key!r} = {str(value)[:60]} is not a finite number >= 0")
    return float(value)


def parse_train_reply(
    content: RecordDict, dim: int, *, diagnostics: bool, clip: float
) -> tuple[Vector, float, Vector | None]:
    """A TRAIN reply's ``(g + zeta, ||u|| or NaN, clean g or None)``; ``ValueError`` naming what is malformed.

    Exactly the records `ARRAYS` (an ArrayRecord holding one array, `UPDATE_KEY`, a finite float
    vector of length ``dim``) and `METRICS` (a MetricRecord; ``update-norm``, sent in seeded mode only,
    a finite number >= 0). With ``diagnostics`` the clean update `CLEAN_UPDATE_KEY` must be there, of
    length ``dim`` and norm at most ``clip`` (the bound every update has before noise); without it, a clean
    update is refused. Any other record type in any place, dtype, shape or value is a ``ValueError``.
    """
    _check_records(content, diagnostics)
    record = _record(content, ARRAYS, ArrayRecord)
    metrics = _record(content, METRICS, MetricRecord)
    if len(record) != 1:
        raise ValueError(
            f"reply has {len(record)} arrays ({', '.join(sorted(record)[:5])}), expected 1 ({UPDATE_KEY!r})"
        )
    update = _array(record, UPDATE_KEY)
    _check_update(update, dim)
    norm = _norm_value(metrics[UPDATE_NORM], UPDATE_NORM) if UPDATE_NORM in metrics else float("nan")
    clean = None
    if diagnostics:
        if DIAGNOSTICS not in content:
            raise ValueError("diagnostics is on but the reply has no clean update")
        clean = _array(_record(content, DIAGNOSTICS, ArrayRecord), CLEAN_UPDATE_KEY)
        _check_clean(clean, dim, clip)
    return update.astype(np.float64), norm, clean


@dataclass
class BlockReply:
    """A virtual node's TRAIN reply, client by client (`parse_block_reply()`).

    Attributes
    ----------
    updates:
        Client id -> ``(g + zeta, ||u|| or NaN, clean g or None)`` of every well-formed update.
    rejected:
        Client id -> why its update was rejected (malformed, or missing from the reply).
    diverged:
        Clients whose local training diverged (NaN/Inf): they sent nothing, like a one-client
        node whose ClientApp fails.
    """

    updates: dict[int, tuple[Vector, float, Vector | None]] = field(default_factory=dict)
    rejected: dict[int, str] = field(default_factory=dict)
    diverged: list[int] = field(default_factory=list)


def _id_list(metrics: dict, key: str) -> list[int]:
    value = metrics.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"reply's {key!r} is not a list of integers")
    return list(value)


def parse_block_reply(
    content: RecordDict, client_ids: Sequence[int], dim: int, *, diagnostics: bool, clip: float
) -> BlockReply:
    """A virtual node's reply for its sampled ``client_ids``, checked client by client.

    Each client's update must pass the checks of `parse_train_reply()` (finite float vector of
    length ``dim``; with ``diagnostics`` a clean update of norm at most ``clip``); a client that fails
    them, or that the reply neither answers nor reports as diverged, is rejected alone. ``ValueError``
    when the reply as a whole cannot be read (records of the wrong type or unexpected ones, client lists
    that are not lists of integers, a client the node was not asked for, arrays that belong to no listed
    client, norms that are not numbers): then none of the node's clients counts.
    """
    _check_records(content, diagnostics)
    record = _record(content, ARRAYS, ArrayRecord)
    metrics = dict(_record(content, METRICS, MetricRecord))
    replied, diverged = _id_list(metrics, CLIENT_IDS), _id_list(metrics, DIVERGED_CLIENT_IDS)
    asked = set(int(c) for c in client_ids)
    listed = replied + diverged
    if len(set(listed)) != len(listed):
        raise ValueError("reply lists a client twice")
    if not set(listed) <= asked:
        raise ValueError(f"reply answers for clients it was not asked for: {sorted(set(listed) - asked)[:10]}")
    expected_keys = {block_key(UPDATE_KEY, c) for c in replied}
    if set(record) - expected_keys:
        extra = sorted(set(record) - expected_keys)
        raise ValueError(f"reply has arrays of no listed client: {', '.join(extra[:5])}")
    norms = metrics.get(UPDATE_NORMS)
    if norms is None:
        norms = [float("nan")] * len(replied)
    elif not isinstance(norms, list) or len(norms) != len(replied):
        raise ValueError(f"reply's {UPDATE_NORMS!r} does not have one value per client in {CLIENT_IDS!r}")
    else:
        norms = [_norm_value(v, UPDATE_NORMS) for v in norms]
    out = BlockReply(diverged=sorted(diverged))
    for client_id in sorted(asked - set(listed)):
        out.rejected[client_id] = f"client {client_id} is missing from its node's reply"
    clean_record = _record(content, DIAGNOSTICS, ArrayRecord) if diagnostics and DIAGNOSTICS in content else None
    for client_id, norm in zip(replied, norms, strict=True):
        try:
            update = _array(record, block_key(UPDATE_KEY, client_id))
            _check_update(update, dim)
            clean = None
            if diagnostics:
                if clean_record is None:
                    raise ValueError("diagnostics is on but the reply has no clean update")
                clean = _array(clean_record, block_key(CLEAN_UPDATE_KEY, client_id))
                _check_clean(clean, dim, clip)
        except ValueError as err:
            out.rejected[client_id] = f"client {client_id}: {err}"
            continue
        out.updates[client_id] = (update.astype(np.float64), float(norm), clean)
    return out
