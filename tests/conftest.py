"""Shared fixtures."""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

pytest_plugins = ["pytester"]

#: multiprocessing's resource tracker and forkserver live until this process exits (and ignore SIGTERM).
_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
#: Seconds a child started by a test may take to exit after the test ends before it counts as leaked.
_EXIT_GRACE_S = 5.0


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM (e.g. an outer ``timeout``) unwinds like Ctrl-C, so fixtures stop the processes they started."""
    raise KeyboardInterrupt(f"signal {signum}")


signal.signal(signal.SIGTERM, _terminate)


def _children() -> dict:
    import psutil

    out = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE or any(h in " ".join(proc.cmdline()) for h in _HELPERS):
                continue
            out[proc.pid] = proc
        except psutil.NoSuchProcess:
            continue
    return out


@pytest.fixture(autouse=True)
def _flower_task_identity():
    """Let tests create Flower Messages outside a run (Flower needs a task identity)."""
    from dpfedavg.flower.testing import ensure_task_identity

    ensure_task_identity()
    yield


#: The longest tests (2026-11-26, fresh clone: 70-185 s each, mostly waiting on processes), started first: xdist
#: hands out the first quarter of the tests round-robin, so each goes to its own worker at once instead of one of
#: them starting late and ending the suite minutes after the other workers (docs/development/benchmarks.md).
LONGEST_FIRST = (
    "tests/test_deployment.py::test_run_survives_a_killed_supernode_and_counts_the_dropout[secure-aggregation]",
    "tests/test_multihost.py::test_the_guide_runs_across_four_hosts",
    "tests/test_examples.py::test_the_dp_example_with_flwr_run",
)


def pytest_collection_modifyitems(config, items) -> None:
    """`LONGEST_FIRST` at the front, in that order; every other test keeps its place."""
    rank = {nodeid: i for i, nodeid in enumerate(LONGEST_FIRST)}
    first = sorted(
        (item for item in items if item.nodeid.split("@")[0] in rank), key=lambda i: rank[i.nodeid.split("@")[0]]
    )
    items[:] = first + [item for item in items if item.nodeid.split("@")[0] not in rank]


@pytest.fixture(autouse=True)
def _package_logger_restored():
    """The ``dpfedavg`` logger's level, propagation and handlers as they were before the test.

    A test whose code sets them (a sweep's quiet workers run in-process, a Flower app routes the records through
    Flower's handler) must not decide what a later test on the same xdist worker sees: a level left at WARNING
    hid the DP statement from the next test's log.
    """
    import logging

    logger = logging.getLogger("dpfedavg")
    saved = (logger.level, logger.propagate, list(logger.handlers), logger.disabled)
    yield
    level, logger.propagate, handlers, logger.disabled = saved
    logger.handlers[:] = handlers
    logger.setLevel(level)  # setLevel: it also clears the children's cached levels


@pytest.fixture(autouse=True)
def _node_home(tmp_path_factory, monkeypatch):
    """Every test's in-process SuperNodes keep their privacy ledgers in a home of their own (never ~/.flwr)."""
    home: list[Path] = []

    def node_home() -> Path:
        if not home:
            home.append(tmp_path_factory.mktemp("flwr-home"))
        return home[0]

    monkeypatch.setattr("dpfedavg.privacy.ledger.node_home", node_home)
    yield


@pytest.fixture(autouse=True)
def _no_process_leaked():
    """A test that leaves a child process running fails, naming it (after stopping it).

    Children of fixtures with a wider scope (a shared SuperLink) exist before the test starts and are
    not counted.
    """
    import psutil

    before = set(_children())
    yield
    new = [proc for pid, proc in _children().items() if pid not in before]
    if not new:
        return
    _, alive = psutil.wait_procs(new, timeout=_EXIT_GRACE_S)
    left = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    if left:
        from dpfedavg.engines.local_superlink import stop_processes

        names = ", ".join(f"{p.pid} {p.name()} ({' '.join(p.cmdline())[:120]})" for p in left)
        stop_processes({p.pid: p for p in left})
        pytest.fail(f"the test left processes running (now stopped): {names}", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _no_process_left_behind():
    """After the whole session, stop any child process still running (by PID) and say which: a safety net."""
    yield
    left = _children()
    if left:
        from dpfedavg.engines.local_superlink import stop_processes

        names = ", ".join(f"{p.pid} {p.name()}" for p in left.values() if p.is_running())
        sys.stderr.write(f"\nconftest: stopping processes the tests left behind: {names}\n")
        stop_processes(left)


@pytest.fixture
def dpfedavg_log():
    """The records the ``dpfedavg`` loggers emit during the test (WARNING and up), whatever the root's handlers.

    A Flower app process stops ``dpfedavg``'s records from reaching the root logger (``setup_app_process``), so
    ``caplog`` misses them once any test in the session has run a ClientApp; the handler sits on ``dpfedavg`` itself
    (``log_records.package_records``).
    """
    from log_records import package_records

    with package_records(logging.WARNING) as records:
        yield records


@pytest.fixture
def dp_log(caplog):
    """dpfedavg's log records (in an app its logger writes through Flower's handler and does not propagate)."""
    logger = logging.getLogger("dpfedavg")
    caplog.set_level(logging.INFO, logger="dpfedavg")  # whatever level an earlier test or app left on it
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.fixture(scope="session")
def base_install(tmp_path_factory) -> Path:
    """The Python of a venv with ``pip install -e .`` and no extras (what the README's install gives).

    Made with uv (a dependency of flwr, and what ``flwr run`` uses for every run), from the same uv cache the
    ``flwr run`` tests fill; built once per session and worker: mark its tests ``xdist_group("base-install")``
    so they share one worker.
    """
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert uv, "uv comes with flwr"
    venv = tmp_path_factory.mktemp("base-install") / "base"
    subprocess.run([uv, "venv", "-q", "-p", sys.executable, str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([uv, "pip", "install", "-q", "--python", str(python), "-e", str(root)], check=True, timeout=600)
    missing = subprocess.run([str(python), "-c", "import torch"], capture_output=True)
    assert missing.returncode != 0  # the base install really lacks the optional packages
    return python
