"""Exact checkpoint/resume of a run's server state.

A DP run that dies at round 480 of 500 must continue, not restart: a restart would release a
second model from the same clients' data and spend the privacy budget twice. Every
``checkpoint-every`` rounds the server writes ``<run dir>/checkpoint.npz`` holding everything the
rest of the run depends on:

* ``w_k`` and the round ``k``; the sampling and (seeded) noise streams need nothing more, because
  every round's generator is derived from ``(seed, stream, round)`` (`dpfedavg.core.seeding`),
  so round ``k+1`` draws the same clients and noise whether or not the run was interrupted;
* the server's state, `ServerState` (the one definition of it: the server produces and
  consumes it, this module stores it field by field): the momentum buffer, the random iterate
  ``w_{k~}`` (Alg. 1 line 13) and its round, bit-exact (float64), the accountant's state (so epsilon
  continues from where it was, never from 0), the per-round statistics and, with ``adaptive-clip``,
  ``C_{k+1}`` (exact: JSON floats round-trip);
* the server-side evaluations and the trajectory so far.

The file is written to a temporary file in the same folder, flushed to disk and renamed over the
old one (`dpfedavg.io.atomic.atomic_open()`), so a crash or a failed write leaves the previous
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
from math import isfinite
from pathlib import Path
from typing import Any

import numpy as np

from dpfedavg.config import OPTIONS, ConfigError, RunConfig
from dpfedavg.core.dp import get_bound
from dpfedavg.io.atomic import atomic_open
from dpfedavg.io.metrics import RoundStats
from dpfedavg.io.results import complete_rows
from dpfedavg.privacy.accountants import RoundEvent
from dpfedavg.privacy.plan import PrivacyPlan

__all__ = [
    "CHECKPOINT_FILE",
    "Checkpoint",
    "CheckpointError",
    "ServerState",
    "check_compatible",
    "check_resumable",
    "load_checkpoint",
    "nominal_accountant_state",
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
#: Privacy keys added after checkpoints were first written, with the value a checkpoint without them ran with (any
#: other privacy key missing from a checkpoint is a difference: deleting one must not reset it to its default).
_ADDED_PRIVACY_KEYS: dict[str, Any] = {"sampling": "poisson"}


class CheckpointError(ConfigError):
    """No usable checkpoint, or one that does not belong to this run's settings."""


@dataclass
class ServerState:
    """The server's state after a round (`dpfedavg.server.DPServer.state()` / ``restore``).

    Array fields are stored bit-exact in the ``.npz``, the others in its JSON metadata.
    """

    momentum: np.ndarray
    random_iterate: np.ndarray | None
    random_round: int | None
    #: `dpfedavg.privacy.accountants.Accountant.state_dict()` (``None`` without DP).
    accountant: dict[str, Any] | None
    #: ``metrics.csv``'s training statistics by round (`dpfedavg.io.metrics.RoundStats` as dicts).
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
    #: The releases charged when it was written: ``round``, plus the rounds redone after earlier crashes with
    #: ``secure-noise`` (``dpfedavg.server.releases``). The accountant's history holds one event per release.
    releases: int | None = None

    def __post_init__(self) -> None:
        if self.releases is None:
            self.releases = self.round


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
    """JSON-safe: NaN/inf floats become strings (JSON has no NaN).

    A container's scalars are converted inline rather than by a call each: a checkpoint holds every round's
    statistics, so this runs over ``K x 20`` values each time one is written.
    """
    if isinstance(obj, dict):
        return {
            str(k): _encode(v)
            if isinstance(v, _CONTAINERS)
            else (repr(v) if isinstance(v, float) and not isfinite(v) else v)
            for k, v in obj.items()
        }
    if isinstance(obj, _CONTAINERS):
        return [
            _encode(v) if isinstance(v, _CONTAINERS) else (repr(v) if isinstance(v, float) and not isfinite(v) else v)
            for v in obj
        ]
    return repr(obj) if isinstance(obj, float) and not isfinite(obj) else obj


_CONTAINERS = (dict, list, tuple)


def _decode(obj: Any) -> Any:
    if obj in ("nan", "inf", "-inf"):
        return float(obj)
    if isinstance(obj, dict):
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


#: The ``.npz`` entry of a `ServerState` array field.
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
        "releases": ckpt.releases,
    }
    arrays["meta"] = np.array(json.dumps(_encode(meta), default=_json_default))
    with atomic_open(path, durable=True) as fh:
        np.savez(fh, **arrays)
    return path


class _Fields:
    """Reads a checkpoint's fields; every malformed one is a `CheckpointError` naming it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def error(self, field: str, detail: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {self.path} is unusable: field {field!r} {detail}")

    def get(self, mapping: Any, key: str, field: str) -> Any:
        if not isinstance(mapping, dict):
            raise self.error(field.rpartition(".")[0] or field, f"is a {type(mapping).__name__}, expected a mapping")
        if key not in mapping:
            raise self.error(field, "is missing")
        return mapping[key]

    def integer(self, value: Any, field: str, low: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise self.error(field, f"= {value!r}: expected an integer >= {low}")
        return value

    def number(self, value: Any, field: str, *, finite: bool = True) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or (finite and not math.isfinite(value)):
            raise self.error(field, f"= {value!r}: expected a finite number")
        return float(value)

    def mapping(self, value: Any, field: str) -> dict:
        if not isinstance(value, dict):
            raise self.error(field, f"is a {type(value).__name__}, expected a mapping")
        return value

    def vector(
        self, arrays: dict[str, np.ndarray], name: str, field: str, *, optional: bool = False
    ) -> np.ndarray | None:
        if name not in arrays:
            if optional:
                return None
            raise self.error(field, "is missing")
        value = arrays[name]
        if value.ndim != 1 or not np.issubdtype(value.dtype, np.floating):
            raise self.error(field, f"has shape {value.shape} and dtype {value.dtype}, expected a float vector")
        if not np.all(np.isfinite(value)):
            raise self.error(field, "holds NaN or Inf")
        return value

    def accountant(self, value: Any, field: str) -> dict[str, Any] | None:
        if value is None:
            return None
        state = self.mapping(value, field)
        if not isinstance(state.get("accountant"), str):
            raise self.error(f"{field}.accountant", f"= {state.get('accountant')!r}: expected an accountant's name")
        self.number(self.get(state, "delta", f"{field}.delta"), f"{field}.delta")
        history = self.get(state, "history", f"{field}.history")
        if not isinstance(history, list):
            raise self.error(f"{field}.history", f"is a {type(history).__name__}, expected a list of [q, z]")
        for i, event in enumerate(history):
            ok = isinstance(event, list) and len(event) == 2
            ok = ok and all(v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in event)
            if not ok or event[0] is None:
                raise self.error(f"{field}.history[{i}]", f"= {event!r}: expected [q, z] numbers (z may be null)")
        return state

    def history(self, value: Any, field: str) -> dict[int, dict[str, Any]]:
        rows: dict[int, dict[str, Any]] = {}
        for key, row in self.mapping(value, field).items():
            try:
                k = int(key)
                RoundStats(**self.mapping(row, f"{field}.{key}"))
            except (TypeError, ValueError) as err:
                raise self.error(f"{field}.{key}", f"is not a round's statistics ({err})") from None
            if row.get("round") != k:
                raise self.error(f"{field}.{key}", f"holds round {row.get('round')!r}")
            rows[k] = row
        return rows


def load_checkpoint(directory: Path) -> Checkpoint:
    """Read ``directory/checkpoint.npz``; one `CheckpointError` if absent, unreadable or malformed.

    Every field is checked for its type and range (the round an integer >= 1, the arrays finite float vectors,
    the per-round statistics the columns of ``metrics.csv``, the accountant's history ``[q, z]`` pairs, ...);
    the error names the first bad field. Whether the state fits the run is `check_compatible()`'s.
    """
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
    read = _Fields(path)
    meta = read.mapping(meta, "meta")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
    rounds = read.integer(read.get(meta, "round", "round"), "round", low=1)
    # absent in a checkpoint written before redone rounds were charged, when every release was a round
    releases = read.integer(meta.get("releases", rounds), "releases", low=rounds)
    server_meta = read.mapping(read.get(meta, "server", "server"), "server")
    random_round = server_meta.get("random_round")
    if random_round is not None:
        random_round = read.integer(random_round, "server.random_round")
    adaptive = server_meta.get("adaptive_clip")
    if adaptive is not None:
        adaptive = read.number(adaptive, "server.adaptive_clip")
    server = ServerState(
        momentum=read.vector(arrays, _SERVER_ARRAY.format("momentum"), "server.momentum"),  # type: ignore[arg-type]
        random_iterate=read.vector(
            arrays, _SERVER_ARRAY.format("random_iterate"), "server.random_iterate", optional=True
        ),
        random_round=random_round,
        accountant=read.accountant(server_meta.get("accountant"), "server.accountant"),
        history=read.history(read.get(server_meta, "history", "server.history"), "server.history"),
        adaptive_clip=adaptive,
    )
    mechanism = server_meta.get("mechanism")
    if mechanism is not None:
        mechanism = dict(read.mapping(mechanism, "server.mechanism"))
        prefix = _SERVER_ARRAY.format("mechanism/")
        for name, array in arrays.items():  # the noise mechanism's arrays, stored bit-exact as their own entries
            if name.startswith(prefix):
                mechanism[name.removeprefix(prefix)] = array
    server.mechanism = mechanism
    evaluated = {}
    for key, metrics in read.mapping(read.get(meta, "evaluated", "evaluated"), "evaluated").items():
        try:
            evaluated[int(key)] = {str(k): read.number(v, f"evaluated.{key}.{k}", finite=False)
                                   for k, v in read.mapping(metrics, f"evaluated.{key}").items()}  # fmt: skip
        except ValueError:
            raise read.error(f"evaluated.{key}", "is not a round number") from None
    trajectory = arrays.get("trajectory")
    if trajectory is not None and (trajectory.ndim != 2 or not np.all(np.isfinite(trajectory))):
        raise read.error("trajectory", f"has shape {trajectory.shape} or holds NaN/Inf, expected rounds x dim finite")
    return Checkpoint(
        round=rounds,
        w=read.vector(arrays, "w", "w"),  # type: ignore[arg-type]
        server=server,
        run_config=read.mapping(read.get(meta, "run_config", "run_config"), "run_config"),
        privacy=read.mapping(read.get(meta, "privacy", "privacy"), "privacy"),
        evaluated=evaluated,
        elapsed_s=read.number(read.get(meta, "elapsed_s", "elapsed_s"), "elapsed_s"),
        trajectory=trajectory,
        releases=releases,
    )


def nominal_accountant_state(plan: PrivacyPlan, rounds: int) -> dict[str, Any] | None:
    """The accountant's state after ``rounds`` rounds of the plan: every round charges ``(q, z)`` (both public).

    Every round a run completes is charged the nominal event whoever replied (the server tops up missing noise,
    `dpfedavg.core.mechanism`), so the plan and the round count alone determine the accountant.
    """
    if not plan.dp:
        return None
    accountant = plan.new_accountant()
    if rounds:
        accountant.step(RoundEvent(plan.q, plan.noise_multiplier), rounds)
    return accountant.state_dict()


def _state_errors(ckpt: Checkpoint, cfg: RunConfig, plan: PrivacyPlan, dim: int) -> list[str]:
    """Where the checkpoint's server state disagrees with what its round count and the run imply."""
    k, server, problems = ckpt.round, ckpt.server, []
    releases = ckpt.releases if ckpt.releases is not None else k
    expected = nominal_accountant_state(plan, releases)
    saved = server.accountant
    if expected is None:
        if saved is not None and saved.get("history"):
            problems.append("'server.accountant' holds privacy events but this run has no DP")
    elif saved is None or saved.get("accountant") != expected["accountant"] or saved.get("delta") != expected["delta"]:
        problems.append(
            f"'server.accountant' is {None if saved is None else {k_: saved.get(k_) for k_ in ('accountant', 'delta')}}"
            f", the run's is {expected['accountant']!r} at delta = {expected['delta']:g}"
        )
    elif saved["history"] != expected["history"]:
        got = saved["history"]
        first = next((i for i, (a, b) in enumerate(zip(got, expected["history"], strict=False)) if a != b), None)
        where = f"event {first} is {got[first]} instead of {expected['history'][first]}" if first is not None else ""
        problems.append(
            f"'server.accountant.history' has {len(got)} events, but {releases} releases ('releases'; {k} rounds "
            f"and {releases - k} redone) of (q, z) = ({plan.q:.6g}, {plan.noise_multiplier:.6g}) make {releases} "
            f"identical ones{'; ' + where if where else ''} (an edited history would lower the reported epsilon)"
        )
    if set(server.history) != set(range(1, k + 1)):
        problems.append(f"'server.history' holds rounds {sorted(server.history)[:3]}... but 'round' = {k}")
    for name, vector in (
        ("w", ckpt.w),
        ("server.momentum", server.momentum),
        ("server.random_iterate", server.random_iterate),
    ):
        if vector is not None and vector.shape != (dim,):
            problems.append(f"{name!r} has length {vector.shape[0]}, the model {dim}")
    if (server.random_iterate is None) != (server.random_round is None) or (
        server.random_round is not None and not 0 <= server.random_round < k
    ):
        problems.append(
            f"'server.random_round' = {server.random_round!r} is not a round in 0..{k - 1} with its iterate"
        )
    if get_bound(cfg.algorithm).adaptive:
        low, high = cfg.clip_limits
        c = server.adaptive_clip
        if c is None or not low <= c <= high:
            problems.append(f"'server.adaptive_clip' = {c!r} is outside [{low:g}, {high:g}] (clip / clip-range-factor)")
    elif server.adaptive_clip is not None:
        problems.append(f"'server.adaptive_clip' = {server.adaptive_clip!r} but algorithm {cfg.algorithm!r} has no C_k")
    if ckpt.trajectory is not None and ckpt.trajectory.shape != (k + 1, dim):
        problems.append(f"'trajectory' has shape {ckpt.trajectory.shape}, expected ({k + 1}, {dim}) (rounds 0..{k})")
    if cfg.save_trajectory and ckpt.trajectory is None:
        problems.append("'trajectory' is missing but save-trajectory = true")
    return problems


def check_resumable(directory: Path, ckpt: Checkpoint, columns: tuple[str, ...], num_rounds: int) -> int:
    """``directory``'s metrics.csv must hold the rows of rounds 0..k (the checkpoint's round); a finished run has
    nothing to do (`CheckpointError` otherwise).

    Returns the number of rows after round k (rounds that ran after the checkpoint, to be redone).
    """
    path = directory / "metrics.csv"
    rows = complete_rows(path) if path.exists() else []
    rounds = [int(float(row[0])) for row in rows[1:]] if rows and tuple(rows[0]) == columns else []
    if rounds[: ckpt.round + 1] != list(range(ckpt.round + 1)):
        have = f"rounds {rounds[0]}..{rounds[-1]}" if rounds else "no rows of this run's columns"
        raise CheckpointError(
            f"cannot resume: the checkpoint's 'round' = {ckpt.round} disagrees with {path}, which holds {have}: "
            f"rounds 0..{ckpt.round} must all be there (a checkpoint is written after its round's row)"
        )
    if ckpt.round == num_rounds:
        config = directory / "config.json"
        try:
            finished = "final" in json.loads(config.read_text())
        except (OSError, ValueError):
            finished = False
        if finished:
            raise CheckpointError(
                f"cannot resume from the checkpoint: it is after round {ckpt.round}, num-rounds = "
                f"{num_rounds} and {config} holds the finished run: nothing to do"
            )
    return len(rounds) - (ckpt.round + 1)


def check_compatible(ckpt: Checkpoint, cfg: RunConfig, plan: PrivacyPlan, dim: int) -> None:
    """Refuse to resume ``ckpt`` under settings that would not continue the same run, or with state they do not imply.

    Raises one `CheckpointError` naming every differing setting and every field of the server's state
    that disagrees with its round count and the privacy plan: above all the accountant's history, which must be
    ``releases`` copies of the plan's public ``(q, z)`` (``round``, plus the rounds redone after earlier crashes
    with ``secure-noise``; an edited history would lower the reported epsilon).
    """
    problems: list[str] = []
    saved_privacy = ckpt.privacy
    for key, value in privacy_signature(cfg, plan).items():
        old = saved_privacy.get(key, _ADDED_PRIVACY_KEYS.get(key))  # added since the checkpoint: the old behaviour
        same = (
            old == value
            if not isinstance(value, float)
            else (isinstance(old, int | float) and math.isclose(float(old), value, rel_tol=1e-12, abs_tol=0.0))
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
    if ckpt.round > cfg.num_rounds:
        problems.append(f"the checkpoint is after round {ckpt.round}, and num-rounds = {cfg.num_rounds}")
    if not problems:
        problems = _state_errors(ckpt, cfg, plan, dim)
    if problems:
        raise CheckpointError(
            "cannot resume from the checkpoint: " + "; ".join(problems) + ". Resume with the interrupted run's "
            "settings, or start a new run (a new run spends a new privacy budget on the same clients)"
        )
