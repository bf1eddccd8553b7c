"""The message schema shared by the ServerApp strategy and the ClientApp.

Flower glue only: how the global model, the round's instructions and a
client's reply are laid out in Flower records. Keys are kebab-case as in
Flower's examples.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from dpfedavg.core.types import RoundInstructions, Vector

__all__ = [
    "MODEL_KEY",
    "UPDATE_KEY",
    "CLEAN_UPDATE_KEY",
    "ARRAYS",
    "CONFIG",
    "METRICS",
    "DIAGNOSTICS",
    "RoundInstructions",
    "from_array_record",
    "instructions_from_config_record",
    "instructions_to_config_record",
    "to_array_record",
    "parse_train_reply",
    "NUM_EXAMPLES",
    "PARTITION_ID",
    "NUM_PARTITIONS",
    "UPDATE_NORM",
    "QUERY",
]

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


def to_array_record(vector: Vector, key: str = MODEL_KEY) -> ArrayRecord:
    """Wrap a flat vector as a one-array ArrayRecord."""
    return ArrayRecord({key: Array(np.ascontiguousarray(vector))})


def from_array_record(record: ArrayRecord, key: str = MODEL_KEY) -> Vector:
    """The flat vector stored under ``key``; ``KeyError`` if absent."""
    return record[key].numpy()


def instructions_to_config_record(ins: RoundInstructions) -> ConfigRecord:
    """The train config the server sends with ``w_k``."""
    return ConfigRecord(
        {
            "server-round": ins.server_round,
            "local-lr": ins.local_lr,
            "local-steps": ins.local_steps,
            "algorithm": ins.algorithm,
            "clip": ins.clip,
            "noise-std": ins.noise_std,
            "noise-seed": ins.noise_seed,
            "diagnostics": ins.diagnostics,
            "secagg-step": ins.secagg_step,
            "secagg-range": ins.secagg_range,
            "count-scale": ins.count_scale,
        }
    )


def instructions_from_config_record(record: ConfigRecord) -> RoundInstructions:
    """The inverse of :func:`instructions_to_config_record` (on the client)."""
    return RoundInstructions(
        server_round=int(record["server-round"]),
        local_lr=float(record["local-lr"]),
        local_steps=int(record["local-steps"]),
        algorithm=str(record["algorithm"]),
        clip=float(record["clip"]),
        noise_std=float(record["noise-std"]),
        noise_seed=int(record["noise-seed"]),
        diagnostics=bool(record["diagnostics"]),
        secagg_step=float(record.get("secagg-step", 0.0)),
        secagg_range=float(record.get("secagg-range", 0.0)),
        count_scale=float(record.get("count-scale", 0.0)),
    )


def parse_train_reply(
    content: RecordDict, dim: int, *, diagnostics: bool, clip: float
) -> tuple[Vector, float, Vector | None]:
    """A TRAIN reply's ``(g + zeta, ||u|| or NaN, clean g or None)``; ``ValueError`` naming what is malformed.

    Exactly one array, :data:`UPDATE_KEY`, a finite float vector of length ``dim``; a
    :data:`METRICS` record (``update-norm`` only in seeded mode). With ``diagnostics`` the clean
    update :data:`CLEAN_UPDATE_KEY` must be there, of length ``dim`` and norm at most ``clip`` (the
    bound every update has before noise).
    """
    try:
        record = content[ARRAYS]
        update = from_array_record(record, UPDATE_KEY)
        metrics = dict(content[METRICS])
    except KeyError as err:
        raise ValueError(f"reply lacks {err}") from None
    if len(record) != 1:
        raise ValueError(f"reply has {len(record)} arrays ({', '.join(sorted(record))}), expected 1 ({UPDATE_KEY!r})")
    if update.shape != (dim,):
        raise ValueError(f"update has shape {update.shape}, expected ({dim},)")
    if not np.issubdtype(update.dtype, np.floating):
        raise ValueError(f"update has dtype {update.dtype}, expected a float type")
    if not np.all(np.isfinite(update)):
        raise ValueError("update contains NaN or Inf")
    clean = None
    if diagnostics:
        try:
            clean = from_array_record(content[DIAGNOSTICS], CLEAN_UPDATE_KEY)
        except KeyError:
            raise ValueError("diagnostics is on but the reply has no clean update") from None
        if clean.shape != (dim,):
            raise ValueError(f"clean update has shape {clean.shape}, expected ({dim},)")
        clean_norm = float(np.linalg.norm(clean))
        if not clean_norm <= clip * (1 + 1e-9):  # also catches NaN
            raise ValueError(
                f"clean update has norm {clean_norm:.6g}, above C = {clip:g} (updates are bounded before noise)"
            )
    return update.astype(np.float64), float(metrics.get(UPDATE_NORM, np.nan)), clean
