"""A cache of privacy computations, across runs and across invocations, keyed by the dp-accounting version.

A sweep's cells share few privacy settings: the paper's Figures 1-3 grid has one ``(epsilon, delta, q, K,
accountant)`` for its 162 runs, Table 1 two. Calibrating ``z`` (a bisection over PLD compositions, seconds)
and the epsilon of ``K`` rounds at ``z`` (a PLD self-composition, up to a second at ``q < 1``) are pure
functions of those numbers and of the accountant's code, so they are computed once and kept:

* in memory, for the rest of the process;
* on disk, in ``$DPFEDAVG_PRIVACY_CACHE`` (default ``~/.cache/dpfedavg/privacy``), in a JSON file whose name
  holds the dp-accounting version and a hash of the accountants' and the calibration's source
  (`dpfedavg.privacy.accountants`, `dpfedavg.privacy.calibration`): another
  dp-accounting release, or any change to how this package accounts, starts a new file, so a value is
  never reused by code that would compute it differently. ``DPFEDAVG_PRIVACY_CACHE=off`` disables the disk.

A run reads its epsilon every round (``K`` keys per run), so neither reading nor writing may cost a pass
over the file per key:

* **Reading.** A process parses the file once; it parses it again only when a key is missing from memory
  and the file changed since (its inode, size or modification time: another process wrote keys).
* **Writing.** New keys are written in batches (`flush()`): at the first new key, then once `FLUSH_KEYS` keys
  are waiting or `FLUSH_SECONDS` passed since the last write, and when the process exits (``atexit``, and
  the exit of a forked ``multiprocessing`` worker, which skips ``atexit``). A write holds a lock file beside the
  cache (``<file>.lock``), reads the file again, adds its keys to what other processes wrote and replaces the
  file through a temporary file and an atomic rename (`dpfedavg.io.atomic`): a reader never sees half a file,
  and no writer drops another's keys. A crash loses at most the keys not yet written, which are then
  computed again: a value is only ever the computed one. JSON keeps every float exactly (``repr``), so a
  cached value is bit for bit the computed one.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from functools import lru_cache
from importlib import metadata
from multiprocessing import util as mp_util
from pathlib import Path

__all__ = ["CACHE_ENV", "FLUSH_KEYS", "FLUSH_SECONDS", "Prefetch", "cache_file", "cached", "clear_memory", "flush",
           "prefetch"]

logger = logging.getLogger(__name__)

#: Environment variable: the cache folder, or ``off`` (also ``0``, ``false``, ``no``) for no disk cache.
CACHE_ENV = "DPFEDAVG_PRIVACY_CACHE"
#: Bump when the meaning of a cached value changes without the accounting module's source changing.
FORMAT = 1
#: New keys are written once this many are waiting ...
FLUSH_KEYS = 256
#: ... or this many seconds after the last write (and at exit).
FLUSH_SECONDS = 1.0

_memory: dict[str, float] = {}
_lock = threading.RLock()  # guards _memory, _stamps, _pending, _last_write
_stamps: dict[Path, tuple[int, int, int]] = {}  # file -> (inode, size, mtime_ns) when last parsed or written
_pending: dict[Path, dict[str, float]] = {}  # file -> keys computed here and not yet written
_hooked_pid: int | None = None  # the process whose exit writes the pending keys (`_exit_hook()`)
_last_write: float | None = None  # time.monotonic() of this process's last write (None: none yet)
_inflight: dict[str, threading.Event] = {}  # key -> set when the thread computing it is done (`cached()`)
#: ``(kind, args)`` -> the value `cached()` returned in this process: a hit without the key's JSON (a run reads
#: its epsilon every round, and the runs of a sweep's batch read the same keys).
_by_args: dict[tuple[str, tuple], float] = {}


@lru_cache(maxsize=1)
def _code_version() -> str:
    """``dp-accounting <version>, accounting <hash of the accounting sources>, format <FORMAT>``, a file-name tag."""
    try:
        version = metadata.version("dp-accounting")
    except metadata.PackageNotFoundError:  # pragma: no cover - a dependency
        version = "unknown"
    here = Path(__file__).resolve().parent
    source = b"".join((here / name).read_bytes() for name in ("accountants.py", "calibration.py"))
    return f"dp-accounting-{version}-accounting-{hashlib.sha256(source).hexdigest()[:12]}-format{FORMAT}"


def cache_file() -> Path | None:
    """The disk cache of this dp-accounting version and accounting code (``None`` when disabled)."""
    where = os.environ.get(CACHE_ENV, "").strip()
    if where.lower() in ("off", "0", "false", "no"):
        return None
    folder = Path(where).expanduser() if where else Path.home() / ".cache" / "dpfedavg" / "privacy"
    return folder / f"{_code_version()}.json"


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _load(path: Path) -> dict[str, float]:
    """Every value in the file (none if it is missing or not a cache file: it is then rewritten whole)."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or not isinstance(data.get("values"), dict):
        return {}
    values = {}
    for key, value in data["values"].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            values[key] = float(value)
    return values


def _refresh(path: Path) -> None:
    """Read the file into memory if it changed since this process last read or wrote it (call under _lock)."""
    stamp = _stamp(path)
    if stamp is None or stamp == _stamps.get(path):
        return
    _memory.update(_load(path))
    _stamps[path] = stamp


def _write(path: Path, new: dict[str, float]) -> None:
    """Add ``new`` to the file, under its lock, keeping every key other processes wrote (call under _lock)."""
    from dpfedavg.io.atomic import atomic_write_bytes, locked

    with locked(path.with_name(path.name + ".lock")):
        values = _load(path)
        added = {k: v for k, v in new.items() if k not in values}
        if added:
            values.update(added)
            payload = {"code": _code_version(), "values": dict(sorted(values.items()))}
            atomic_write_bytes(path, (json.dumps(payload, indent=1) + "\n").encode())
        _memory.update(values)
        stamp = _stamp(path)
        if stamp is not None:
            _stamps[path] = stamp


def flush() -> None:
    """Write the keys computed in this process and not yet on disk (batched by `cached()`; also at exit)."""
    global _last_write
    with _lock:
        if not _pending:
            return
        for path, new in list(_pending.items()):
            try:
                _write(path, new)
            except OSError as err:  # a read-only home: the values stay in memory
                logger.debug("privacy cache not written to %s (%s)", path, err)
            del _pending[path]
        _last_write = time.monotonic()


def cached(kind: str, args: tuple, compute: Callable[[], float]) -> float:
    """``compute()``, or the value cached for ``(kind, args)`` by this code version (memory, then disk).

    ``args`` must be JSON numbers and strings that determine the result completely.
    """
    value = _by_args.get((kind, args))
    if value is None:
        value = _by_args[(kind, args)] = _cached(kind, args, compute)
    return value


def _cached(kind: str, args: tuple, compute: Callable[[], float]) -> float:
    key = f"{kind}{json.dumps(list(args))}"
    with _lock:
        if key in _memory:
            return _memory[key]
        path = cache_file()
        if path is not None:
            _refresh(path)
            if key in _memory:
                return _memory[key]
        other = _inflight.get(key)
        if other is None:
            _inflight[key] = mine = threading.Event()
    if other is not None:  # another thread (a `prefetch()`) is computing this key: wait for its value
        other.wait()
        with _lock:
            if key in _memory:
                return _memory[key]
        return float(compute())  # it failed: compute here
    try:
        value = float(compute())
    finally:
        with _lock:
            _inflight.pop(key, None)
        mine.set()
    with _lock:
        value = _memory.setdefault(key, value)  # another thread's equal value, if it came first
        if path is not None:
            _pending.setdefault(path, {})[key] = value
            _exit_hook()
            waiting = sum(len(keys) for keys in _pending.values())
            if _last_write is None or waiting >= FLUSH_KEYS or time.monotonic() - _last_write >= FLUSH_SECONDS:
                flush()
    return value


class Prefetch:
    """A daemon thread computing `cached()` values ahead of the caller (see `prefetch()`); ``stop()`` ends it."""

    def __init__(self, kind: str, args: list[tuple], compute: Callable[[tuple], float]) -> None:
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(kind, args, compute), daemon=True, name="prefetch")
        self.thread.start()

    def _run(self, kind: str, args: list[tuple], compute: Callable[[tuple], float]) -> None:
        for one in args:
            if self._stop.is_set():
                return
            try:
                cached(kind, one, lambda one=one: compute(one))
            except Exception as err:  # noqa: BLE001 - the caller computes (and raises) the value itself
                logger.debug("prefetch of %s%s stopped: %s", kind, one, err)
                return

    def stop(self) -> None:
        self._stop.set()


def prefetch(kind: str, args: list[tuple], compute: Callable[[tuple], float]) -> Prefetch:
    """Compute ``cached(kind, a, lambda: compute(a))`` for each ``a`` of ``args``, in order, in a daemon thread.

    A caller that asks `cached()` for a key the thread is computing waits for that value instead of computing
    it again; a key already computed is read from memory. The values are the ones `cached()` would compute
    (the same function), so prefetching changes when a value is computed, never what it is. Worth it where the
    caller's thread mostly waits on something else (a GPU): the PLD epsilon of round ``k`` of a run on a cold
    cache is 20-110 ms of numpy FFTs, which release the GIL.
    """
    return Prefetch(kind, list(args), compute)


def clear_memory() -> None:
    """Write what is pending, then forget the in-memory values (the disk cache stays), as a new process; for tests."""
    global _last_write
    with _lock:
        flush()
        _memory.clear()
        _by_args.clear()
        _stamps.clear()
        _last_write = None


def _exit_hook() -> None:
    """Make sure this process writes its pending keys when it exits (call under _lock, with a key pending).

    ``atexit`` covers an interpreter that exits (a spawned worker too); a forked ``multiprocessing`` worker
    ends by ``os._exit`` after running the finalizers registered since it started, so one is registered here,
    once per process, at its first pending key.
    """
    global _hooked_pid
    if _hooked_pid != os.getpid():
        mp_util.Finalize(None, flush, exitpriority=10)
        _hooked_pid = os.getpid()


def _after_fork() -> None:  # a forked child: a fresh lock (another thread may have held it at the fork)
    global _lock
    _lock = threading.RLock()
    _inflight.clear()  # the threads computing them are not in the child


atexit.register(flush)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
