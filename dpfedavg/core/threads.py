"""How many threads this process may use for its math: one in a Flower app process, else its CPU share.

`dpfedavg.flower.runtime.setup_app_process()` marks a ClientApp / ServerApp process (`mark_single_threaded()`:
parallelism comes from the processes); the torch tasks read `single_threaded()` to use one CPU thread too.
`cpu_share()` is the number of CPUs this process may run on (its affinity mask, which a container's or a
scheduler's CPU set restricts; not ``os.cpu_count()``, the machine's), or 1 in a marked process. A module of
its own, below every layer that reads it.
"""

from __future__ import annotations

import os

__all__ = ["cpu_share", "mark_single_threaded", "single_threaded"]

_single = False


def mark_single_threaded() -> None:
    """Record that this process runs its math on one thread."""
    global _single
    _single = True


def single_threaded() -> bool:
    """Whether `mark_single_threaded()` ran in this process."""
    return _single


def cpu_share() -> int:
    """The CPUs this process may use for threads: 1 when `single_threaded()`, else the CPUs it may run on."""
    if _single:
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - no affinity mask (macOS, Windows)
        return max(1, os.cpu_count() or 1)
