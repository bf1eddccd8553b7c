"""The node operator's commands of ``python -m dpfedavg.deploy``: check, status, ledger, node readiness.

Each is one clear line and an exit status; the deploy helpers run from the base install (issue 47).
"""

from __future__ import annotations

import math
import os
import re
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
    ledger = tmp_path / "ledger.json"
    for argv, code, text in (
        (["status", str(tmp_path)], 1, "NOT FINISHED: no config.json"),
        (["ledger", "--node-config", f"max-epsilon=8.0 privacy-ledger='{ledger}'"], 0, "spent epsilon 0 at delta"),
    ):
        result = subprocess.run([*deploy, *argv], capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode == code and "Traceback" not in result.stderr, result.stderr
        assert text in result.stdout + result.stderr


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


# ------------------------------------------------------------------ status
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished run's results folder (the API, in process: the same Session writes it as the ServerApp)."""
    from dpfedavg import run

    out = tmp_path_factory.mktemp("runs")
    return run(num_rounds=2, dim=5, output_dir=str(out), run_name="done", progress=False).directory


def _status(run_dir: Path) -> tuple[int, str]:
    from dpfedavg.deploy.__main__ import main

    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["status", str(run_dir)])
    text = (out.getvalue() + err.getvalue()).strip()
    assert len(text.splitlines()) == 1, text  # one clear line
    return code, text


def test_status_is_0_only_for_a_run_with_a_final_record(tmp_path: Path, finished_run: Path) -> None:
    """Issue 47: `flwr run` exits 0 and `flwr ls` says completed when the ServerApp died or a resume was refused;
    `deploy status` reads the run's own record."""
    import json
    import shutil

    code, line = _status(finished_run)
    assert code == 0 and line.startswith(f"{finished_run} finished after round 2 of 2: (epsilon, delta) = (")
    killed = Path(shutil.copytree(finished_run, tmp_path / "killed"))  # the ServerApp died after round 2's checkpoint
    config = json.loads((killed / "config.json").read_text())
    del config["final"]
    (killed / "config.json").write_text(json.dumps(config))
    code, line = _status(killed)
    assert code == 1 and "NOT FINISHED: config.json has no 'final' record" in line
    assert "(the last round in metrics.csv is 2 of 2)" in line
    assert "resume=true" in line
    (killed / "checkpoint.npz").unlink()
    assert "no checkpoint.npz to resume from" in _status(killed)[1]
    pending = tmp_path / "pending"  # flwr ls: pending forever, the ServerApp never started
    pending.mkdir()
    code, line = _status(pending)
    assert code == 1 and "NOT FINISHED: no config.json: the ServerApp never started" in line
    failed = Path(shutil.copytree(finished_run, tmp_path / "failed"))
    config = json.loads((failed / "config.json").read_text())
    config["final"]["stopped_because"] = "round 2: every reply was unusable"
    (failed / "config.json").write_text(json.dumps(config))
    code, line = _status(failed)
    assert code == 1 and "FAILED after" in line and "every reply was unusable" in line
    (failed / "config.json").write_text("{")
    assert _status(failed)[0] == 1 and "cannot be read" in _status(failed)[1]
    assert _status(tmp_path / "no-such-run")[0] == 2


# ------------------------------------------------------------------ ledger
def _run_cli(argv: list[str]) -> tuple[int, str, str]:
    import contextlib
    import io

    from dpfedavg.deploy.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _charge_runs(node_config: dict, runs: list[int], rounds: list[int]) -> None:
    from dpfedavg.config import RunConfig
    from dpfedavg.core.types import RoundInstructions
    from dpfedavg.privacy.ledger import record_release

    cfg = RunConfig.from_run_config({"num-clients": 4, "clients-per-round": 4.0, "num-rounds": 5, "epsilon": 0.0,
                                     "noise-multiplier": 2.5, "delta": 1e-5})  # fmt: skip
    for run_id in runs:
        for k in rounds:
            ins = RoundInstructions(k, 0.1, 1, "clip", 1.0, 1.25, 0, False, noise_multiplier=2.5, cohort_size=4)
            record_release(node_config, run_id, ins, cfg, message_type="train")


def test_ledger_prints_each_run_and_the_spent_budget(tmp_path: Path) -> None:
    """Three runs of 5 rounds at q = 1, z = 2.5: exactly one Gaussian of std 2.5 / sqrt(15), 7.33 at 1e-5."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    ledger = tmp_path / "ledger.json"
    text = f"partition-id=0 num-partitions=4 max-epsilon=8.0 max-epsilon-delta=1e-5 privacy-ledger='{ledger}'"
    from dpfedavg.deploy.node import parse_node_config

    _charge_runs(parse_node_config(text), [11, 12], [1, 2, 3, 4, 5])
    _charge_runs(parse_node_config(text), [13], [1, 2, 3, 5, 3])  # round 4 skipped, round 3 redone
    code, out, err = _run_cli(["ledger", "--node-config", text])
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0] == f"privacy ledger {ledger}: 15 releases in 3 runs"
    assert lines[1].startswith("run 11: 5 releases (rounds 1-5); q = 1, num-rounds = 5, z = 2.5, run delta = 1e-05")
    assert lines[3].startswith("run 13: 5 releases (rounds 1-3, 5, 1 redone)")
    sigma = 1 / math.sqrt(3 * 5 / 2.5**2 + 1 / 2.5**2)  # three plans and one redone round: 16 Gaussians of z = 2.5

    def delta_of(eps: float) -> float:
        return norm.cdf(-eps * sigma + 1 / (2 * sigma)) - math.exp(eps) * norm.cdf(-eps * sigma - 1 / (2 * sigma))

    exact = brentq(lambda eps: delta_of(eps) - 1e-5, 0.0, 100.0)
    spent = float(lines[-1].split()[2])
    assert spent == pytest.approx(exact, rel=2e-3) and exact < 8
    left = float(lines[-1].split(": ")[-1].split()[0])
    assert lines[-1].endswith(" left") and "at delta 1e-05 (pld), of max-epsilon 8: " in lines[-1]
    assert left == pytest.approx(8 - spent, abs=1e-3)
    code, out, _ = _run_cli(["ledger", "--node-config", text, "--last", "1"])
    assert code == 0 and "(the last 1 runs of 3)" in out and "run 11" not in out
    ledger.write_bytes(ledger.read_bytes().replace(b'"noise_multiplier": 2.5', b'"noise_multiplier": 25.0', 1))
    code, out, err = _run_cli(["ledger", "--node-config", text])
    assert code == 1 and f"privacy-ledger {ledger} was edited" in err and len(err.strip().splitlines()) == 1
    code, _, err = _run_cli(["ledger", "--node-config", "max-epsilom=8.0"])
    assert code == 2 and "did you mean 'max-epsilon'" in err
    code, out, _ = _run_cli(["ledger", "--node-config", "partition-id=0 num-partitions=2"])
    assert code == 0 and "keeps no ledger" in out


# ------------------------------------------------------------------ node-check
@pytest.fixture
def node(tmp_path: Path) -> dict:
    import shutil

    from dpfedavg.deploy.app_hash import app_hash
    from dpfedavg.deploy.credentials import generate_credentials

    creds = generate_credentials(tmp_path / "creds", ["127.0.0.1"], 1)
    app = Path(shutil.copytree(Path(__file__).resolve().parents[1] / "examples" / "quickstart-numpy-dp",
                               tmp_path / "app", ignore=shutil.ignore_patterns("__pycache__")))  # fmt: skip
    ledger = tmp_path / "node" / "ledger.json"
    config = f"partition-id=0 num-partitions=4 max-epsilon=8.0 max-epsilon-delta=1e-5 privacy-ledger='{ledger}'"
    argv = ["node-check", "--node-config", config, "--root-certificates", str(creds.ca_cert),
            "--auth-supernode-private-key", str(creds.supernode_keys[0]), "--approved-app-hash", app_hash(app),
            "--app", str(app)]  # fmt: skip
    return {"argv": argv, "app": app, "ledger": ledger, "config": config, "key": creds.supernode_keys[0]}


def test_node_check_says_ready_or_names_the_cause(node: dict) -> None:
    from dpfedavg.deploy.node import parse_node_config

    code, out, err = _run_cli(node["argv"])
    assert code == 0, err
    assert out.startswith("SuperNode ready: policy: max-epsilon, max-epsilon-delta, privacy-ledger;")
    assert f"ledger {node['ledger']} writable, epsilon 0 spent of max-epsilon 8" in out

    def not_ready(argv: list[str]) -> str:
        code, out, err = _run_cli(argv)
        assert code == 1 and not out and len(err.strip().splitlines()) == 1, (code, out, err)
        return err

    (node["app"] / "task.py").write_text("print('changed')\n")  # the clone is not the reviewed code any more
    assert "is not approved by this node's operator" in not_ready(node["argv"])
    (node["app"] / "task.py").unlink()
    node["key"].chmod(0o644)
    assert "readable by others: chmod 600" in not_ready(node["argv"])
    node["key"].chmod(0o600)
    _charge_runs(parse_node_config(node["config"]), [1, 2, 3], [1])  # 7.33 spent: the fourth run is refused
    assert _run_cli(node["argv"])[0] == 0
    _charge_runs(parse_node_config(node["config"].replace("max-epsilon=8.0", "max-epsilon=100.0")), [4], [1])
    assert "has spent epsilon 8.7" in not_ready(node["argv"])
    node["ledger"].write_text("not a ledger")
    assert f"privacy-ledger {node['ledger']} is corrupt" in not_ready(node["argv"])
    bad = [*node["argv"]]
    bad[bad.index("--node-config") + 1] = "max-epsilon='eight'"
    code, _, err = _run_cli(bad)
    assert code == 2 and "'max-epsilon' = 'eight'" in err


# ------------------------------------------------------------------ the supervised SuperNode
FAKE_SUPERNODE = """
import os, subprocess, sys, time
from pathlib import Path
tries = Path(sys.argv[1])
n = int(tries.read_text()) + 1 if tries.exists() else 1
tries.write_text(str(n))
if n <= int(sys.argv[2]):
    print("Exit Code: 305\\nFailed to initialize the connection to the SuperLink.", flush=True)
    print("[code: 2004] Failed to activate SuperNode.", flush=True)
    sys.exit(1)
# like flower-superexec: a child that inherits the output and outlives a killed SuperNode
superexec = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
Path(sys.argv[3]).write_text(str(superexec.pid))
print(f"INFO :      SuperNode ID: 42 (try {n})", flush=True)
os.kill(os.getpid(), 9)  # the machine's kill -9
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(")")[-1].split()[0] == "Z")


def test_the_supervisor_retries_a_refused_activation_and_leaves_no_orphan(tmp_path: Path) -> None:
    """Issue 47: a SuperNode restarted while the SuperLink still holds its dead process is refused (Flower's exit
    code 305) and did not retry; a SuperNode killed with kill -9 left its SuperExec running."""
    from dpfedavg.deploy.supervise import backoff, supervise

    script = tmp_path / "supernode.py"
    script.write_text(FAKE_SUPERNODE)
    waits: list[float] = []
    log = tmp_path / "logs" / "supernode.log"
    command = [sys.executable, str(script), str(tmp_path / "tries"), "2", str(tmp_path / "superexec.pid")]
    status = supervise(command, log_file=log, activation_timeout=300, sleep=lambda s: waits.append(s) is not None)
    assert status == -9 and waits == [5.0, 10.0]  # refused twice, then it ran (and was killed)
    superexec = int((tmp_path / "superexec.pid").read_text())
    assert not _alive(superexec)  # stopped with the SuperNode's process group
    lines = log.read_text().splitlines()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT[0-9:.]+\+00:00 Exit Code: 305", lines[0])  # UTC timestamps
    assert sum("supervisor: the SuperLink refused to activate this SuperNode" in line for line in lines) == 2
    assert "retry 2 in 10 s" in log.read_text() and "SuperNode ID: 42 (try 3)" in log.read_text()
    assert lines[-1].endswith("supervisor: the SuperNode exited with status -9")
    # a node whose key was never registered gets the same 305: refused until the activation timeout, then its status
    (tmp_path / "tries").unlink()
    waits.clear()
    command[3] = "99"
    assert supervise(command, activation_timeout=7, sleep=lambda s: waits.append(s) is not None) == 1
    assert waits == [5.0]  # a retry after 5 s, not one 10 s later: past the 7 s activation timeout
    assert [backoff(k) for k in range(1, 8)] == [5, 10, 20, 40, 60, 60, 60]
