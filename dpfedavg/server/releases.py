"""The server's write-ahead record of its releases: every round it starts is charged, redone rounds included.

With ``secure-noise`` a round's noise and cohort come from the OS CSPRNG, so a round redone after a crash
(it ran after the last checkpoint, the server died, the resumed run runs it again) is a *fresh* release: new
cohort, new noise, on the same clients' data. Nobody can make it equal the first attempt, and the first
attempt's replies and sum were seen by the server, so both are charged.

Before a round's messages leave the server, ``ReleaseLog.write`` appends one line to
``<run dir>/releases.jsonl`` and ``fsync``s it (``dpfedavg.io.atomic.append_bytes``)::

    {"release": 9, "round": 6, "q": 0.4167, "z": 1.23}

``release`` counts every round started (1, 2, ...), ``round`` is the run's round and ``(q, z)`` the event the
accountant charges for it (the plan's: every round is charged the nominal event, see
``dpfedavg.io.checkpoint``). A resumed run reads the record (``ReleaseLog.resume``): the releases
after the checkpoint's are the rounds the crash made it redo, and the accountant is rebuilt with one event per
line, so the reported epsilon, ``max-epsilon``, ``config.json`` and ``metrics.csv``'s epsilon column cover every
release. A missing or edited record is one ``dpfedavg.io.checkpoint.CheckpointError``; lines added at
the end are accepted (they can only raise the reported epsilon).

A seeded run on the batched engine (``secure-noise = false``; the server simulates every client) writes no
record and charges no redone round: a round's cohort, every client's noise and the server's noise derive from
``(seed, stream, round)`` (``dpfedavg.core.seeding``) and the round's input ``w_k`` comes from the checkpoint, so
in a redone round every client sends bit for bit what it sent in the first attempt and the server's release is
computed from those same replies: nothing new about the clients' data. A seeded *Flower* run keeps the record
and charges every redone round (issue 46): its nodes are not the server's, and a node whose policy demands noise
(``secure-noise`` in its node config, `dpfedavg.privacy.policy`) draws its own from the OS CSPRNG whatever the
seed, so its redone rounds are fresh releases the server cannot rule out (``tests/test_release_log.py``: 19
releases reported as 19, not as the 10 rounds; seeded nodes still send bit-identical replies).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from dpfedavg.errors import ResultsError
from dpfedavg.io.atomic import append_bytes, atomic_write_bytes
from dpfedavg.io.checkpoint import CheckpointError
from dpfedavg.privacy.plan import PrivacyPlan

__all__ = ["RELEASES_FILE", "ReleaseLog", "ReleaseRecord", "charges_redone_rounds"]

logger = logging.getLogger(__name__)

#: The write-ahead record's file in the run directory.
RELEASES_FILE = "releases.jsonl"
_KEYS = ("release", "round", "q", "z")


def charges_redone_rounds(secure_noise: bool, plan: PrivacyPlan) -> bool:
    """Whether a run keeps the write-ahead record: a private run whose noise nobody can replay (``secure-noise``,
    or a Flower run, whose nodes may draw their own: see the module docstring)."""
    return secure_noise and plan.dp


@dataclass(frozen=True)
class ReleaseRecord:
    """One line of ``releases.jsonl``: the ``release``-th round started, the run's ``round``, its event ``(q, z)``."""

    release: int
    round: int
    q: float
    z: float

    def line(self) -> bytes:
        return (json.dumps({key: getattr(self, key) for key in _KEYS}) + "\n").encode("utf-8")


class ReleaseLog:
    """``<run dir>/releases.jsonl``: written before each round is sent, read on resume.

    Parameters
    ----------
    path:
        The file.
    plan:
        The run's privacy plan: each line's ``(q, z)``.
    records:
        The lines already there (a resumed run's, checked by ``resume``).
    """

    def __init__(self, path: Path | None, plan: PrivacyPlan, records: list[ReleaseRecord] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.q, self.z = float(plan.q), float(plan.noise_multiplier)
        self.records: list[ReleaseRecord] = list(records or [])

    @property
    def count(self) -> int:
        """Rounds started so far, each one a release the accountant charges."""
        return len(self.records)

    # ---------------------------------------------------------------------------------------- a new run
    @classmethod
    def pending(cls, plan: PrivacyPlan) -> ReleaseLog:
        """A run's record before its directory is open: the server gets it when it is made, before anything is
        written; the session then gives it its file (`open_new()` or `open_resumed()`), before round 1."""
        return cls(None, plan)

    def open_new(self, directory: Path) -> None:
        """A new run's empty record, created durably (the file and its folder entry are on disk)."""
        path = Path(directory) / RELEASES_FILE
        atomic_write_bytes(path, b"", durable=True)
        self.path, self.records = path, []

    def open_resumed(self, directory: Path, plan: PrivacyPlan, *args: int) -> None:
        """A resumed run's record, read and checked (`resume()`, with its arguments after ``plan``)."""
        read = self.resume(directory, plan, *args)
        self.path, self.records = read.path, read.records

    # ------------------------------------------------------------------------------------------ a round
    def write(self, server_round: int) -> None:
        """Record that ``server_round`` starts, on disk (``fsync``), before anything of it leaves the server.

        Raises
        ------
        dpfedavg.errors.ResultsError
            The line could not be written (a full disk): the round is not sent, the run stops.
        """
        if self.path is None:
            raise RuntimeError("the record of releases has no file yet: the run's session opens it before round 1")
        record = ReleaseRecord(self.count + 1, int(server_round), self.q, self.z)
        try:
            append_bytes(self.path, record.line(), durable=True)
        except OSError as err:
            raise ResultsError(
                f"could not write round {server_round}'s line of {self.path} ({err.strerror or err}); the run stops "
                "before the round is sent (with secure-noise every round is recorded before it is released). Free "
                "space and rerun with resume=true to continue from the last checkpoint"
            ) from None
        self.records.append(record)

    # ------------------------------------------------------------------------------------------- resume
    @classmethod
    def resume(
        cls,
        directory: Path,
        plan: PrivacyPlan,
        checkpoint_round: int,
        checkpoint_releases: int,
        rows_after_checkpoint: int = 0,
    ) -> ReleaseLog:
        """Read and check the record of a run resumed from the checkpoint after ``checkpoint_round``.

        ``checkpoint_releases`` is the number of releases charged when the checkpoint was written. The record must
        hold them, line ``checkpoint_releases`` being round ``checkpoint_round`` and the next line (if any) the
        round after it; every line numbered in order, from round 1, each round at most one after the previous
        (a resume goes back to a checkpoint), with the plan's ``(q, z)``; and at least ``rows_after_checkpoint``
        lines after the checkpoint's (``metrics.csv``'s rows of rounds after it: they were released). A partial
        last line (a process killed while writing it, before the round was sent) is dropped, with a warning.
        Lines after the checkpoint's that were removed together with their ``metrics.csv`` rows cannot be told
        from rounds that never started.

        Raises
        ------
        dpfedavg.io.checkpoint.CheckpointError
            The file is missing, a line is malformed or out of order, or it disagrees with the checkpoint: the
            rounds the crash made this run redo could not be counted.
        """
        path = Path(directory) / RELEASES_FILE
        where = f"cannot resume: the write-ahead record of releases {path}"
        if not path.exists():
            raise CheckpointError(
                f"{where} is missing; with secure-noise every round started is recorded there before it is sent, "
                "and without it the rounds redone after the crash (fresh releases) cannot be charged. Start a new run"
            )
        data = path.read_bytes()
        complete, _, partial = data.rpartition(b"\n")
        records: list[ReleaseRecord] = []
        for number, raw in enumerate(complete.split(b"\n") if complete else [], start=1):
            records.append(cls._parse(raw, number, records[-1] if records else None, plan, where))
        n = checkpoint_releases
        if n > len(records) or records[n - 1].round != checkpoint_round:
            found = f"line {n} is round {records[n - 1].round}" if n <= len(records) else f"it has {len(records)} lines"
            raise CheckpointError(
                f"{where} disagrees with the checkpoint: the checkpoint after round {checkpoint_round} was written "
                f"after release {n} (that round's), but {found}; an edited or truncated record would hide releases"
            )
        if len(records) - n < rows_after_checkpoint:
            raise CheckpointError(
                f"{where} has {len(records) - n} line(s) after the checkpoint's (round {checkpoint_round}), but "
                f"metrics.csv holds the rows of {rows_after_checkpoint} round(s) after it, each released; an edited "
                "or truncated record would hide releases"
            )
        if len(records) > n and records[n].round != checkpoint_round + 1:
            raise CheckpointError(
                f"{where}: line {n + 1} is round {records[n].round}, but the round started after the checkpoint's "
                f"round {checkpoint_round} is {checkpoint_round + 1}"
            )
        if partial:  # checked first: a refused resume leaves the file as it found it
            logger.warning(
                "%s: dropping a partial last line (its write never finished, so its round was not sent)", path
            )
            atomic_write_bytes(path, complete + b"\n" if complete else b"", durable=True)
        return cls(path, plan, records)

    @staticmethod
    def _parse(raw: bytes, number: int, previous: ReleaseRecord | None, plan: PrivacyPlan, where: str) -> ReleaseRecord:
        try:
            fields = json.loads(raw)
        except ValueError:
            fields = None
        ok = isinstance(fields, dict) and set(fields) == set(_KEYS)
        ok = ok and all(isinstance(fields[k], int) and not isinstance(fields[k], bool) for k in ("release", "round"))
        ok = ok and all(isinstance(fields[k], int | float) and not isinstance(fields[k], bool) for k in ("q", "z"))
        if not ok:
            raise CheckpointError(
                f'{where}: line {number} = {raw[:120]!r} is not a record {{"release", "round", "q", "z"}}'
            )
        record = ReleaseRecord(fields["release"], fields["round"], float(fields["q"]), float(fields["z"]))
        low_round = 1
        high_round = 1 if previous is None else previous.round + 1
        if record.release != number or not low_round <= record.round <= high_round:
            raise CheckpointError(
                f"{where}: line {number} is release {record.release} of round {record.round}; expected release "
                f"{number} of a round in {low_round}..{high_round} (rounds go up by one, or back after a resume)"
            )
        if (record.q, record.z) != (float(plan.q), float(plan.noise_multiplier)):
            raise CheckpointError(
                f"{where}: line {number} charges (q, z) = ({record.q!r}, {record.z!r}), the run's plan is "
                f"({float(plan.q)!r}, {float(plan.noise_multiplier)!r})"
            )
        return record
