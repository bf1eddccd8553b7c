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
    from dpfedavg.testing import ensure_task_identity

    ensure_task_identity()
    yield
