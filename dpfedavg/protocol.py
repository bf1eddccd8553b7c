"""The message schema shared by the ServerApp strategy and the ClientApp.

Flower glue only: how the global model, the round's instructions and a
client's reply are laid out in Flower records. Keys are kebab-case as in
Flower's examples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord

from dpfedavg.core.types import Vector

__all__ = [
    "MODEL_KEY",
    "UPDATE_KEY",
    "CLEAN_UPDATE_KEY",
    "ARRAYS",
    "CONFIG",
    "METRICS",
    "DIAGNOSTICS",
    "RoundInstructions",
    "to_array_record",
    "from_array_record",
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


@dataclass(frozen=True)
class RoundInstructions:
    """What the server tells each sampled client in round ``k`` (the train config).

    ``noise_std`` is the per-client noise std ``z C / sqrt(r)`` (Alg. 1 line 10)
    and ``noise_seed`` seeds the client's noise generator together with its
    client id.
    """

    server_round: int
    local_lr: float
    local_steps: int
    algorithm: str
    clip: float
    noise_std: float
    noise_seed: int
    diagnostics: bool

    def to_config_record(self) -> ConfigRecord:
        return ConfigRecord(
            {
                "server-round": self.server_round,
                "local-lr": self.local_lr,
                "local-steps": self.local_steps,
                "algorithm": self.algorithm,
                "clip": self.clip,
                "noise-std": self.noise_std,
                "noise-seed": self.noise_seed,
                "diagnostics": self.diagnostics,
            }
        )

    @classmethod
    def from_config_record(cls, record: ConfigRecord) -> RoundInstructions:
        return cls(
            server_round=int(record["server-round"]),
            local_lr=float(record["local-lr"]),
            local_steps=int(record["local-steps"]),
            algorithm=str(record["algorithm"]),
            clip=float(record["clip"]),
            noise_std=float(record["noise-std"]),
            noise_seed=int(record["noise-seed"]),
            diagnostics=bool(record["diagnostics"]),
        )
