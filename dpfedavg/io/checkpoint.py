"""Exact checkpoint/resume of a run's server state.

A DP run that dies at round 480 of 500 must continue, not restart: a restart would release a
second model from the same clients' data and spend the privacy budget twice. Every
``checkpoint-every`` rounds the server writes ``<run dir>/checkpoint.npz`` holding everything the
rest of the run depends on:

* ``w_k`` and the round ``k``; the sampling and (seeded) noise streams need nothing more, because
  every round's generator is derived from ``(seed, stream, round)`` (:mod:`dpfedavg.core.seeding`),
  so round ``k+1`` draws the same clients and noise whether or not the run was interrupted;
* the server's state, :class:`ServerState` (the one definition of it: the server produces and
  consumes it, this module stores it field by field): the momentum buffer, the random iterate
  ``w_{k~}`` (Alg. 1 line 13) and its round, bit-exact (float64), the accountant's state (so epsilon
  continues from where it was, never from 0), the per-round statistics and, with ``adaptive-clip``,
  ``C_{k+1}`` (exact: JSON floats round-trip);
* the server-side evaluations and the trajectory so far.

The file is written to a temporary file in the same folder, flushed to disk and renamed over the
old one (:func:`dpfedavg.io.atomic.atomic_open`), so a crash or a failed write leaves the previous
checkpoint intact and readable.

``resume=true`` refuses a checkpoint whose privacy-relevant settings (the ``Option(privacy=True)``
keys and the plan's ``z`` and ``q``) differ from the run's, and one whose trajectory-defining
settings (``Option(trajectory=True)``: task, seed, learning rates, E, momentum, ...) differ: either
would not be the same run continued.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from dpfedavg.config import OPTIONS, ConfigError, RunConfig
from dpfedavg.io.atomic import atomic_open
from dpfedavg.privacy.plan import PrivacyPlan

__all__ = [
    "CHECKPOINT_FILE",
    "Checkpoint",
    "CheckpointError",
    "ServerState",
    "check_compatible",
    "load_checkpoint",
    "privacy_signature",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.npz"
FORMAT_VERSION = 2

#: run_config keys that define the trajectory (``Option.trajectory``): a resume that changes one is refused.
TRAJECTORY_KEYS: tuple[str, ...] = tuple(opt.key for opt in OPTIONS if opt.trajectory)
#: run_config keys the privacy guarantee depends on (``Option.privacy``): a resume that changes one is refused.
PRIVACY_KEYS: tuple[str, ...] = tuple(opt.key for opt in OPTIONS if opt.privacy)


class CheckpointError(ConfigError):
    """No usable checkpoint, or one that does not belong to this run's settings."""


@dataclass
class ServerState:
    """The server's state after a round (:meth:`dpfedavg.server.DPServer.state` / ``restore``).

    Array fields are stored bit-exact in the ``.npz``, the others in its JSON metadata.
    """

    momentum: np.ndarray
    random_iterate: np.ndarray | None
    random_round: int | None
    #: :meth:`dpfedavg.privacy.accountants.Accountant.state_dict` (``None`` without DP).
    accountant: dict[str, Any] | None
    #: ``metrics.csv``'s training statistics by round (:class:`dpfedavg.io.metrics.RoundStats` as dicts).
    history: dict[int, dict[str, Any]]
    #: ``adaptive-clip``: ``C_{k+1}``, the threshold of the next round.
    adaptive_clip: float | None = None
    #: The noise mechanism's state (``banded-mf``: the noise buffer and the participation history; its arrays
    #: are stored bit-exact); ``None`` for a mechanism without state.
    mechanism: dict[str, Any] | None = None


@dataclass
class Checkpoint:
    """A run after ``round`` (1-based; 0 means before round 1)."""

    round: int
    w: np.ndarray
    server: ServerState
    run_config: dict[str, Any]
    privacy: dict[str, Any]
    evaluated: dict[int, dict[str, float]]
    elapsed_s: float = 0.0
    trajectory: np.ndarray | None = None


def privacy_signature(cfg: RunConfig, plan: PrivacyPlan) -> dict[str, Any]:
    """The settings the privacy guarantee depends on (``Option.privacy`` keys, and the plan's ``z`` and ``q``).

    A resume must not change any of them.
    """
    now = cfg.to_run_config()
    return {
        **{key: now[key] for key in PRIVACY_KEYS},
        "noise multiplier (z)": plan.noise_multiplier,
        "sampling rate (q = r/n)": plan.q,
    }


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _encode(obj: Any) -> Any:
    """JSON-safe: NaN/inf floats become strings (JSON has no NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    if isinstance(obj, dict):
        return {str(k): _encode(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_encode(v) for v in obj]
    return obj


def _decode(obj: Any) -> Any:
    if obj in ("nan", "inf", "-inf"):
        return float(obj)
    if isinstance(obj, dict):
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


#: The ``.npz`` entry of a :class:`ServerState` array field.
_SERVER_ARRAY = "server.{}"


def save_checkpoint(directory: Path, ckpt: Checkpoint) -> Path:
    """Write ``ckpt`` to ``directory/checkpoint.npz`` atomically (temp file, fsync, rename).

    Raises ``OSError`` (or whatever the write raised) with the previous checkpoint untouched.
    """
    path = Path(directory) / CHECKPOINT_FILE
    arrays: dict[str, np.ndarray] = {"w": np.asarray(ckpt.w, dtype=np.float64)}
    server_meta: dict[str, Any] = {}
    for f in fields(ServerState):
        value = getattr(ckpt.server, f.name)
        if isinstance(value, np.ndarray):
            arrays[_SERVER_ARRAY.format(f.name)] = np.asarray(value, dtype=np.float64)
        elif isinstance(value, dict) and any(isinstance(v, np.ndarray) for v in value.values()):
            # a state with arrays (the noise mechanism's): each array its own entry, the rest in the metadata
            for key, item in value.items():
                if isinstance(item, np.ndarray):
                    arrays[_SERVER_ARRAY.format(f"{f.name}/{key}")] = item
            server_meta[f.name] = {k: v for k, v in value.items() if not isinstance(v, np.ndarray)}
        else:
            server_meta[f.name] = value
    if ckpt.trajectory is not None:
        arrays["trajectory"] = np.asarray(ckpt.trajectory)
    meta = {
        "format_version": FORMAT_VERSION,
        "round": ckpt.round,
        "server": server_meta,
        "run_config": ckpt.run_config,
        "privacy": ckpt.privacy,
        "evaluated": ckpt.evaluated,
        "elapsed_s": ckpt.elapsed_s,
    }
    arrays["meta"] = np.array(json.dumps(_encode(meta), default=_json_default))
    with atomic_open(path, durable=True) as fh:
        np.savez(fh, **arrays)
    return path


def load_checkpoint(directory: Path) -> Checkpoint:
    """Read ``directory/checkpoint.npz``; :class:`CheckpointError` if absent or unreadable."""
    path = Path(directory) / CHECKPOINT_FILE
    if not path.exists():
        raise CheckpointError(
            f"resume=true but there is no checkpoint at {path}; resume needs the same output-dir and run-name "
            "as the interrupted run, and checkpoint-every > 0 in it"
        )
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = _decode(json.loads(str(data["meta"])))
            arrays = {name: data[name].copy() for name in data.files if name != "meta"}
    except Exception as err:  # noqa: BLE001 - any failure to read means the file is unusable
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(err).__name__}: {err})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
    server_meta = meta["server"]
    server = ServerState(
        **{f.name: arrays.get(_SERVER_ARRAY.format(f.name), server_meta.get(f.name)) for f in fields(ServerState)}
    )
    for name, array in arrays.items():  # the arrays of a dict-valued field (the noise mechanism's state)
        field_name, _, key = name.removeprefix(_SERVER_ARRAY.format("")).partition("/")
        if name.startswith(_SERVER_ARRAY.format("")) and key and isinstance(getattr(server, field_name, None), dict):
            getattr(server, field_name)[key] = array
    server.history = {int(k): v for k, v in server.history.items()}
    return Checkpoint(
        round=int(meta["round"]),
        w=arrays["w"],
        server=server,
        run_config=meta["run_config"],
        privacy=meta["privacy"],
        evaluated={int(k): v for k, v in meta["evaluated"].items()},
        elapsed_s=float(meta["elapsed_s"]),
        trajectory=arrays.get("trajectory"),
    )


def check_compatible(ckpt: Checkpoint, cfg: RunConfig, plan: PrivacyPlan, dim: int) -> None:
    """Refuse to resume ``ckpt`` under settings that would not continue the same run.

    Raises :class:`CheckpointError` naming every differing setting.
    """
    problems: list[str] = []
    saved_privacy = ckpt.privacy
    for key, value in privacy_signature(cfg, plan).items():
        old = saved_privacy.get(key)
        same = (
            old == value
            if not isinstance(value, float)
            else (old is not None and math.isclose(float(old), value, rel_tol=1e-12, abs_tol=0.0))
        )
        if not same:
            problems.append(f"{key}: {old!r} in the checkpoint, {value!r} now (privacy-relevant)")
    now = cfg.to_run_config()
    defaults = {opt.key: opt.default for opt in OPTIONS}
    for key in TRAJECTORY_KEYS:
        old = ckpt.run_config.get(key, defaults[key])  # a key added since the checkpoint: its default
        if old != now.get(key):
            problems.append(f"{key!r}: {old!r} in the checkpoint, {now.get(key)!r} now")
    if ckpt.w.shape != (dim,):
        problems.append(f"model dimension: {ckpt.w.shape[0]} in the checkpoint, {dim} now")
    if ckpt.round >= cfg.num_rounds:
        problems.append(f"the checkpoint is after round {ckpt.round}, and num-rounds = {cfg.num_rounds}: nothing to do")
    if problems:
        raise CheckpointError(
            "cannot resume from the checkpoint: " + "; ".join(problems) + ". Resume with the interrupted run's "
            "settings, or start a new run (a new run spends a new privacy budget on the same clients)"
        )
