"""Shared fixtures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _flower_task_identity():
    """Let tests create Flower Messages outside a run (Flower needs a task identity)."""
    from dpfedavg.testing import ensure_task_identity

    ensure_task_identity()
    yield
