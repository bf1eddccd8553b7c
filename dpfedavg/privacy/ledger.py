"""The node's privacy ledger: every release a SuperNode made, composed into one budget across runs and restarts.

A SuperNode with a privacy policy (any policy key in its ``--node-config``) or an explicit ``privacy-ledger`` keeps
one JSON file (``ledger_path``) listing every update it released: run id, round, message type, mechanism,
``z``, ``q``, ``C``, the placement, its own noise std, the time (``Release``). Before an update leaves the node,
``record_release`` composes the ledger with the new release in two accounts
(`dpfedavg.privacy.node_accounts`: against the server itself, ``max-epsilon``; against those who see the released
model, ``max-epsilon-released``) and either appends it (write-ahead: the entry is on disk, fsynced, before the
reply is built) or refuses the round when an account would pass its budget (a
``dpfedavg.privacy.policy.RoundRefused`` carrying the ledger's numbers).

The server account charges every release at the node's own noise share, unamplified (``server_charge``). What the
released account charges (``charged_events``; the node cannot see the server's Poisson sampling, only what it is
asked):

* a client with a run config (the project's ClientApp), the first time it answers a run: the run's own mechanism
  as the run accounts it (``node_accounts.released_plan``: ``num-rounds`` x ``PoissonSampled(q, Gaussian(z))``,
  Alg. 1's one sampled round per ``k``; banded MF's event; virtual clients' group); later rounds of the run cost
  nothing more. A resume (``resume = true``, a new Flower run id) of a run charged under the same ``run-name`` and
  plan is that run (`_plan`);
* every further release of a ``(run, round)`` it already answered (a round redone after a crash, fresh noise):
  one more round of the plan (banded MF refuses it, and any participation its event does not cover);
* a client without a run config (``dp_mod`` in a user's own app: no ``q``, no ``K``): every release one
  unamplified ``Gaussian(z)``.

The charged events compose, in the order they were charged and each ``(event, count)`` as one self-composed
privacy loss distribution, with the project's PLD (``dpfedavg.privacy.accountants``: its discretization, a
pessimistic and so valid upper bound); the server account is one Gaussian, read exactly. Both are read at the
node's delta (``ledger_delta``: the operator's, never a run's).

The file (format ``/2``) is JSON Lines: a header line, then one line per release carrying a SHA-256 chained
over every entry before it. A release is *appended* (``O_APPEND``, fsync) under an ``fcntl`` lock on a sidecar
file, so concurrent ClientApp processes of one node cannot lose an entry; a file that does not parse, or whose
chain does not match its entries, is a ``LedgerError``, never an empty ledger. Format ``/1`` files (one JSON
object, rewritten per release) are read and converted to ``/2`` on their next release.

**Incremental composition.** Re-reading and re-composing the whole file per release grows with the node's history
(issue 46: 1.4 s per release at 200 runs). ``<file>.state`` (SQLite, a cache) keeps the running composition (the
composed PLD of every charged event), the rounds answered per plan, and where in the file (entries, bytes, chain
head, the file's size, mtime and inode) it was taken. A release then costs one composition with the running PLD
(a new plan or a redone round) or none. The state is trusted only while the file is exactly as its last writer
left it; otherwise the file is read and its chain checked in full, the state is brought up to date from the
entries it lacks, or rebuilt from the file (``LedgerError`` if the file lost entries the state had seen).

Pure Python over the node config, ``dpfedavg.core.types.RoundInstructions`` and
``dpfedavg.config.RunConfig``; no Flower import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import os
import sqlite3
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from dpfedavg.config import RunConfig
from dpfedavg.core.check_in import CHECK_IN
from dpfedavg.core.dp import is_private_algorithm
from dpfedavg.core.types import RoundInstructions
from dpfedavg.io.atomic import atomic_write_bytes
from dpfedavg.privacy.accountants import AccountingRangeError, RoundEvent, _run_pld
from dpfedavg.privacy.node_accounts import (
    RELEASED,
    SERVER,
    check_participation,
    gaussian_epsilon,
    released_plan,
    server_mu2,
)
from dpfedavg.privacy.policy import NODE_IDENTITY_KEYS, NodePolicy, PolicyError, RoundRefused, noise_bound

__all__ = [
    "DEFAULT_DELTA",
    "LEDGER_FORMAT",
    "LedgerError",
    "NodeLedger",
    "Release",
    "charged_events",
    "ledger_delta",
    "ledger_path",
    "record_release",
]

logger = logging.getLogger(__name__)

#: The ``format`` of a ledger file's header line (JSON Lines, appended).
LEDGER_FORMAT = "dpfedavg-node-privacy-ledger/2"
#: The format of older ledgers (one JSON object with a checksum, rewritten per release): read, converted on append.
LEDGER_FORMAT_V1 = "dpfedavg-node-privacy-ledger/1"
#: The delta the node's budget is read at without ``max-epsilon-delta`` (``ledger_delta``): the run config's
#: default ``delta``.
DEFAULT_DELTA = 1e-6
#: The accountant that composes the ledger (tight; its PLDs are pessimistic, so a valid upper bound).
LEDGER_ACCOUNTANT = "pld"
#: The chain's value before the first entry.
_GENESIS = hashlib.sha256(LEDGER_FORMAT.encode()).hexdigest()
#: Mechanism names of the entries.
POISSON_GAUSSIAN = "poisson-sampled-gaussian"
GAUSSIAN = "gaussian"
BANDED_MF = "banded-mf"
#: The entry fields added within format ``/2`` and their defaults (an entry without them has these values).
_OPTIONAL: dict[str, Any] = {
    "run_name": None, "resume": False, "plan": None, "clients": 1, "server_noise_multiplier": None,
    "secure_aggregation": False, "participation": None, "check_in": False,
}  # fmt: skip


class LedgerError(PolicyError):
    """The ledger file cannot be read or written (corrupt, hand-edited, a full disk): nothing is sent."""


@dataclass(frozen=True)
class Release:
    """One release the node made (one entry of the ledger).

    Attributes
    ----------
    run_id, server_round, message_type:
        The run (Flower's run id), the round ``k`` and the message type it answered.
    mechanism:
        ``poisson-sampled-gaussian`` (a client with a run config) or ``gaussian`` (``dp_mod``: no ``q``).
    noise_multiplier:
        The round's ``z`` (the released sum's noise std over ``C``; 0 without DP).
    sampling_rate, num_rounds, delta:
        The run's ``q = r/n``, ``K`` and delta; ``None`` without a run config.
    clip:
        The round's ``C`` (``C_k`` with adaptive clipping).
    placement:
        The run's ``noise-placement`` (``None`` without a run config).
    noise_std:
        The std of the noise this node itself added to its update.
    time:
        When the entry was written (UTC, ISO 8601).
    """

    run_id: int
    server_round: int
    message_type: str
    mechanism: str
    noise_multiplier: float
    sampling_rate: float | None
    num_rounds: int | None
    delta: float | None
    clip: float
    placement: str | None
    noise_std: float
    time: str
    run_name: str | None = None
    resume: bool = False
    plan: tuple[float, float, int] | None = None
    clients: int = 1
    server_noise_multiplier: float | None = None
    secure_aggregation: bool = False
    participation: tuple[str, int, int] | None = None
    check_in: bool = False

    def to_json(self) -> dict[str, Any]:
        """The entry's JSON: the fields added after format ``/2`` began only where they differ from their default
        (so an entry written before them reads, and chains, as it was written)."""
        entry = dataclasses.asdict(self)
        for name in _OPTIONAL:
            if entry[name] == _OPTIONAL[name]:
                del entry[name]
        for name in ("plan", "participation"):
            if entry.get(name) is not None:
                entry[name] = list(entry[name])
        return entry

    @classmethod
    def from_json(cls, entry: Any, where: str) -> Release:
        """One entry, with every field checked (``LedgerError`` naming the entry and the field)."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(entry, dict) or not names - set(_OPTIONAL) <= set(entry) <= names:
            raise LedgerError(f"{where} is not a ledger entry (expected the fields of {cls.__name__})")
        entry = {**_OPTIONAL, **entry}
        checks = {
            "run_id": lambda v: _is_int(v),
            "server_round": lambda v: _is_int(v) and v >= 1,
            "message_type": lambda v: isinstance(v, str),
            "mechanism": lambda v: v in (POISSON_GAUSSIAN, GAUSSIAN, BANDED_MF),
            "noise_multiplier": lambda v: _is_number(v) and v >= 0,
            "sampling_rate": lambda v: v is None or (_is_number(v) and 0 < v <= 1),
            "num_rounds": lambda v: v is None or (_is_int(v) and v >= 1),
            "delta": lambda v: v is None or (_is_number(v) and 0 < v < 1),
            "clip": lambda v: _is_number(v) and v >= 0,
            "placement": lambda v: v is None or isinstance(v, str),
            "noise_std": lambda v: _is_number(v) and v >= 0,
            "time": lambda v: isinstance(v, str),
            "run_name": lambda v: v is None or (isinstance(v, str) and v != ""),
            "resume": lambda v: isinstance(v, bool),
            "plan": lambda v: v is None or (
                isinstance(v, list) and len(v) == 3 and _is_number(v[0]) and 0 < v[0] <= 1 and _is_number(v[1])
                and v[1] >= 0 and _is_int(v[2]) and v[2] >= 1
            ),
            "clients": lambda v: _is_int(v) and v >= 1,
            "server_noise_multiplier": lambda v: v is None or (_is_number(v) and v >= 0),
            "secure_aggregation": lambda v: isinstance(v, bool),
            "check_in": lambda v: isinstance(v, bool),
            "participation": lambda v: v is None or (
                isinstance(v, list) and len(v) == 3 and isinstance(v[0], str) and _is_int(v[1]) and v[1] >= 1
                and _is_int(v[2]) and v[2] >= 1
            ),
        }  # fmt: skip
        for name, check in checks.items():
            if not check(entry[name]):
                raise LedgerError(f"{where}: field {name!r} = {entry[name]!r} is not valid")
        if entry["plan"] is not None:
            entry["plan"] = (float(entry["plan"][0]), float(entry["plan"][1]), int(entry["plan"][2]))
        if entry["participation"] is not None:
            entry["participation"] = tuple(entry["participation"])
        release = cls(**entry)
        if (release.mechanism != GAUSSIAN) != (release.sampling_rate is not None and release.num_rounds is not None):
            raise LedgerError(f"{where}: mechanism {release.mechanism!r} does not match its q and num-rounds")
        if (release.mechanism == BANDED_MF and release.plan is None) or (
            release.mechanism == GAUSSIAN and release.plan is not None
        ):
            raise LedgerError(f"{where}: mechanism {release.mechanism!r} does not match its plan")
        return release


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


#: A plan: the releases of one run charged its plan once (``_params`` after the run id it was first charged for).
PlanKey = tuple[Any, ...]
#: ``(run-name, the plan's parameters)`` -> the plan a resume of that run continues.
Names = Callable[[str, str], PlanKey | None]


def _params(r: Release) -> tuple[Any, ...]:
    """What a run's plan is, but its id: mechanism, ``q``, ``K``, delta, ``z``, account (a)'s plan (with the
    node's virtual clients in it), banded MF's participation rule. Not ``clients``: a message may ask fewer."""
    return (r.mechanism, r.sampling_rate, r.num_rounds, r.delta, r.noise_multiplier, r.plan, r.participation)


def _plan(r: Release, names: Names) -> PlanKey:
    """The plan release ``r`` belongs to: its run's (by run id), or, for a resume (``resume = true``) of a run the
    node charged under the same ``run-name`` with the same parameters, that run's plan (issue 47: a resume gets a
    new Flower run id, and is not a new run). A resume of a name the node never charged, or with another plan, is
    a new plan."""
    if r.resume and r.run_name is not None:
        earlier = names(r.run_name, json.dumps(_params(r)))
        if earlier is not None:
            return earlier
    return (r.run_id, *_params(r))


def _hashable(value: Any) -> Any:
    """A plan key read back from JSON: its lists as tuples again (the key of a dict, as `_plan` makes it)."""
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def _plan_charge(r: Release) -> tuple[RoundEvent, int]:
    """Account (a)'s charge of a new plan: ``K x PoissonSampled(q, Gaussian(z))``, or the run's own (``plan``)."""
    assert r.sampling_rate is not None and r.num_rounds is not None
    if r.plan is not None:
        return RoundEvent(r.plan[0], r.plan[1]), r.plan[2]
    return RoundEvent(r.sampling_rate, r.noise_multiplier), r.num_rounds


def _charge(r: Release, rounds: set[int] | None) -> tuple[RoundEvent, int] | None:
    """What release ``r`` adds to account (a), given the rounds its plan answered already (``None``: a new plan).

    A new plan: its whole plan; a round beyond the plan (``server_round > num-rounds``: a server asking past the
    plan it declared, which the plan's epsilon does not cover): its whole plan again, each time; a round of the
    plan answered before: one more round of it (banded MF, whose analysis covers no redone round and which the
    node refuses: its whole plan again); another round of a charged plan: nothing. Without a run config
    (``gaussian``): one ``Gaussian(z)``.
    """
    if r.mechanism == GAUSSIAN:
        return RoundEvent(1.0, r.noise_multiplier), 1
    event, count = _plan_charge(r)
    assert r.num_rounds is not None
    if rounds is None or r.server_round > r.num_rounds:
        return event, count
    if r.server_round not in rounds:
        return None
    return (event, count) if r.mechanism == BANDED_MF else (event, 1)


def _server_z(r: Release) -> float:
    """The node's own noise multiplier in release ``r`` (``z_own = s / C``); an entry written before the field: the
    node's own std over the entry's ``C`` (``C_k``: with adaptive clipping below ``C_aug``, so a larger ``mu``)."""
    z = r.server_noise_multiplier
    if z is None:
        z = r.noise_std / r.clip if r.clip > 0 else 0.0
    return z


def amplified(r: Release) -> bool:
    """Whether account (b) charges ``r`` amplified by its ``q``: a random check-in (the node's own coin,
    `dpfedavg.core.check_in`) whose masked vector went through SecAgg+ stages the node checked. Whoever the
    server declares dropped, what it can read of the node is ``b u + zeta_own``, ``b ~ Bernoulli(q)`` drawn by the
    node: a Poisson-sampled Gaussian at ``(q, z_own)`` (`dpfedavg.privacy.node_accounts`)."""
    return r.check_in and r.secure_aggregation and r.mechanism == POISSON_GAUSSIAN and r.sampling_rate is not None


def server_charge(r: Release) -> float:
    """What release ``r`` adds to account (b)'s ``mu^2`` (`dpfedavg.privacy.node_accounts.server_mu2`); 0 for an
    `amplified` release, charged as a sampled event instead (`_server_added`)."""
    return 0.0 if amplified(r) else server_mu2(_server_z(r), r.clients)


def _server_plan(key: PlanKey, r: Release) -> PlanKey:
    """Account (b)'s plan of an `amplified` release: its run's plan at the node's own ``z_own`` (a server that
    changes the cohort, so ``z_own``, within a run has each ``z_own`` charged a whole plan)."""
    return ("server", *key, _server_z(r))


def _server_added(r: Release, rounds: set[int] | None) -> tuple[RoundEvent, int] | None:
    """What an `amplified` release adds to account (b), given the rounds its `_server_plan` answered: as account
    (a)'s `_charge` (the whole plan, one more round when redone, nothing otherwise) at ``PoissonSampled(q,
    Gaussian(z_own))``."""
    added = _charge(r, rounds)
    assert r.sampling_rate is not None
    return None if added is None else (RoundEvent(r.sampling_rate, _server_z(r)), added[1])


def server_epsilon(mu2: float, sampled: Composition, delta: float) -> float:
    """Account (b)'s epsilon at ``delta``: the Gaussian of ``mu^2`` (exact, `gaussian_epsilon()`), composed with
    the PLD of its amplified (check-in) charges when there are any."""
    if sampled.infinite or not math.isfinite(mu2):
        return math.inf
    if sampled.pld is None:
        return gaussian_epsilon(math.sqrt(mu2), delta)
    if mu2 > 0:
        sampled = sampled.then(RoundEvent(1.0, 1 / math.sqrt(mu2)), 1)
    return sampled.epsilon(delta)


class _Plans:
    """Rounds answered per plan and the plan of each run name, in memory (``charged_events``)."""

    def __init__(self) -> None:
        self.rounds: dict[PlanKey, set[int]] = {}
        self.names: dict[tuple[str, str], PlanKey] = {}

    def add(self, r: Release, key: PlanKey) -> None:
        self.rounds.setdefault(key, set()).add(r.server_round)
        if r.run_name is not None:
            self.names[(r.run_name, json.dumps(_params(r)))] = key


def charged_events(releases: list[Release]) -> list[tuple[RoundEvent, int]]:
    """Account (a)'s events for ``releases``, in the order they were charged: ``(event, count)`` pairs.

    A client with a run config: each run (entries with the same run id and plan, or a resume of it: `_plan`) is
    charged its plan once, and each release of a round beyond its first one more round. Without a run config
    (``gaussian``): each release one ``Gaussian(z)``.
    """
    events: list[tuple[RoundEvent, int]] = []
    plans = _Plans()
    for r in releases:
        key = _plan(r, lambda name, params: plans.names.get((name, params)))
        charge = _charge(r, plans.rounds.get(key) if r.mechanism != GAUSSIAN else None)
        if charge is not None:
            events.append(charge)
        if r.mechanism != GAUSSIAN:
            plans.add(r, key)
    return events


@dataclass(frozen=True)
class Composition:
    """The composed privacy loss distribution of charged events, in order (``pld`` ``None``: nothing charged).

    ``infinite``: an event without noise (z = 0), or beyond the PLD accountant's range, was charged.
    """

    pld: Any = None
    infinite: bool = False

    def then(self, event: RoundEvent, count: int, run_pld: Callable[[RoundEvent, int], Any] = _run_pld) -> Composition:
        """This composition followed by ``count`` rounds of ``event`` (one self-composed PLD, from ``run_pld``)."""
        if self.infinite:
            return self
        if not event.z:
            return Composition(infinite=True)
        try:
            run = run_pld(event, count)
        except AccountingRangeError:
            return Composition(infinite=True)
        return Composition(run if self.pld is None else self.pld.compose(run))

    def epsilon(self, delta: float) -> float:
        if self.infinite:
            return math.inf
        return 0.0 if self.pld is None else float(self.pld.get_epsilon_for_delta(delta))


def ledger_delta(policy: NodePolicy) -> float:
    """The delta the node's epsilon is read at: ``max-epsilon-delta``, else ``DEFAULT_DELTA``: the operator's.

    A run's delta is the server's choice and never moves it: a server that declares ``delta = 0.1`` must not have
    the node's budget read at 0.1 (five runs of epsilon 3.85 at delta 1e-5 cost 3.81 together at 0.1), and one cheap
    run declaring ``delta = 1e-12`` must not move the reading down for every later run (issue 46: the spent budget
    went from 4.31 to 6.42). Every run is charged at the node's delta.
    """
    return policy.max_epsilon_delta if policy.max_epsilon_delta is not None else DEFAULT_DELTA


def keeps_ledger(node_config: Mapping[str, Any]) -> bool:
    """A node keeps a ledger when its config has any policy key (``privacy-ledger`` included)."""
    return any(key not in NODE_IDENTITY_KEYS for key in node_config)


def node_home() -> Path:
    """The SuperNode's home: ``$FLWR_HOME``, else ``~/.flwr`` (Flower's own rule)."""
    return Path(os.environ.get("FLWR_HOME") or "~/.flwr").expanduser()


def ledger_path(node_config: Mapping[str, Any], policy: NodePolicy) -> Path:
    """``privacy-ledger``, else ``$FLWR_HOME/dpfedavg/privacy-ledger[-<partition-id>].json`` (FLWR_HOME: ``~/.flwr``).

    The partition id keeps SuperNodes that share a home (a simulation, several nodes on one machine) apart.
    """
    if policy.privacy_ledger is not None:
        return Path(policy.privacy_ledger).expanduser()
    home = node_home()
    pid = node_config.get("partition-id")
    return home / "dpfedavg" / (f"privacy-ledger-{pid}.json" if pid is not None else "privacy-ledger.json")


def _canonical(entry: dict[str, Any]) -> str:
    return json.dumps(entry, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _checksum(entries: list[dict[str, Any]]) -> str:
    """The ``/1`` format's checksum of all its entries."""
    return hashlib.sha256(json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _link(previous: str, entry: dict[str, Any]) -> str:
    """The chain after ``entry``: SHA-256 of the chain before it and the entry."""
    return hashlib.sha256((previous + _canonical(entry)).encode()).hexdigest()


def _line(entry: dict[str, Any], chain: str) -> bytes:
    return (json.dumps({"entry": entry, "sha256": chain}, allow_nan=False) + "\n").encode()


_HEADER = (json.dumps({"format": LEDGER_FORMAT}) + "\n").encode()


def _write_at(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``OSError`` otherwise: a full disk)."""
    written = os.pwrite(fd, data, offset)
    if written != len(data):
        raise OSError(f"wrote {written} of {len(data)} bytes")


@dataclass
class _Scan:
    """The file read in full: its releases, the chain after each, and the bytes of its complete lines."""

    releases: list[Release]
    chains: list[str]
    size: int
    version: int

    @property
    def head(self) -> str:
        return self.chains[-1] if self.chains else _GENESIS


class NodeLedger:
    """The ledger file at ``path``: read it, compose it, append a release under its lock."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.state_path = self.path.with_name(self.path.name + ".state")

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """An exclusive ``fcntl`` lock on ``<path>.lock`` (held while the file or its state changes)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:
            raise LedgerError(f"privacy-ledger {self.path}: cannot open its lock file ({err})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    # ------------------------------------------------------------------ the file
    def _scan(self) -> _Scan | None:
        """The whole file, every entry and its chain checked (``None``: no file); ``LedgerError`` otherwise."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            raise LedgerError(f"privacy-ledger {self.path} cannot be read ({err})") from None
        fix = "restore it from a backup; moving it away resets this node's spent budget to 0"
        if b"\n" not in raw and _HEADER.startswith(raw):  # created, and a crash cut its first append short
            return _Scan([], [], 0, 2)
        first, _, rest = raw.partition(b"\n")
        try:
            header = json.loads(first)
        except ValueError:
            header = None
        if isinstance(header, dict) and header.get("format") == LEDGER_FORMAT and set(header) == {"format"}:
            return self._scan_lines(raw, len(first) + 1, rest, fix)
        try:
            data = json.loads(raw)
        except ValueError as err:
            raise LedgerError(f"privacy-ledger {self.path} is corrupt (not JSON: {err}); {fix}") from None
        if (
            not isinstance(data, dict)
            or data.get("format") != LEDGER_FORMAT_V1
            or not isinstance(data.get("entries"), list)
        ):
            raise LedgerError(f"privacy-ledger {self.path} is not a {LEDGER_FORMAT} file; {fix}")
        if data.get("sha256") != _checksum(data["entries"]):
            raise LedgerError(
                f"privacy-ledger {self.path} was edited: its checksum does not match its {len(data['entries'])} "
                f"entries; {fix}"
            )
        releases = [
            Release.from_json(e, f"privacy-ledger {self.path}, entry {i}") for i, e in enumerate(data["entries"])
        ]
        chains, chain = [], _GENESIS
        for r in releases:
            chain = _link(chain, r.to_json())
            chains.append(chain)
        return _Scan(releases, chains, len(raw), 1)

    def _scan_lines(self, raw: bytes, offset: int, rest: bytes, fix: str) -> _Scan:
        lines = rest.split(b"\n")
        if lines[-1]:  # an append a crash cut short: its fsync never returned, so its release was never sent
            logger.warning(
                "privacy ledger %s: its last line (%d bytes) is an append a crash cut short (its release was never "
                "sent); it is left out", self.path, len(lines[-1]),
            )  # fmt: skip
        releases, chains, chain = [], [], _GENESIS
        for i, line in enumerate(lines[:-1]):
            where = f"privacy-ledger {self.path}, entry {i}"
            try:
                item = json.loads(line)
            except ValueError as err:
                raise LedgerError(
                    f"privacy-ledger {self.path} is corrupt (entry {i} is not JSON: {err}); {fix}"
                ) from None
            if not isinstance(item, dict) or set(item) != {"entry", "sha256"}:
                raise LedgerError(f"{where} is not a ledger line (expected 'entry' and 'sha256'); {fix}")
            release = Release.from_json(item["entry"], where)
            chain = _link(chain, release.to_json())
            if item["sha256"] != chain:
                raise LedgerError(
                    f"privacy-ledger {self.path} was edited: entry {i}'s chained checksum does not match the entries "
                    f"up to it; {fix}"
                )
            releases.append(release)
            chains.append(chain)
        return _Scan(releases, chains, offset + len(rest) - len(lines[-1]), 2)

    def read(self) -> list[Release]:
        """Every release recorded (none if the file does not exist); ``LedgerError`` if it is not a ledger."""
        scan = self._scan()
        return [] if scan is None else scan.releases

    def write(self, releases: list[Release]) -> None:
        """Replace the file with ``releases`` in the current format: temporary file, fsync, rename (under ``locked``).

        Only to convert a ``/1`` file (and in tests); a release is appended (``charge``).
        """
        chunks, chain = [_HEADER], _GENESIS
        for r in releases:
            chain = _link(chain, r.to_json())
            chunks.append(_line(r.to_json(), chain))
        try:
            atomic_write_bytes(self.path, b"".join(chunks), durable=True)
        except OSError as err:
            raise LedgerError(f"privacy-ledger {self.path} cannot be written ({err}): nothing is sent") from None
        _State.remove(self.state_path)  # a state of the old file

    def _append(self, release: Release, previous: str, size: int) -> None:
        """Append ``release`` after the first ``size`` bytes (a torn last line is cut off) and fsync it."""
        entry = release.to_json()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                if size == 0:
                    os.ftruncate(fd, 0)
                    _write_at(fd, _HEADER, 0)
                    size = len(_HEADER)
                elif os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)
                _write_at(fd, _line(entry, _link(previous, entry)), size)
                os.fsync(fd)
            finally:
                os.close(fd)
            if size == len(_HEADER):
                dir_fd = os.open(self.path.parent, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)  # a new file's name is durable too
                finally:
                    os.close(dir_fd)
        except OSError as err:
            with contextlib.suppress(OSError):
                os.truncate(self.path, max(size, 0))  # no half line left behind
            raise LedgerError(f"privacy-ledger {self.path} cannot be written ({err}): nothing is sent") from None

    # ------------------------------------------------------------------ the state
    def _state(self) -> _State:
        """The state, brought up to date with the file (call under ``locked``)."""
        state = _State.open(self.state_path)
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            state.reset()  # no ledger: nothing spent (a ledger moved away deliberately resets the budget)
            return state
        except OSError as err:
            raise LedgerError(f"privacy-ledger {self.path} cannot be read ({err})") from None
        if state.matches(stat):
            return state
        scan = self._scan()
        assert scan is not None
        if scan.version == 1:
            state.close()
            self.write(scan.releases)  # convert: the next release is appended
            logger.info("privacy ledger %s converted to %s (%d entries)", self.path, LEDGER_FORMAT, len(scan.releases))
            return self._state()
        if not state.same_boot():  # written without fsync: after a crash of the machine it may be torn
            if state.covered()[0]:
                logger.warning("privacy ledger %s: the machine restarted; state rebuilt from the file", self.path)
            state.reset()
        covered, head = state.covered()
        if covered > len(scan.releases) or (covered and scan.chains[covered - 1] != head):
            if covered > len(scan.releases):
                raise LedgerError(
                    f"privacy-ledger {self.path} was edited: it holds {len(scan.releases)} entries, this node had "
                    f"recorded {covered} ({self.state_path}); restore it from a backup (if you restored an older one "
                    f"on purpose, delete {self.state_path})"
                )
            logger.warning("privacy ledger %s: its state %s is of another file; rebuilt", self.path, self.state_path)
            state.reset()
            covered = 0
        state.catch_up(scan, covered, os.stat(self.path))
        return state

    @contextlib.contextmanager
    def _synced(self) -> Iterator[_State]:
        """The lock, and the state up to date with the file while it is held."""
        with self.locked():
            try:
                state = self._state()
                try:
                    yield state
                finally:
                    state.close()
            except sqlite3.Error as err:  # e.g. a full disk under the state cache: one clear error, the ledger intact
                raise LedgerError(
                    f"privacy-ledger state {self.state_path} cannot be read or written ({err}); the ledger file "
                    f"{self.path} is unchanged: free space or fix the folder's permissions, and the state is rebuilt "
                    "from it"
                ) from None

    def spent(self, policy: NodePolicy, account: str = RELEASED) -> float:
        """The epsilon of one account (`RELEASED`: (a), `SERVER`: (b)) of the recorded releases, at ``ledger_delta``."""
        return self.accounts(policy)[account]

    def accounts(self, policy: NodePolicy) -> dict[str, float]:
        """Both accounts' epsilon at ``ledger_delta`` (`dpfedavg.privacy.node_accounts`)."""
        delta = ledger_delta(policy)
        with self._synced() as state:
            server = server_epsilon(state.server_mu2(), state.server_composition(), delta)
            return {RELEASED: state.epsilon(delta), SERVER: server}

    def charge(self, release: Release, policy: NodePolicy) -> dict[str, float]:
        """Append ``release`` unless an account's epsilon would exceed its budget; both accounts after it.

        Account (a) (`RELEASED`) against ``max-epsilon-released`` (default ``max-epsilon``), account (b)
        (`SERVER`) against ``max-epsilon`` (none with ``allow-server-noise = true``). Raises
        ``dpfedavg.privacy.policy.RoundRefused`` naming the key, with the ledger's numbers, or ``LedgerError``.
        The entry is durable on disk when this returns.
        """
        delta = ledger_delta(policy)
        with self._synced() as state:
            key = None if release.mechanism == GAUSSIAN else _plan(release, state.name_plan)
            rounds = None if key is None else state.rounds(key)
            if release.mechanism == BANDED_MF and rounds is not None and release.participation is not None:
                broken = check_participation(release.participation, rounds, release.server_round)
                if broken is not None:
                    raise RoundRefused(
                        "participation", f"banded-MF run {release.run_id}: {broken}; its epsilon covers no other "
                        "pattern", policy=False,
                    )  # fmt: skip
            added = _charge(release, rounds)
            after = None if added is None else state.composition().then(*added, run_pld=state.run_pld)
            total = state.epsilon(delta) if after is None else after.epsilon(delta)
            skey = _server_plan(key, release) if key is not None and amplified(release) else None
            s_added = None if skey is None else _server_added(release, state.rounds(skey))
            sampled = state.server_composition()
            s_after = sampled if s_added is None else sampled.then(*s_added, run_pld=state.run_pld)
            mu2 = state.server_mu2() + server_charge(release)
            server = server_epsilon(mu2, s_after, delta)
            if total > policy.released_budget:
                alone = Composition().then(*added, run_pld=state.run_pld).epsilon(delta) if added else 0.0
                self._refuse(release, policy.released_key, "released", state.epsilon(delta), alone, total,
                             policy.released_budget, delta)  # fmt: skip
            if server > policy.server_budget:
                spent = server_epsilon(state.server_mu2(), sampled, delta)
                alone = server_epsilon(server_charge(release), Composition().then(*s_added, run_pld=state.run_pld)
                                       if s_added else Composition(), delta)  # fmt: skip
                self._refuse(release, "max-epsilon", "server", spent, alone, server, policy.server_budget, delta)
            entries, head, size = state.position()
            self._append(release, head, size)
            state.record(release, key, _link(head, release.to_json()), after, (delta, total), mu2, os.stat(self.path),
                         server_plan=skey, sampled=s_after if s_added else None)  # fmt: skip
        logger.info(
            "privacy ledger %s: run %d round %d recorded, epsilon %.4g (released) and %.4g (server) at delta %g",
            self.path, release.run_id, release.server_round, total, server, delta,
        )  # fmt: skip
        return {RELEASED: total, SERVER: server}

    def _refuse(
        self, release: Release, rule: str, account: str, spent: float, alone: float, total: float, budget: float,
        delta: float,
    ) -> None:  # fmt: skip
        what = {"released": "against those who see the released model", "server": "against the server itself"}
        raise RoundRefused(
            rule,
            f"this node's privacy ledger {self.path} has spent epsilon {spent:.4g} in its {account} account "
            f"({what[account]}); this release (run {release.run_id}, round {release.server_round}) costs {alone:.4g} "
            f"on its own and would bring the composed epsilon to {total:.4g} > {rule} = {budget:g} "
            f"(delta = {delta:g}, {LEDGER_ACCOUNTANT if account == 'released' else 'exact Gaussian'} accountant"
            f"{' with PLD for check-ins' if account == 'server' and release.check_in else ''})",
            policy=True,
        )


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value);
CREATE TABLE IF NOT EXISTS plans (plan TEXT, round INTEGER, PRIMARY KEY (plan, round)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS names (name TEXT, params TEXT, plan TEXT, PRIMARY KEY (name, params)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS pld (name TEXT, side TEXT, discretization REAL, lower_loss INTEGER, probs BLOB,
                                infinity_mass REAL, pessimistic INTEGER, PRIMARY KEY (name, side));
"""
_STATE_VERSION = 3
#: The name of account (b)'s composition of amplified (check-in) charges in the state's ``pld`` table.
_SERVER_PLD = "server running"
#: How many plans' PLDs (``K`` rounds of one ``q`` and ``z``) the state keeps: building one costs tens of ms.
_RUN_PLDS = 32
#: Linux's id of this boot: a state written in this boot survives any crash of a process (SQLite is atomic against
#: those without fsync); after a crash of the machine it is rebuilt. Elsewhere every commit is synced.
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def _boot_id() -> str | None:
    try:
        return _BOOT_ID.read_text().strip() or None
    except OSError:
        return None


class _State:
    """``<ledger>.state``: a SQLite cache of the ledger's running composition and answered rounds.

    ``meta`` holds where in the file it was taken (``entries``, ``head``, ``size``, and the file's ``mtime_ns`` and
    ``inode`` after its last append) and ``infinite``; ``plans`` the rounds answered per plan; ``pld`` the running
    composition's two probability mass functions (remove and add; one when symmetric). It is a cache: any doubt
    (another version, a file it does not match, a database error) and it is rebuilt from the ledger file.
    """

    def __init__(self, db: sqlite3.Connection, path: Path) -> None:
        self.db, self.path = db, path

    @classmethod
    def open(cls, path: Path) -> _State:
        for attempt in (0, 1):
            try:
                db = sqlite3.connect(path, isolation_level=None)
                db.execute("PRAGMA journal_mode=WAL")
                db.execute(f"PRAGMA synchronous={'OFF' if _boot_id() else 'NORMAL'}")
                db.executescript(_SCHEMA)
                state = cls(db, path)
                if state._meta("version", _STATE_VERSION) != _STATE_VERSION:
                    raise sqlite3.DatabaseError("another version")
                return state
            except sqlite3.Error as err:
                if attempt:
                    raise LedgerError(f"privacy-ledger state {path} cannot be opened ({err})") from None
                logger.warning("privacy ledger state %s is unreadable (%s); rebuilt from the ledger", path, err)
                cls.remove(path)
        raise AssertionError("unreachable")

    @staticmethod
    def remove(path: Path) -> None:
        """Delete the state (and SQLite's write-ahead log beside it)."""
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                path.with_name(path.name + suffix).unlink()

    def close(self) -> None:
        self.db.close()

    def _meta(self, key: str, default: Any = None) -> Any:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return default if row is None else row[0]

    def _set(self, values: dict[str, Any]) -> None:
        self.db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", values.items())

    def reset(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")
        for table in ("meta", "plans", "names", "pld"):
            self.db.execute(f"DELETE FROM {table}")  # noqa: S608 - fixed names
        self._set({"version": _STATE_VERSION, "boot": _boot_id()})
        self.db.execute("COMMIT")

    def matches(self, stat: os.stat_result) -> bool:
        """Whether the file is exactly as this state's last writer left it (size, mtime, inode), in this boot."""
        return self.same_boot() and (self._meta("size"), self._meta("mtime_ns"), self._meta("inode")) == (
            stat.st_size, stat.st_mtime_ns, stat.st_ino,
        )  # fmt: skip

    def same_boot(self) -> bool:
        return self._meta("boot") == _boot_id()

    def covered(self) -> tuple[int, str]:
        return int(self._meta("entries", 0)), str(self._meta("head", _GENESIS))

    def position(self) -> tuple[int, str, int]:
        """Entries covered, the chain head and the bytes of complete lines (the file as its last writer left it)."""
        entries, head = self.covered()
        return entries, head, int(self._meta("size", 0))

    def rounds(self, plan: PlanKey) -> set[int] | None:
        rows = self.db.execute("SELECT round FROM plans WHERE plan = ?", (json.dumps(plan),)).fetchall()
        return {r for (r,) in rows} if rows else None

    def name_plan(self, name: str, params: str) -> PlanKey | None:
        """The plan last charged under ``run-name`` ``name`` with these parameters (what a resume continues)."""
        row = self.db.execute("SELECT plan FROM names WHERE name = ? AND params = ?", (name, params)).fetchone()
        return None if row is None else _hashable(json.loads(row[0]))

    def _add_plan(self, release: Release, plan: PlanKey) -> None:
        """Within the caller's transaction: round ``k`` of ``plan`` answered, and ``plan`` as its run name's."""
        self.db.execute("INSERT OR IGNORE INTO plans VALUES (?, ?)", (json.dumps(plan), release.server_round))
        if release.run_name is not None:
            row = (release.run_name, json.dumps(_params(release)), json.dumps(plan))
            self.db.execute("INSERT OR REPLACE INTO names VALUES (?, ?, ?)", row)

    def server_mu2(self) -> float:
        """Account (b)'s ``mu^2`` (``inf``: a release without noise of the node's own)."""
        return math.inf if self._meta("server_infinite", 0) else float(self._meta("server_mu2", 0.0))

    def _set_server(self, mu2: float) -> None:
        self._set({"server_infinite": int(not math.isfinite(mu2)), "server_mu2": mu2 if math.isfinite(mu2) else 0.0})

    def server_composition(self) -> Composition:
        """Account (b)'s amplified (check-in) charges, composed (`server_epsilon`)."""
        if self._meta("server_sampled_infinite", 0):
            return Composition(infinite=True)
        return Composition(self._load(_SERVER_PLD))

    def _store_server(self, composition: Composition) -> None:
        self._set({"server_sampled_infinite": int(composition.infinite)})
        self.db.execute("DELETE FROM pld WHERE name = ?", (_SERVER_PLD,))
        if not composition.infinite and composition.pld is not None:
            self._save(_SERVER_PLD, composition.pld)

    def _load(self, name: str) -> Any:
        """The PLD stored as ``name`` (``None`` if there is none)."""
        from dp_accounting.pld import pld_pmf, privacy_loss_distribution

        query = "SELECT side, discretization, lower_loss, probs, infinity_mass, pessimistic FROM pld WHERE name = ?"
        rows = {row[0]: row[1:] for row in self.db.execute(query, (name,))}
        if not rows:
            return None
        pmfs = {
            side: pld_pmf.DensePLDPmf(d, int(lower), np.frombuffer(probs, dtype=np.float64).copy(), inf, bool(p))
            for side, (d, lower, probs, inf, p) in rows.items()
        }
        return privacy_loss_distribution.PrivacyLossDistribution(pmfs["remove"], pmfs.get("add"))

    def _save(self, name: str, pld: Any) -> None:
        """Store ``pld`` as ``name`` (within the caller's transaction); its pmfs as dense arrays, exactly."""
        self.db.execute("DELETE FROM pld WHERE name = ?", (name,))
        sides = {"remove": pld._pmf_remove} if pld._symmetric else {"remove": pld._pmf_remove, "add": pld._pmf_add}
        for side, pmf in sides.items():
            dense = pmf.to_dense_pmf()
            self.db.execute(
                "INSERT INTO pld VALUES (?, ?, ?, ?, ?, ?, ?)",
                (name, side, dense._discretization, int(dense._lower_loss),
                 np.asarray(dense._probs, np.float64).tobytes(), float(dense._infinity_mass),
                 int(dense._pessimistic_estimate)),
            )  # fmt: skip

    def composition(self) -> Composition:
        if self._meta("infinite", 0):
            return Composition(infinite=True)
        return Composition(self._load("running"))

    def run_pld(self, event: RoundEvent, count: int) -> Any:
        """``_run_pld(event, count)``, kept in the state for the next process (a node's runs repeat their plan)."""
        name = f"run {event.q!r} {event.z!r} {count}"
        pld = self._load(name)
        if pld is None:
            pld = _run_pld(event, count)
            self.db.execute("BEGIN IMMEDIATE")
            self._save(name, pld)
            query = "SELECT DISTINCT name FROM pld WHERE name NOT IN ('running', ?) ORDER BY rowid"
            names = [n for (n,) in self.db.execute(query, (_SERVER_PLD,))]
            for old in names[:-_RUN_PLDS]:
                self.db.execute("DELETE FROM pld WHERE name = ?", (old,))
            self.db.execute("COMMIT")
            pld = self._load(name)  # what the next process composes: the same numbers
        return pld

    def epsilon(self, delta: float) -> float:
        """The running composition's epsilon at ``delta`` (kept for the last delta it was read at)."""
        if self._meta("epsilon_delta") == delta:
            return float(self._meta("epsilon"))
        epsilon = self.composition().epsilon(delta)
        self.db.execute("BEGIN IMMEDIATE")
        self._set({"epsilon_delta": delta, "epsilon": epsilon})
        self.db.execute("COMMIT")
        return epsilon

    def _store(self, composition: Composition, epsilon: tuple[float, float] | None = None) -> None:
        """Replace the running composition (and its epsilon at a delta, if known)."""
        self.db.execute("DELETE FROM pld WHERE name = 'running'")
        self.db.execute("DELETE FROM meta WHERE key IN ('epsilon', 'epsilon_delta')")
        if epsilon is not None:
            self._set({"epsilon_delta": epsilon[0], "epsilon": epsilon[1]})
        self._set({"infinite": int(composition.infinite)})
        if not composition.infinite and composition.pld is not None:
            self._save("running", composition.pld)

    def record(
        self,
        release: Release,
        plan: PlanKey | None,
        head: str,
        composition: Composition | None,
        epsilon: tuple[float, float],
        server_mu2: float,
        stat: os.stat_result,
        *,
        server_plan: PlanKey | None = None,
        sampled: Composition | None = None,
    ) -> None:
        """One appended release: its round of ``plan``, account (a)'s new composition (``None``: unchanged) and its
        ``(delta, epsilon)``, account (b)'s ``mu^2``, its amplified plan and composition (``None``: unchanged), and
        where the file now ends."""
        entries, _, _ = self.position()
        self.db.execute("BEGIN IMMEDIATE")
        if plan is not None:
            self._add_plan(release, plan)
        if server_plan is not None:
            row = (json.dumps(server_plan), release.server_round)
            self.db.execute("INSERT OR IGNORE INTO plans VALUES (?, ?)", row)
        if sampled is not None:
            self._store_server(sampled)
        self._set_server(server_mu2)
        if composition is not None:
            self._store(composition, epsilon)
        self._set({"entries": entries + 1, "head": head, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                   "inode": stat.st_ino, "boot": _boot_id()})  # fmt: skip
        self.db.execute("COMMIT")

    def catch_up(self, scan: _Scan, covered: int, stat: os.stat_result) -> None:
        """Fold the entries ``scan`` holds beyond the ``covered`` first into the state (one transaction)."""
        composition, sampled = self.composition(), self.server_composition()
        mu2 = self.server_mu2()
        plans = _Plans()  # the new entries' plans, over the state's
        changed = sampled_changed = False

        def names(name: str, params: str) -> PlanKey | None:
            return plans.names.get((name, params)) or self.name_plan(name, params)

        for r in scan.releases[covered:]:
            mu2 += server_charge(r)
            if r.mechanism == GAUSSIAN:
                added = _charge(r, None)
            else:
                key = _plan(r, names)
                if key not in plans.rounds:
                    plans.rounds[key] = self.rounds(key) or set()
                added = _charge(r, plans.rounds[key] or None)
                plans.add(r, key)
                if amplified(r):
                    skey = _server_plan(key, r)
                    if skey not in plans.rounds:
                        plans.rounds[skey] = self.rounds(skey) or set()
                    s_added = _server_added(r, plans.rounds[skey] or None)
                    plans.rounds[skey].add(r.server_round)
                    if s_added is not None:
                        sampled, sampled_changed = sampled.then(*s_added, run_pld=self.run_pld), True
            if added is not None:
                composition, changed = composition.then(*added, run_pld=self.run_pld), True
        self.db.execute("BEGIN IMMEDIATE")
        for key, rounds in plans.rounds.items():
            self.db.executemany("INSERT OR IGNORE INTO plans VALUES (?, ?)", [(json.dumps(key), k) for k in rounds])
        for (name, params), key in plans.names.items():
            self.db.execute("INSERT OR REPLACE INTO names VALUES (?, ?, ?)", (name, params, json.dumps(key)))
        if changed:
            self._store(composition)
        if sampled_changed:
            self._store_server(sampled)
        self._set_server(mu2)
        self._set({"version": _STATE_VERSION, "entries": len(scan.releases), "head": scan.head, "size": scan.size,
                   "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino, "boot": _boot_id()})  # fmt: skip
        self.db.execute("COMMIT")


def record_release(
    node_config: Mapping[str, Any],
    run_id: int,
    ins: RoundInstructions,
    cfg: RunConfig | None,
    *,
    message_type: str,
    secure_aggregation: bool = False,
    clients: int = 1,
) -> None:
    """The node's hook, called after the round's checks and before anything is computed or sent.

    Does nothing for a node without a policy (no ledger). Otherwise charges the release described by ``ins`` (the
    instructions this client follows: its own noise std) and ``cfg`` (``None``: ``dp_mod``, charged as a Gaussian
    at ``q = 1``) to both accounts of the node's ledger (`dpfedavg.privacy.node_accounts`), or raises
    ``dpfedavg.privacy.policy.RoundRefused`` / ``LedgerError``. ``secure_aggregation``: the release goes through
    SecAgg+ whose parameters the node checked (recorded; account (b) still charges the node's own share, see
    `dpfedavg.privacy.node_accounts`, amplified by ``q`` when the run's ``sampling`` is ``check-in``: `amplified`);
    ``clients``: the node's virtual clients answering in this message (each update charged).
    """
    if not keeps_ledger(node_config):
        return
    policy = NodePolicy.from_node_config(node_config)
    if not (math.isfinite(ins.noise_std) and ins.noise_std >= 0):
        raise RoundRefused("noise-std", f"this client's noise std {ins.noise_std!r} is not a number >= 0", policy=False)
    if not (_is_int(clients) and clients >= 1):
        raise RoundRefused("clients-per-node", f"{clients!r} clients in one message (expected >= 1)", policy=False)
    private = is_private_algorithm(ins.algorithm)
    z = ins.noise_multiplier
    if not (private and math.isfinite(z) and z >= 0):
        z = 0.0  # no noise the accountant can count: charged as a release without noise (epsilon = inf)
    bound = noise_bound(ins, cfg) if private else 0.0
    own = ins.noise_std / bound if bound > 0 and math.isfinite(bound) else 0.0
    secure = bool(secure_aggregation) and ins.cohort_size >= 1
    plan, participation, mechanism = None, None, POISSON_GAUSSIAN if cfg is not None else GAUSSIAN
    if cfg is not None:
        hosted = cfg.clients_per_node  # the plan: every round may ask each client the node hosts
        if cfg.noise_mechanism != "independent" or hosted > 1:
            try:
                charge = released_plan(cfg, z, hosted)
            except ValueError as err:
                raise RoundRefused("noise-mechanism", str(err), policy=True) from None
            plan, participation = (charge.event.q, float(charge.event.z or 0.0), charge.count), charge.participation
            mechanism = BANDED_MF if not charge.redo else POISSON_GAUSSIAN
    release = Release(
        run_id=int(run_id),
        server_round=int(ins.server_round),
        message_type=str(message_type),
        mechanism=mechanism,
        noise_multiplier=float(z),
        sampling_rate=float(cfg.sampling_rate) if cfg is not None else None,
        num_rounds=int(cfg.num_rounds) if cfg is not None else None,
        delta=float(cfg.delta) if cfg is not None else None,
        clip=float(ins.clip) if private and math.isfinite(ins.clip) else 0.0,
        placement=cfg.noise_placement if cfg is not None else None,
        noise_std=float(ins.noise_std),
        time=datetime.now(UTC).isoformat(timespec="microseconds"),
        run_name=(cfg.run_name or None) if cfg is not None else None,
        resume=bool(cfg.resume) if cfg is not None else False,
        plan=plan,
        clients=int(clients),
        server_noise_multiplier=float(own),  # no SecAgg+ credit: see dpfedavg.privacy.node_accounts
        secure_aggregation=secure,
        participation=participation,
        check_in=cfg is not None and cfg.sampling == CHECK_IN,
    )
    NodeLedger(ledger_path(node_config, policy)).charge(release, policy)
