"""Exact checkpoint/resume of a run's server state.

A DP run that dies at round 480 of 500 must continue, not restart: a restart
would release a second model from the same clients' data and spend the
privacy budget twice. Every ``checkpoint-every`` rounds the server writes
``<run dir>/checkpoint.npz`` holding everything the rest of the run depends
on:

* ``w_k``, the momentum buffer ``m_k`` and the random iterate ``w_{k~}``
  (Alg. 1 line 13) with its round, bit-exact (float64);
* the round ``k``; the sampling and (seeded) noise streams need nothing more,
  because every round's generator is derived from ``(seed, stream, round)``
  (:mod:`dpfedavg.core.seeding`), so round ``k+1`` draws the same clients and
  noise whether or not the run was interrupted;
* the accountant's history (one ``(q, z_k)`` per round, with the noise the
  round actually carried), so epsilon continues from where it was, never from 0;
* the per-round statistics, server-side evaluations and the trajectory so far;
* with ``adaptive-clip``, the next round's clipping threshold ``C_{k+1}`` (exact: JSON floats round-trip).

The file is written to a temporary file in the same folder, flushed to disk
and renamed over the old one (``os.replace`` is atomic), so a crash or a
failed write leaves the previous checkpoint intact and readable.

``resume=true`` refuses a checkpoint whose privacy-relevant settings (the
algorithm, C, z, q, delta, the accountant, the noise placement) differ from the
run's, and one whose trajectory-defining settings (task, seed, learning rates,
E, momentum, ...) differ: either would not be the same run continued.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpfedavg.config import OPTIONS, ConfigError, RunConfig
from dpfedavg.privacy.accounting import PrivacyPlan, RoundEvent

__all__ = [
    "CHECKPOINT_FILE",
    "Checkpoint",
    "CheckpointError",
    "check_compatible",
    "load_checkpoint",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.npz"
FORMAT_VERSION = 1

#: run_config keys that define the trajectory (``Option.trajectory``): a resume that changes one is refused.
TRAJECTORY_KEYS: tuple[str, ...] = tuple(opt.key for opt in OPTIONS if opt.trajectory)


class CheckpointError(ConfigError):
    """No usable checkpoint, or one that does not belong to this run's settings."""


@dataclass
class Checkpoint:
    """The server state after ``round`` (1-based; 0 means before round 1)."""

    round: int
    w: np.ndarray
    momentum: np.ndarray
    random_iterate: np.ndarray | None
    random_round: int | None
    run_config: dict[str, Any]
    privacy: dict[str, Any]
    accountant_history: list[tuple[float, float | None]]
    history: dict[int, dict[str, Any]]
    evaluated: dict[int, dict[str, float]]
    elapsed_s: float = 0.0
    trajectory: np.ndarray | None = None
    #: ``adaptive-clip``: ``C_{k+1}``, the threshold of the round after ``round``.
    adaptive_clip: float | None = None

    def accountant_events(self) -> list[RoundEvent]:
        return [RoundEvent(q, z) for q, z in self.accountant_history]


#: run_config keys the privacy guarantee depends on (``Option.privacy``): a resume that changes one is refused.
PRIVACY_KEYS: tuple[str, ...] = tuple(opt.key for opt in OPTIONS if opt.privacy)


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


def _write_npz(fh: Any, arrays: dict[str, np.ndarray]) -> None:
    np.savez(fh, **arrays)


def save_checkpoint(directory: Path, ckpt: Checkpoint) -> Path:
    """Write ``ckpt`` to ``directory/checkpoint.npz`` atomically (temp file, fsync, rename).

    Raises ``OSError`` (or whatever the write raised) with the previous checkpoint untouched.
    """
    directory = Path(directory)
    path = directory / CHECKPOINT_FILE
    meta = {
        "format_version": FORMAT_VERSION,
        "round": ckpt.round,
        "random_round": ckpt.random_round,
        "run_config": ckpt.run_config,
        "privacy": ckpt.privacy,
        "accountant_history": [list(e) for e in ckpt.accountant_history],
        "history": ckpt.history,
        "evaluated": ckpt.evaluated,
        "elapsed_s": ckpt.elapsed_s,
        "adaptive_clip": ckpt.adaptive_clip,
    }
    arrays: dict[str, np.ndarray] = {
        "meta": np.array(json.dumps(_encode(meta), default=_json_default)),
        "w": np.asarray(ckpt.w, dtype=np.float64),
        "momentum": np.asarray(ckpt.momentum, dtype=np.float64),
    }
    if ckpt.random_iterate is not None:
        arrays["random_iterate"] = np.asarray(ckpt.random_iterate, dtype=np.float64)
    if ckpt.trajectory is not None:
        arrays["trajectory"] = np.asarray(ckpt.trajectory)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{CHECKPOINT_FILE}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            _write_npz(fh, arrays)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:  # pragma: no cover - some filesystems cannot fsync a directory
        pass
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
            w, momentum = data["w"].copy(), data["momentum"].copy()
            random_iterate = data["random_iterate"].copy() if "random_iterate" in data else None
            trajectory = data["trajectory"].copy() if "trajectory" in data else None
    except Exception as err:  # noqa: BLE001 - any failure to read means the file is unusable
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(err).__name__}: {err})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
    return Checkpoint(
        round=int(meta["round"]),
        w=w,
        momentum=momentum,
        random_iterate=random_iterate,
        random_round=meta["random_round"],
        run_config=meta["run_config"],
        privacy=meta["privacy"],
        accountant_history=[(float(q), None if z is None else float(z)) for q, z in meta["accountant_history"]],
        history={int(k): v for k, v in meta["history"].items()},
        evaluated={int(k): v for k, v in meta["evaluated"].items()},
        elapsed_s=float(meta["elapsed_s"]),
        trajectory=trajectory,
        adaptive_clip=None if meta.get("adaptive_clip") is None else float(meta["adaptive_clip"]),
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
