"""Shared type aliases for the core math."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

#: A flat parameter vector ``w in R^d`` (the model is always handled flattened).
Vector = npt.NDArray[np.floating]

#: ``grad_fn(w) -> grad f_i(w)``: a client's full-batch gradient.
GradFn = Callable[[Vector], Vector]
#: ``(w_k, eta_k, E) -> u`` of shape ``(B, dim)``: a task's exact closed form of ``client_update`` for B clients.
BatchUpdateFn = Callable[[Vector, float, int], np.ndarray]
#: ``(W_k, eta_k, E) -> u`` of shape ``(R, B, dim)``: the same for ``R`` runs at once, ``W_k`` of shape ``(R, dim)``
#: and ``eta_k`` of shape ``(R,)`` (a task's ``client_runs_update_fn(client_ids)``; see `dpfedavg.core.runs`).
RunsUpdateFn = Callable[[np.ndarray, np.ndarray, int], np.ndarray]


@dataclass(frozen=True)
class RoundInstructions:
    """What the server tells each sampled client in round ``k`` (the train config).

    ``noise_std`` is the per-client noise std (``z C / sqrt(r)`` for
    ``client`` placement, Alg. 1 line 10) and ``noise_seed`` seeds the client's
    noise generator together with its client id. With secure aggregation the
    client encodes ``g + zeta`` on the grid ``(secagg_step, secagg_range)``.
    """

    server_round: int
    local_lr: float
    local_steps: int
    algorithm: str
    clip: float
    noise_std: float
    noise_seed: int
    diagnostics: bool
    #: Secure aggregation: the round's grid step ``Delta`` and range ``c`` (see ``core.secagg``); 0 = off.
    secagg_step: float = 0.0
    secagg_range: float = 0.0
    #: ``adaptive-clip``: the scale ``s`` of the extra coordinate ``s (1[||u|| <= C] - 1/2)`` (see
    #: ``core.adaptive_clip``); 0 for the other algorithms.
    count_scale: float = 0.0
    #: The public parameters a client computes its own noise share from (`dpfedavg.privacy.policy`): the
    #: round's noise multiplier ``z`` (0 without DP) and the number of sampled clients ``|S_k|``.
    noise_multiplier: float = 0.0
    cohort_size: int = 0

    def to_config(self) -> dict[str, int | float | str | bool]:
        """The train config the server sends with ``w_k`` (kebab-case keys, as in Flower's examples)."""
        return {key: getattr(self, name) for key, name in _CONFIG_KEYS.items()}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RoundInstructions:
        """The inverse of `to_config()` (on the client), read strictly.

        Every value must have the type the server writes: integers for the round, ``E``, the seed and ``|S_k|``,
        finite numbers for the floats (a string such as ``'nan'`` or ``'1e-400'`` is refused, not converted), a
        bool for ``diagnostics`` (the string ``'false'`` would be true). ``KeyError`` for a missing key,
        ``ValueError`` naming a mistyped one. The secure-aggregation grid, the count scale, ``z`` and ``|S_k|``
        default to 0 (a server without them).
        """
        values = {}
        for key, name in _CONFIG_KEYS.items():
            value = config.get(key, 0) if name in _OPTIONAL else config[key]
            kind = cls.__dataclass_fields__[name].type
            if kind == "bool" and not isinstance(value, bool):
                raise ValueError(f"{key!r} = {value!r} is not a bool")
            if kind == "str" and not isinstance(value, str):
                raise ValueError(f"{key!r} = {value!r} is not a string")
            if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{key!r} = {value!r} is not an integer")
            if kind == "float":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(f"{key!r} = {value!r} is not a finite number")
                value = float(value)
            values[name] = value
        return cls(**values)


#: `RoundInstructions`' train-config keys (field name -> key: snake_case to kebab-case, ``server-round`` first).
_CONFIG_KEYS = {name.replace("_", "-"): name for name in RoundInstructions.__dataclass_fields__}
#: Fields a train config may leave out (read as 0).
_OPTIONAL = frozenset({"secagg_step", "secagg_range", "count_scale", "noise_multiplier", "cohort_size"})


class ClientResult(NamedTuple):
    """One client's contribution to a round, as the server uses it."""

    client_id: int
    noisy: Vector  # g + zeta
    update_norm: float  # ||u|| before clipping / normalization
    clean: Vector | None  # g, only with diagnostics
