"""The message schema shared by the ServerApp strategy and the ClientApp.

Flower glue only: how the global model, the round's instructions and a
client's reply are laid out in Flower records. Keys are kebab-case as in
Flower's examples.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord

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
    )
