"""Run the app through the real `flwr run` CLI against a private local SuperLink.

The SuperLink is started here (the same command `flwr run` would use for its
managed local SuperLink) on free ports, with its own ``FLWR_HOME`` and a short
``RAY_TMPDIR``, so it never touches a user's SuperLink (``ray_address``: its
simulations run on that Ray cluster instead of a local Ray). `flwr run` finds it
through ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT``. `LocalSuperLink.stop()`
stops every process it started (SuperLink, SuperExec, simulation, Ray) by PID.
Used by the Flower engine of ``run_sim.py``, the end-to-end tests and the
benchmarks; needs the source checkout (``flwr run`` builds the app from it)
and ``psutil``.

A loaded machine can be too slow for Flower's and Ray's start-up waits (Flower's CLI gives its local
SuperLink 15 s; Ray 2.55 gives a node a fixed 30 s in ``ray/_private/node.py``, which no setting changes).
`retry_startup_once()` runs such a start-up again, once, with a WARNING naming the cause; only a start-up
failure (`STARTUP_FAILURES`, `StartupTimeout`) is retried, never a run that failed or a wrong result.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psutil  # noqa: I001 - optional dependency of the Flower engine

#: The app's source directory (the one with pyproject.toml) that `flwr run` builds.
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
#: What the app needs from the checkout: Flower's config and the package (the FAB's `.py` and `.toml` files).
APP_FILES = ("pyproject.toml", "README.md", "LICENSE")

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: What Flower and Ray print when they did not start in time (a loaded machine), as opposed to a run that failed.
STARTUP_FAILURES = (
    # Flower's CLI: its local SuperLink's 15 s. Also when this module's SuperLink runs but is busy: the CLI probes
    # it with a 0.4 s timeout (flwr/cli/constant.py), then tries to start one of its own on the same port.
    "Failed to start local SuperLink within",
    # Ray: "The current node timed out during startup", a node's fixed 30 s (ray/_private/node.py). Not a bare
    # "node timed out": a results folder so named, echoed in a healthy run's log, was taken for one.
    "node timed out during startup",
)
#: Ray's wait for a raylet to register with its GCS (Ray's C++ side; the Python side's 30 s is fixed). Set for the
#: processes started here unless the environment sets it; it only matters on a machine too slow for the default.
RAY_STARTUP_ENV = {"RAY_raylet_start_wait_time_s": "120"}


class StartupTimeout(TimeoutError):
    """Flower or Ray did not start within its wait: `retry_startup_once()` tries once more."""


def startup_failure(text: str) -> str | None:
    """The first line of ``text`` that says Flower or Ray did not start in time (`STARTUP_FAILURES`), else None."""
    for line in text.splitlines():
        if any(message in line for message in STARTUP_FAILURES):
            return line.strip()
    return None


def retry_startup_once(
    attempt: Callable[[], T],
    what: str,
    *,
    failure: Callable[[T], str | None] = lambda result: None,
    before_retry: Callable[[], None] = lambda: None,
) -> T:
    """``attempt()``, and once more if it was a start-up that timed out, with a WARNING line naming the cause.

    A start-up timed out when ``attempt()`` raises `StartupTimeout` or ``failure(result)`` names a cause (e.g.
    `startup_failure()` of a command's output). Anything else (another exception, a result without such a
    cause) is returned or raised as it is, and the second attempt's outcome is final. ``before_retry()`` cleans
    up what the first attempt left (processes, a half-written run folder).
    """
    try:
        result = attempt()
    except StartupTimeout as err:
        cause = str(err).splitlines()[0] if str(err) else type(err).__name__
    else:
        cause = failure(result)
        if cause is None:
            return result
    logger.warning("%s did not start in time (%s); retrying once (a loaded machine?)", what, cause)
    before_retry()
    return attempt()


def copy_app(dest: Path) -> Path:
    """A copy of dpfedavg's own Flower app (``pyproject.toml`` and the ``dpfedavg`` package) in ``dest``.

    `flwr run <folder>` builds the FAB by walking every file under the folder, ``.venv`` included, before
    it filters them: in a checkout with its virtual environment that walk is about 67,000 files and 6-7 s of
    CPU per run (27 s on a loaded machine). The copy holds the ~100 files the app is made of, so the FAB built
    from it has the same code and configuration.
    """
    dest = Path(dest)
    if (dest / "pyproject.toml").exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    for name in APP_FILES:
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / "dpfedavg", dest / "dpfedavg", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def scripts_first_path() -> str:
    """``PATH`` with this Python's scripts first: Flower starts ``flower-superexec`` and ``flwr-clientapp`` by name,
    so a venv that was not activated (``.venv/bin/python -m ...``) must still find its own."""
    return os.pathsep.join([str(BIN), *filter(None, [os.environ.get("PATH")])])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_processes(known: dict[int, psutil.Process]) -> None:
    """Terminate the still-running processes of ``known`` (by PID), wait, then kill the rest."""
    procs = [p for p in known.values() if p.is_running()]
    _signal(procs, "terminate")
    _, alive = psutil.wait_procs(procs, timeout=10)
    kill_processes(alive, timeout=5)


def kill_processes(procs: list[psutil.Process], timeout: float = 10) -> None:
    """SIGKILL ``procs`` at once (as when their machine dies) and wait for them."""
    _signal(procs, "kill")
    psutil.wait_procs(procs, timeout=timeout)


def _signal(procs: list[psutil.Process], how: str) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            getattr(proc, how)()


def processes_with_home(home: Path) -> dict[int, psutil.Process]:
    """Processes of this user whose environment has ``FLWR_HOME=home``: everything a private SuperLink spawned.

    Catches what a PID tree misses: a SuperLink the ``flwr`` CLI starts detached (it does so when it cannot
    reach the one it expects), Ray workers re-parented to init. ``home`` is unique to one SuperLink, so this
    never matches a user's own Flower processes.
    """
    found: dict[int, psutil.Process] = {}
    me = os.getuid()
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.info["uids"] is None or proc.info["uids"].real != me:
                continue
            if proc.environ().get("FLWR_HOME") == str(home) and proc.pid != os.getpid():
                found[proc.pid] = proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def leftover_pids(known: dict[int, psutil.Process]) -> list[int]:
    """PIDs of ``known`` that still run (zombies do not count)."""
    return [pid for pid, p in known.items() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


class LocalSuperLink:
    """A private simulation SuperLink for tests."""

    #: Seconds `flwr_run()` lets `flwr run --stream` end by itself after its output said that Flower or Ray did not
    #: start in time (the CLI can then wait for the dead simulation's log forever); then it is stopped and retried.
    startup_failure_grace_s = 15.0

    def __init__(
        self, workdir: Path, *, runtime_dependency_install: bool = False, ray_address: str | None = None
    ) -> None:
        if not (ROOT / "pyproject.toml").exists():
            raise RuntimeError(f"the Flower engine needs the dpfedavg source checkout; no pyproject.toml in {ROOT}")
        self.workdir = Path(workdir)
        self.home = self.workdir / "flwr_home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))
        self.http_port = free_port()
        self.control_port = free_port()
        self.env = dict(os.environ)
        self.env.update(
            FLWR_HOME=str(self.home),
            FLWR_TELEMETRY_ENABLED="0",
            FLWR_DISABLE_UPDATE_CHECK="1",
            FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(self.http_port),
            FLWR_LOCAL_CONTROL_API_PORT=str(self.control_port),
            RAY_TMPDIR=str(self.ray_tmp),
            RAY_USAGE_STATS_ENABLED="0",
            PYTHONUNBUFFERED="1",
            PATH=scripts_first_path(),
        )
        for key, value in RAY_STARTUP_ENV.items():
            self.env.setdefault(key, value)
        if not runtime_dependency_install:
            self.env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
        # The simulation's ray.init() attaches to RAY_ADDRESS when it is set (Flower 1.41 has no
        # federation option for it); unset, it starts a private local Ray as before.
        self.env.pop("RAY_ADDRESS", None)
        if ray_address is not None:
            self.env["RAY_ADDRESS"] = ray_address
        self.log_path = self.home / "superlink.log"
        self.process: subprocess.Popen | None = None
        self._known: dict[int, psutil.Process] = {}
        self._runs = 0

    def start(self, timeout: float = 60.0) -> None:
        """Start the SuperLink and wait until it answers; a start that timed out is retried once (new ports)."""
        retry_startup_once(lambda: self._start_once(timeout), "the local SuperLink", before_retry=self._fresh_start)

    def _fresh_start(self) -> None:
        """New ports and Ray folder for a second start (`stop()` removed the first one's)."""
        self.ray_tmp.mkdir(parents=True, exist_ok=True)
        self.http_port, self.control_port = free_port(), free_port()
        self.env.update(
            FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(self.http_port), FLWR_LOCAL_CONTROL_API_PORT=str(self.control_port)
        )

    def _start_once(self, timeout: float) -> None:
        command = [
            str(BIN / "flower-superlink"),
            "--insecure",
            "--simulation",
            "--isolation",
            "subprocess",
            "--control-api-address",
            f"127.0.0.1:{self.control_port}",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.http_port),
            "--database",
            str(self.home / "state.db"),
            "--log-file",
            str(self.log_path),
        ]
        self.process = subprocess.Popen(
            command,
            env=self.env,
            cwd=self.workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"flower-superlink exited with {self.process.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/health", timeout=0.5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise StartupTimeout(f"flower-superlink did not become healthy within {timeout:g}s; see {self.log_path}")

    def _remember_descendants(self) -> None:
        if self.process is None:
            return
        try:
            root = psutil.Process(self.process.pid)
            for proc in [root, *root.children(recursive=True)]:
                self._known[proc.pid] = proc
        except psutil.NoSuchProcess:
            pass

    def flwr_run(
        self,
        run_config: str = "",
        federation_config: str = "",
        timeout: float = 600.0,
        app: Path | None = None,
        run_dir: Path | None = None,
    ) -> subprocess.CompletedProcess:
        """`flwr run <app> --stream` with the given overrides; returns the finished CLI process.

        ``app``: the Flower app's folder (default: dpfedavg's own apps, copied once into this SuperLink's
        work folder by `copy_app()` so that the CLI does not walk the checkout's ``.venv``).
        Refuses to start when this SuperLink is down: the CLI would then start a detached SuperLink of its own.
        A run whose output says that Flower or Ray did not start in time (`STARTUP_FAILURES`) is run once more
        (`retry_startup_once()`); ``run_dir``, the run's results folder, is removed before that if this call
        made it (the failed start may have written its first files there).
        """
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"this local SuperLink is not running (see {self.log_path}); start() it first")
        if app is None:
            app = copy_app(self.workdir / "app")
        command = [str(BIN / "flwr"), "run", str(app), "--stream"]
        if run_config:
            command += ["--run-config", run_config]
        if federation_config:
            command += ["--federation-config", federation_config]
        existed = run_dir is not None and Path(run_dir).exists()

        def clean() -> None:
            if run_dir is not None and not existed:
                shutil.rmtree(run_dir, ignore_errors=True)

        return self.run_command(command, timeout=timeout, before_retry=clean)

    def run_command(
        self,
        command: list[str],
        *,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 600.0,
        before_retry: Callable[[], None] = lambda: None,
    ) -> subprocess.CompletedProcess:
        """A command that runs `flwr run` against this SuperLink (`flwr_run()`'s, or a tutorial's shell block),
        watched as `flwr_run()` watches its own: run once more (`retry_startup_once()`, after ``before_retry()``)
        when its output says that Flower or Ray did not start in time. ``cwd`` and ``env`` default to this
        SuperLink's work folder and environment; the output (stdout and stderr) is the result's ``stdout``."""
        return retry_startup_once(
            lambda: self._flwr_run_once(command, timeout, cwd=cwd, env=env),
            "flwr run's simulation (Flower's local SuperLink or Ray)",
            failure=lambda result: startup_failure(result.stdout),
            before_retry=before_retry,
        )

    def _flwr_run_once(
        self, command: list[str], timeout: float, *, cwd: Path | None = None, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        # The CLI's output goes to a file: a pipe that is only read at the end would fill up
        # (64 KiB) on a long run and block `flwr run` forever.
        self._runs += 1
        log_path = self.workdir / f"flwr-run-{self._runs}.log"
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                command, env=env or self.env, cwd=cwd or self.workdir, stdout=log, stderr=subprocess.STDOUT
            )
            deadline = time.monotonic() + timeout
            failed_at: float | None = None
            seen, tail = 0, ""
            while proc.poll() is None:
                self._remember_descendants()  # Ray workers may be re-parented once the run ends
                if failed_at is None:  # only the new output is read (a long run's log is not read again each time)
                    with log_path.open("rb") as new_output:
                        new_output.seek(seen)
                        data = new_output.read()
                    seen, chunk = seen + len(data), data.decode(errors="replace")
                    if startup_failure(tail + chunk):
                        failed_at = time.monotonic()  # the simulation died starting Ray: `--stream` may wait forever
                    tail = (tail + chunk)[-200:]
                dead = failed_at is not None and time.monotonic() > failed_at + self.startup_failure_grace_s
                if time.monotonic() > deadline or dead:
                    proc.kill()
                    proc.wait()
                    out = log_path.read_text(errors="replace")
                    if failed_at is not None:
                        return subprocess.CompletedProcess(command, proc.returncode, out, "")
                    raise TimeoutError(f"flwr run did not finish within {timeout}s:\n{out[-5000:]}")
                time.sleep(0.5)
        out = log_path.read_text(errors="replace")
        return subprocess.CompletedProcess(command, proc.returncode, out, "")

    def stop(self) -> None:
        """Terminate every process this SuperLink started (by PID), then the SuperLink.

        Also every process carrying this SuperLink's private ``FLWR_HOME`` (`processes_with_home()`).
        """
        self._remember_descendants()
        self._known.update(processes_with_home(self.home))
        stop_processes(self._known)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)

    def leftover_pids(self) -> list[int]:
        """PIDs of processes started by this SuperLink that still run (should be empty after stop)."""
        return leftover_pids({**self._known, **processes_with_home(self.home)})

    def __enter__(self) -> LocalSuperLink:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
