"""Tests leave no process behind: what a private SuperLink's clean-up finds and stops."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_a_test_that_leaks_a_process_fails_naming_it(pytester: pytest.Pytester) -> None:
    """The suite's own leak check (conftest.py) can fail: a test that leaves a child running errors, named."""
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(
        test_leaky="""
import subprocess, sys

def test_leaks_a_sleeper():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # leaked-on-purpose"])

def test_cleans_up():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
"""
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*the test left processes running*leaked-on-purpose*"])


def test_the_tests_started_first_exist() -> None:
    """conftest's `LONGEST_FIRST` names tests by node id: a renamed test or parameter id would silently lose its early
    start (and the suite its margin under 12 minutes). Each named function is defined in its file, and each
    parameter id is written there."""
    import ast

    tests = Path(__file__).parent
    tree = ast.parse((tests / "conftest.py").read_text())
    (names,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "LONGEST_FIRST" for t in node.targets)
    ]
    assert names
    for nodeid in names:
        path, _, function = nodeid.partition("::")
        function, _, param = function.partition("[")
        source = (tests.parent / path).read_text()
        defined = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
        assert function in defined, nodeid
        assert not param or f'"{param.rstrip("]")}"' in source, nodeid


def test_federations_find_flowers_scripts_without_an_activated_venv(tmp_path: Path, monkeypatch) -> None:
    """The SuperLink starts `flower-superexec` by name: with `.venv/bin/python -m pytest` (no activated venv) it
    exited with 3 ("No such file or directory: 'flower-superexec'"). What it starts sees this Python's scripts first."""
    from dpfedavg.deploy.loopback import LoopbackFederation
    from dpfedavg.engines.local_superlink import BIN, LocalSuperLink

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    link = LocalSuperLink(tmp_path / "link")
    link.ray_tmp.rmdir()
    for env in (link.env, LoopbackFederation(tmp_path / "loopback", num_supernodes=1).env):
        first = env["PATH"].split(os.pathsep)[0]
        assert first == str(BIN) and (Path(first) / "flower-superexec").exists()
        assert env["PATH"].endswith("/usr/bin:/bin")
