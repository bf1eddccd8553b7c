"""Atomic file writes: a file is either its old content or its new content, never half of each."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_open", "atomic_write_bytes"]


@contextlib.contextmanager
def atomic_open(path: Path, *, durable: bool = False) -> Iterator[BinaryIO]:
    """A binary file handle whose content replaces ``path`` atomically when the block ends without error.

    It writes to a temporary file in the same folder and renames it over ``path``. ``durable``: also
    flush the file and the rename to disk (``fsync``), so that a crash of the machine leaves the old or
    the new file, never an empty one. If the block raises (a full disk, say), ``path`` is untouched and
    no temporary file is left.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)


def atomic_write_bytes(path: Path, data: bytes, *, durable: bool = False) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_open`)."""
    with atomic_open(path, durable=durable) as fh:
        fh.write(data)
