"""The node operator's commands of ``python -m dpfedavg.deploy``: check, status, ledger, node readiness.

Each is one clear line and an exit status; the deploy helpers run from the base install (issue 47).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpfedavg.deploy import check


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.xdist_group("base-install")  # with the other tests of conftest.base_install
def test_the_deploy_helpers_run_from_the_base_install(tmp_path: Path, base_install: Path) -> None:
    """``pip install -e .`` (no ``sim``/``test`` extra: no psutil) runs ``credentials`` and ``check`` (issue 47)."""
    missing = subprocess.run([str(base_install), "-c", "import psutil"], capture_output=True)
    assert missing.returncode != 0  # the base install lacks psutil: what crashed `deploy check`
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "home")}
    deploy = [str(base_install), "-m", "dpfedavg.deploy"]
    creds = subprocess.run(
        [*deploy, "credentials", "--out", str(tmp_path / "creds"), "--hosts", "127.0.0.1", "--supernodes", "1"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert creds.returncode == 0, creds.stderr
    ca = tmp_path / "creds" / "certificates" / "ca.crt"
    port = _closed_port()
    result = subprocess.run(
        [*deploy, "check", "--superlink", f"127.0.0.1:{port}", "--root-certificates", str(ca), "--timeout", "2"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"SuperLink 127.0.0.1:{port} NOT READY: nothing answers" in result.stderr


def test_the_superexec_is_found_without_psutil(tmp_path: Path, monkeypatch) -> None:
    """A live ``flower-superexec`` for the port is found in /proc, and with ``ps`` where there is no /proc."""
    script = tmp_path / "flower-superexec"
    script.write_text("import time\ntime.sleep(60)\n")
    port = _closed_port()
    proc = subprocess.Popen([sys.executable, str(script), "--runtime-api-address", f"127.0.0.1:{port}"])
    try:
        deadline = time.monotonic() + 10
        while check._superexec_for(port) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert check._superexec_for(port) == proc.pid
        assert check._superexec_for(port + 1 if port < 65535 else port - 1) is None
        monkeypatch.setattr(check, "PROC", tmp_path / "no-proc")  # macOS: no /proc, `ps` lists the processes
        assert check._superexec_for(port) == proc.pid
    finally:
        proc.terminate()
        proc.wait(10)
    assert check._superexec_for(port) is None


def test_local_addresses_are_recognised_without_psutil() -> None:
    assert check._is_local("127.0.0.1") and check._is_local("localhost") and check._is_local(socket.gethostname())
    assert not check._is_local("192.0.2.1")  # TEST-NET-1: never an address of this machine
    assert not check._is_local("no-such-host.invalid")
