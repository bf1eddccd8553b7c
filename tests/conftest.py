"""Shared fixtures."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM (e.g. an outer ``timeout``) unwinds like Ctrl-C, so fixtures stop the processes they started."""
    raise KeyboardInterrupt(f"signal {signum}")


signal.signal(signal.SIGTERM, _terminate)


@pytest.fixture(autouse=True)
def _flower_task_identity():
    """Let tests create Flower Messages outside a run (Flower needs a task identity)."""
    from dpfedavg.flower.testing import ensure_task_identity

    ensure_task_identity()
    yield


@pytest.fixture(scope="session", autouse=True)
def _no_process_left_behind():
    """After the whole session, stop any child process a test left running (by PID) and say which."""
    yield
    import psutil

    from dpfedavg.engines.local_superlink import stop_processes

    # multiprocessing's resource tracker / forkserver live until this process exits (and ignore SIGTERM)
    helpers = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
    left = {
        p.pid: p
        for p in psutil.Process().children(recursive=True)
        if not any(h in " ".join(p.cmdline()) for h in helpers)
    }
    if left:
        names = ", ".join(f"{p.pid} {p.name()}" for p in left.values() if p.is_running())
        sys.stderr.write(f"\nconftest: stopping processes the tests left behind: {names}\n")
        stop_processes(left)
