"""Tests leave no process behind: what a private SuperLink's clean-up finds and stops."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dpfedavg.engines.local_superlink import leftover_pids, processes_with_home, stop_processes


def test_a_detached_process_with_the_private_flwr_home_is_found_and_stopped(tmp_path: Path) -> None:
    """A process in its own session (as the CLI's detached SuperLink) is found by FLWR_HOME, not by PID tree."""
    home = tmp_path / "flwr_home"
    other = tmp_path / "someone_else"
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    ours = subprocess.Popen(sleeper, env={**os.environ, "FLWR_HOME": str(home)}, start_new_session=True)
    theirs = subprocess.Popen(sleeper, env={**os.environ, "FLWR_HOME": str(other)}, start_new_session=True)
    try:
        found = processes_with_home(home)
        assert ours.pid in found and theirs.pid not in found
        stop_processes(found)
        assert ours.wait(timeout=10) is not None
        assert leftover_pids(processes_with_home(home)) == []
        assert theirs.poll() is None  # a process with another FLWR_HOME is left alone
    finally:
        for proc in (ours, theirs):
            proc.kill()
            proc.wait()
