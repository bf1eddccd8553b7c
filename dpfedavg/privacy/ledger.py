"""The node's privacy ledger: every release a SuperNode made, composed into one budget across runs and restarts.

A SuperNode with a privacy policy (any policy key in its ``--node-config``) or an explicit ``privacy-ledger`` keeps
one JSON file (``ledger_path``) listing every update it released: run id, round, message type, mechanism,
``z``, ``q``, ``C``, the placement, its own noise std, the time (``Release``). Before an update leaves the node,
``record_release`` composes the ledger with the new release and either appends it (write-ahead: the entry is
on disk, fsynced, before the reply is built) or refuses the round when the composed epsilon would exceed the
node's ``max-epsilon`` (a ``dpfedavg.privacy.policy.RoundRefused`` carrying the ledger's numbers).

What is charged (``charged_events``; the node cannot see the server's Poisson sampling, only what it is asked):

* a client with a run config (the project's ClientApp), the first time it answers a run: the run's whole plan,
  ``num-rounds`` x ``PoissonSampled(q, Gaussian(z))``, what the run itself accounts (Alg. 1: one sampled round per
  ``k``); later rounds of the run cost nothing more;
* every further release of a ``(run, round)`` it already answered (a round redone after a crash, fresh noise):
  one more ``PoissonSampled(q, Gaussian(z))``;
* a client without a run config (``dp_mod`` in a user's own app: no ``q``, no ``K``): every release one
  unamplified ``Gaussian(z)``.

The events compose with the privacy-loss-distribution accountant (``dpfedavg.privacy.accountants``, ``pld``)
and the epsilon is read at the node's delta (``ledger_delta``). The file is rewritten atomically (temporary
file, fsync, rename: ``dpfedavg.io.atomic.atomic_write_bytes``) under an ``fcntl`` lock on a sidecar file, so
concurrent ClientApp processes of one node cannot lose an entry; a file that does not parse, or whose checksum
does not match its entries, is a ``LedgerError``, never an empty ledger.

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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from dpfedavg.config import RunConfig
from dpfedavg.core.dp import BOUNDS
from dpfedavg.core.types import RoundInstructions
from dpfedavg.io.atomic import atomic_write_bytes
from dpfedavg.privacy.accountants import AccountingRangeError, RoundEvent, create_accountant
from dpfedavg.privacy.policy import NODE_IDENTITY_KEYS, NodePolicy, PolicyError, RoundRefused

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

#: The ``format`` field of a ledger file.
LEDGER_FORMAT = "dpfedavg-node-privacy-ledger/1"
#: The largest delta the node's budget is read at without ``max-epsilon-delta`` (``ledger_delta``): the run config's
#: default ``delta``.
DEFAULT_DELTA = 1e-6
#: The accountant that composes the ledger (tight; its PLDs are pessimistic, so a valid upper bound).
LEDGER_ACCOUNTANT = "pld"
#: Mechanism names of the entries.
POISSON_GAUSSIAN = "poisson-sampled-gaussian"
GAUSSIAN = "gaussian"


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

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, entry: Any, where: str) -> Release:
        """One entry, with every field checked (``LedgerError`` naming the entry and the field)."""
        if not isinstance(entry, dict) or set(entry) != {f.name for f in dataclasses.fields(cls)}:
            raise LedgerError(f"{where} is not a ledger entry (expected the fields of {cls.__name__})")
        checks = {
            "run_id": lambda v: _is_int(v),
            "server_round": lambda v: _is_int(v) and v >= 1,
            "message_type": lambda v: isinstance(v, str),
            "mechanism": lambda v: v in (POISSON_GAUSSIAN, GAUSSIAN),
            "noise_multiplier": lambda v: _is_number(v) and v >= 0,
            "sampling_rate": lambda v: v is None or (_is_number(v) and 0 < v <= 1),
            "num_rounds": lambda v: v is None or (_is_int(v) and v >= 1),
            "delta": lambda v: v is None or (_is_number(v) and 0 < v < 1),
            "clip": lambda v: _is_number(v) and v >= 0,
            "placement": lambda v: v is None or isinstance(v, str),
            "noise_std": lambda v: _is_number(v) and v >= 0,
            "time": lambda v: isinstance(v, str),
        }
        for name, check in checks.items():
            if not check(entry[name]):
                raise LedgerError(f"{where}: field {name!r} = {entry[name]!r} is not valid")
        release = cls(**entry)
        if (release.mechanism == POISSON_GAUSSIAN) != (
            release.sampling_rate is not None and release.num_rounds is not None
        ):
            raise LedgerError(f"{where}: mechanism {release.mechanism!r} does not match its q and num-rounds")
        return release


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def charged_events(releases: list[Release]) -> list[tuple[RoundEvent, int]]:
    """The accountant's events for ``releases``: ``(event, count)`` pairs.

    A client with a run config: each run (entries with the same run id, ``q``, ``K``, delta and ``z``) is charged
    its plan ``K x PoissonSampled(q, Gaussian(z))`` once, and each release of a round beyond its first one more
    ``PoissonSampled(q, Gaussian(z))``. Without a run config (``gaussian``): each release one ``Gaussian(z)``.
    """
    events: list[tuple[RoundEvent, int]] = []
    seen: dict[tuple, set[int]] = {}
    for r in releases:
        if r.mechanism == GAUSSIAN:
            events.append((RoundEvent(1.0, r.noise_multiplier), 1))
            continue
        assert r.sampling_rate is not None and r.num_rounds is not None
        event = RoundEvent(r.sampling_rate, r.noise_multiplier)
        plan = (r.run_id, r.sampling_rate, r.num_rounds, r.delta, r.noise_multiplier)
        rounds = seen.get(plan)
        if rounds is None:
            seen[plan] = {r.server_round}
            events.append((event, r.num_rounds))
        elif r.server_round in rounds:
            events.append((event, 1))
        else:
            rounds.add(r.server_round)
    return events


@lru_cache(maxsize=256)
def _epsilon(events: tuple[tuple[RoundEvent, int], ...], delta: float) -> float:
    """Epsilon of the composed ``events`` at ``delta`` (PLD); ``inf`` for z = 0 or beyond the accountant's range."""
    accountant = create_accountant(LEDGER_ACCOUNTANT, delta)
    try:
        for event, count in events:
            accountant.step(event, count)
        return accountant.epsilon
    except AccountingRangeError:
        return math.inf


def ledger_delta(policy: NodePolicy, releases: list[Release]) -> float:
    """The delta the node's epsilon is read at: ``max-epsilon-delta``, else ``DEFAULT_DELTA`` or the smallest delta
    of any recorded run if that is smaller.

    The run's delta is the server's choice: a server that declares ``delta = 0.1`` must not have the node's budget
    read at 0.1 (five runs of epsilon 3.85 at delta 1e-5 cost 3.81 together at 0.1), so without
    ``max-epsilon-delta`` the node never reads it above ``DEFAULT_DELTA``.
    """
    if policy.max_epsilon_delta is not None:
        return policy.max_epsilon_delta
    return min([DEFAULT_DELTA, *(r.delta for r in releases if r.delta is not None)])


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


def _checksum(entries: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class NodeLedger:
    """The ledger file at ``path``: read it, compose it, append a release under its lock."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """An exclusive ``fcntl`` lock on ``<path>.lock`` (the ledger itself is replaced by rename)."""
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

    def read(self) -> list[Release]:
        """Every release recorded (none if the file does not exist); ``LedgerError`` if it is not a ledger."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as err:
            raise LedgerError(f"privacy-ledger {self.path} cannot be read ({err})") from None
        fix = "restore it from a backup; moving it away resets this node's spent budget to 0"
        try:
            data = json.loads(raw)
        except ValueError as err:
            raise LedgerError(f"privacy-ledger {self.path} is corrupt (not JSON: {err}); {fix}") from None
        if (
            not isinstance(data, dict)
            or data.get("format") != LEDGER_FORMAT
            or not isinstance(data.get("entries"), list)
        ):
            raise LedgerError(f"privacy-ledger {self.path} is not a {LEDGER_FORMAT} file; {fix}")
        if data.get("sha256") != _checksum(data["entries"]):
            raise LedgerError(
                f"privacy-ledger {self.path} was edited: its checksum does not match its {len(data['entries'])} "
                f"entries; {fix}"
            )
        return [Release.from_json(e, f"privacy-ledger {self.path}, entry {i}") for i, e in enumerate(data["entries"])]

    def write(self, releases: list[Release]) -> None:
        """Replace the file with ``releases``: temporary file, fsync, rename (call under ``locked``)."""
        entries = [r.to_json() for r in releases]
        data = {"format": LEDGER_FORMAT, "entries": entries, "sha256": _checksum(entries)}
        try:
            atomic_write_bytes(self.path, (json.dumps(data, indent=1, allow_nan=False) + "\n").encode(), durable=True)
        except OSError as err:
            raise LedgerError(f"privacy-ledger {self.path} cannot be written ({err}): nothing is sent") from None

    def spent(self, policy: NodePolicy) -> float:
        """The epsilon the recorded releases compose to, at ``ledger_delta``."""
        releases = self.read()
        return _epsilon(tuple(charged_events(releases)), ledger_delta(policy, releases))

    def charge(self, release: Release, policy: NodePolicy) -> float:
        """Append ``release`` unless the composed epsilon would exceed ``max-epsilon``; the epsilon after it.

        Raises ``dpfedavg.privacy.policy.RoundRefused`` (rule ``max-epsilon``) with the ledger's numbers,
        or ``LedgerError``. The entry is durable on disk when this returns.
        """
        with self.locked():
            releases = self.read()
            after = [*releases, release]
            delta = ledger_delta(policy, after)
            total = _epsilon(tuple(charged_events(after)), delta)
            if total > policy.max_epsilon:
                spent = _epsilon(tuple(charged_events(releases)), delta)
                added = charged_events(after)[len(charged_events(releases)) :]
                alone = _epsilon(tuple(added), delta) if added else 0.0
                raise RoundRefused(
                    "max-epsilon",
                    f"this node's privacy ledger {self.path} has spent epsilon {spent:.4g}; this release "
                    f"(run {release.run_id}, round {release.server_round}) costs {alone:.4g} on its own and would "
                    f"bring the composed epsilon to {total:.4g} > max-epsilon = {policy.max_epsilon:g} "
                    f"(delta = {delta:g}, {LEDGER_ACCOUNTANT} accountant)",
                    policy=True,
                )
            self.write(after)
        logger.info(
            "privacy ledger %s: run %d round %d recorded, epsilon %.4g at delta %g",
            self.path, release.run_id, release.server_round, total, delta,
        )  # fmt: skip
        return total


def record_release(
    node_config: Mapping[str, Any],
    run_id: int,
    ins: RoundInstructions,
    cfg: RunConfig | None,
    *,
    message_type: str,
) -> None:
    """The node's hook, called after the round's checks and before anything is computed or sent.

    Does nothing for a node without a policy (no ledger). Otherwise charges the release described by ``ins`` (the
    instructions this client follows: its own noise std) and ``cfg`` (``None``: ``dp_mod``, charged as a Gaussian
    at ``q = 1``) to the node's ledger, or raises ``dpfedavg.privacy.policy.RoundRefused`` /
    ``LedgerError``.
    """
    if not keeps_ledger(node_config):
        return
    policy = NodePolicy.from_node_config(node_config)
    if not (math.isfinite(ins.noise_std) and ins.noise_std >= 0):
        raise RoundRefused("noise-std", f"this client's noise std {ins.noise_std!r} is not a number >= 0", policy=False)
    private = BOUNDS.get(ins.algorithm) is not None and BOUNDS[ins.algorithm].private
    z = ins.noise_multiplier
    if not (private and math.isfinite(z) and z >= 0):
        z = 0.0  # no noise the accountant can count: charged as a release without noise (epsilon = inf)
    release = Release(
        run_id=int(run_id),
        server_round=int(ins.server_round),
        message_type=str(message_type),
        mechanism=POISSON_GAUSSIAN if cfg is not None else GAUSSIAN,
        noise_multiplier=float(z),
        sampling_rate=float(cfg.sampling_rate) if cfg is not None else None,
        num_rounds=int(cfg.num_rounds) if cfg is not None else None,
        delta=float(cfg.delta) if cfg is not None else None,
        clip=float(ins.clip) if private and math.isfinite(ins.clip) else 0.0,
        placement=cfg.noise_placement if cfg is not None else None,
        noise_std=float(ins.noise_std),
        time=datetime.now(UTC).isoformat(timespec="microseconds"),
    )
    NodeLedger(ledger_path(node_config, policy)).charge(release, policy)
