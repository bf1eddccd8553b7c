"""File writes that never leave half a file: atomic replacement, and appends that undo themselves on failure.

Every byte the package writes to a run's files goes through `_write_all()` (``os.write``), so a full disk
(ENOSPC) or any other failure is seen in one place:

* `atomic_open()` / `atomic_write_bytes()`: the new content goes to a temporary file in the same
  folder, which is renamed over the old file only once it is complete; a failure leaves the old file intact
  and no temporary file behind.
* `locked()`: an exclusive lock on a lock file beside what is replaced, for a read-modify-write by
  several processes (`atomic_write_bytes()` alone keeps a file whole, not another writer's additions).
* `append_bytes()`: one record (a ``metrics.csv`` row) is appended; if the write fails part-way the file is
  truncated back to its previous length, so it always ends with a complete record. A process killed in the
  middle of the write can still leave a partial last line: readers drop a last line without its terminator
  (`dpfedavg.io.results.read_metrics()`).
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import io
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

__all__ = ["append_bytes", "atomic_open", "atomic_write_bytes", "locked", "write_csv", "write_text"]


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (``os.write`` may write less than asked, e.g. on a filling disk)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


@contextlib.contextmanager
def atomic_open(path: Path, *, durable: bool = False) -> Iterator[BinaryIO]:
    """A binary buffer whose content replaces ``path`` atomically when the block ends without error.

    The content is written to a temporary file in the same folder and renamed over ``path``. ``durable``:
    also flush the file and the rename to disk (``fsync``), so that a crash of the machine leaves the old or
    the new file, never an empty one. If the block or the write raises (a full disk, say), ``path`` is
    untouched and no temporary file is left.
    """
    path = Path(path)
    buffer = io.BytesIO()
    yield buffer
    atomic_write_bytes(path, buffer.getvalue(), durable=durable)


def atomic_write_bytes(path: Path, data: bytes, *, durable: bool = False) -> None:
    """Replace ``path`` with ``data`` atomically (see `atomic_open()`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            _write_all(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        _fsync_folder(path.parent)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``fcntl`` lock on the file ``path`` (created if missing) for the block.

    The lock belongs to this open file: another process, or another ``locked()`` of this one, waits until the
    block ends (or the holder dies: the kernel releases it). Lock a file of its own, not one that is replaced
    by rename.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically: a summary, a table, a report."""
    atomic_write_bytes(path, text.encode("utf-8"))


def write_csv(path: Path, columns: Sequence[str], rows: Iterable[Mapping[str, object]]) -> None:
    """Replace ``path`` with a CSV of ``rows`` under the header ``columns``, atomically (a sweep's summary)."""
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    columns = list(columns)
    known = frozenset(columns)
    writer.writerow(columns)
    for row in rows:  # csv.DictWriter's rows (a missing column is empty, an unknown one an error), faster
        if not known.issuperset(row):
            extra = ", ".join(map(repr, sorted(row.keys() - known)))
            raise ValueError(f"dict contains fields not in fieldnames: {extra}")
        writer.writerow([row.get(column, "") for column in columns])
    write_text(path, text.getvalue())


def append_bytes(path: Path, data: bytes, *, durable: bool = False) -> None:
    """Append ``data`` (one complete record) to ``path``; on failure the file keeps exactly its old content.

    ``durable``: ``fsync`` after the write. Raises what the write raised (``OSError(ENOSPC)`` on a full disk),
    after truncating the file back to its length before the call.
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            _write_all(fd, data)
            if durable:
                os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)
