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

Values are written through a temporary file and an atomic rename (a reader never sees half a file); two
processes writing at once may lose one of their new entries, which is then computed again. JSON keeps
every float exactly (``repr``), so a cached value is bit for bit the computed one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from functools import lru_cache
from importlib import metadata
from pathlib import Path

__all__ = ["CACHE_ENV", "cache_file", "cached", "clear_memory"]

logger = logging.getLogger(__name__)

#: Environment variable: the cache folder, or ``off`` (also ``0``, ``false``, ``no``) for no disk cache.
CACHE_ENV = "DPFEDAVG_PRIVACY_CACHE"
#: Bump when the meaning of a cached value changes without the accounting module's source changing.
FORMAT = 1

_memory: dict[str, float] = {}
_lock = threading.Lock()


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


def _load(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.get("values", {}).items()} if isinstance(data, dict) else {}


def _store(path: Path, key: str, value: float) -> None:
    from dpfedavg.io.atomic import atomic_write_bytes

    values = _load(path)
    values[key] = value
    payload = {"code": _code_version(), "values": dict(sorted(values.items()))}
    try:
        atomic_write_bytes(path, (json.dumps(payload, indent=1) + "\n").encode())
    except OSError as err:  # a read-only home: the value stays in memory
        logger.debug("privacy cache not written to %s (%s)", path, err)


def cached(kind: str, args: tuple, compute: Callable[[], float]) -> float:
    """``compute()``, or the value cached for ``(kind, args)`` by this code version (memory, then disk).

    ``args`` must be JSON numbers and strings that determine the result completely.
    """
    key = f"{kind}{json.dumps(list(args))}"
    with _lock:
        if key in _memory:
            return _memory[key]
    path = cache_file()
    if path is not None:
        found = _load(path).get(key)
        if found is not None:
            with _lock:
                _memory[key] = found
            return found
    value = float(compute())
    with _lock:
        _memory[key] = value
    if path is not None:
        _store(path, key, value)
    return value


def clear_memory() -> None:
    """Forget the in-memory values (the disk cache stays); for tests."""
    with _lock:
        _memory.clear()
