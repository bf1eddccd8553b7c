"""Whether this process does its math on one thread (a Flower app process: parallelism comes from the processes).

`dpfedavg.flower.runtime.setup_app_process()` marks a ClientApp / ServerApp process; the torch tasks
read `single_threaded()` to use one CPU thread too. A flag of its own, below every layer that reads it.
"""

from __future__ import annotations

__all__ = ["mark_single_threaded", "single_threaded"]

_single = False


def mark_single_threaded() -> None:
    """Record that this process runs its math on one thread."""
    global _single
    _single = True


def single_threaded() -> bool:
    """Whether `mark_single_threaded()` ran in this process."""
    return _single
