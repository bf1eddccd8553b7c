"""The approving SuperNode under a supervisor: it comes back by itself after a crash, and leaves nothing behind.

``python -m dpfedavg.deploy supernode ...`` runs the SuperNode (`dpfedavg.deploy.approval.run_supernode`) in a
child process and watches it (issue 47):

* **Activation retried.** A SuperNode restarted soon after it died is refused by the SuperLink, which still
  counts the dead node as active until it misses its heartbeats (Flower: ``Exit Code: 305`` "Failed to activate
  SuperNode", observed 20 s after a ``kill -9``, the node marked offline 47 s after it); Flower exits and does
  not retry. The supervisor starts it again after 5, 10, 20, 40, 60, 60 ... seconds, for up to
  ``activation_timeout`` seconds (default 300, above the SuperLink's offline timeout of two missed 30 s
  heartbeats), then exits with the SuperNode's status.
* **No orphans.** The SuperNode starts ``flower-superexec`` (which starts the ClientApps) and does not stop it
  when it is killed. The child runs in its own process group; when it exits, for any reason, whatever is left
  of the group is stopped (SIGTERM, then SIGKILL); SIGTERM or SIGINT to the supervisor stops the group too,
  and on Linux the child is sent SIGTERM if the supervisor itself dies.
* **A log file.** With ``log_file`` every line of the SuperNode's output, and the supervisor's own, is appended
  there (UTC timestamps) as well as written to the terminal.

Any other exit of the SuperNode ends the supervisor with the SuperNode's status, for the service manager to
restart it (the deployment guide's systemd unit).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

__all__ = ["ACTIVATION_REFUSED", "backoff", "supervise"]

#: What Flower 1.41's SuperNode prints when the SuperLink refuses to activate it (its status is then 1).
ACTIVATION_REFUSED = "Exit Code: 305"
#: Seconds to wait before the first retry, and the longest wait.
FIRST_WAIT_S, LONGEST_WAIT_S = 5.0, 60.0
#: Seconds between SIGTERM and SIGKILL when the SuperNode's processes are stopped.
STOP_GRACE_S = 10.0


def backoff(attempt: int) -> float:
    """Seconds before retry ``attempt`` (1, 2, ...): 5, 10, 20, 40, 60, 60, ..."""
    return min(FIRST_WAIT_S * 2 ** (attempt - 1), LONGEST_WAIT_S)


class _Log:
    """Lines to the terminal and, with a file, appended there with a UTC timestamp."""

    def __init__(self, path: Path | None) -> None:
        self.file: IO[str] | None = None
        if path is not None:
            path = Path(path).expanduser()
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = path.open("a", encoding="utf-8", buffering=1)
        self.lock = threading.Lock()

    def line(self, text: str, *, own: bool = False) -> None:
        text = text.rstrip("\n")
        with self.lock:
            print(f"supervisor: {text}" if own else text, file=sys.stderr if own else sys.stdout, flush=True)
            if self.file is not None:
                stamp = datetime.now(UTC).isoformat(timespec="milliseconds")
                self.file.write(f"{stamp} {'supervisor: ' if own else ''}{text}\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _die_with_parent() -> None:
    """In the child, before exec: its own process group, and SIGTERM when the supervisor dies (Linux)."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop_group(pgid: int) -> None:
    """SIGTERM the process group, SIGKILL what is left after `STOP_GRACE_S`."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def _run_once(command: list[str], log: _Log, children: list[int]) -> tuple[int, bool]:
    """Run the SuperNode once: (its status, whether it said the SuperLink refused to activate it).

    Its output is read on a thread: the SuperExec it starts inherits the pipe and would hold it open after the
    SuperNode died, until its process group is stopped.
    """
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
        preexec_fn=_die_with_parent,  # noqa: PLW1509 - setsid and the death signal must happen in the child
    )  # fmt: skip
    children[:] = [proc.pid]
    refused: list[bool] = [False]

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            refused[0] = refused[0] or ACTIVATION_REFUSED in line
            log.line(line)

    reader = threading.Thread(target=pump, name="supernode-output", daemon=True)
    reader.start()
    try:
        status = proc.wait()
    finally:
        _stop_group(proc.pid)  # the SuperExec and ClientApps it started, whatever ended it
        children[:] = []
        reader.join(timeout=STOP_GRACE_S)
    return status, refused[0]


def supervise(
    command: list[str],
    *,
    log_file: Path | None = None,
    activation_timeout: float = 300.0,
    sleep: Callable[[float], bool] | None = None,
) -> int:
    """Run ``command`` (the SuperNode) until it exits for a reason other than a refused activation; its status.

    ``sleep(seconds)`` waits between retries and returns True if the supervisor is being stopped (for tests).
    """
    log = _Log(log_file)
    stopping = threading.Event()
    children: list[int] = []

    def stop(signum: int, frame: object) -> None:
        stopping.set()
        log.line(f"signal {signal.Signals(signum).name}: stopping the SuperNode", own=True)
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    wait = sleep or stopping.wait
    start = time.monotonic()
    attempt = 0
    try:
        while True:
            status, refused = _run_once(command, log, children)
            if stopping.is_set():
                return status
            if not refused:
                log.line(f"the SuperNode exited with status {status}", own=True)
                return status
            attempt += 1
            delay = backoff(attempt)
            if time.monotonic() - start + delay > activation_timeout:
                log.line(
                    f"the SuperLink still refuses to activate this SuperNode after {attempt} tries in "
                    f"{time.monotonic() - start:.0f} s (activation timeout {activation_timeout:g} s): giving up",
                    own=True,
                )
                return status
            log.line(
                f"the SuperLink refused to activate this SuperNode ({ACTIVATION_REFUSED}: it may still hold this "
                f"node's previous process as active until it misses its heartbeats); retry {attempt} in {delay:g} s",
                own=True,
            )
            if wait(delay):
                return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        log.close()
