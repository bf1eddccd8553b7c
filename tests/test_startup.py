"""Start-up: the simulation's size checked before Ray has started, and one retry of a slow start-up (issue 48).

Cheap: in-process Grids and a fake start-up that fails once; the deployment tests' background blocks (a SuperLink,
a SuperNode) restarted once when not up in time, with a fake block; nothing here starts Flower or Ray.
"""

from __future__ import annotations

import pytest
from flwr.common.constant import HEARTBEAT_INTERVAL_INF
from flwr.proto.node_pb2 import NodeInfo

from dpfedavg.config import RunConfig
from dpfedavg.flower.app_strategy import DPFedAvg
from dpfedavg.flower.client_app import app as client_app
from dpfedavg.flower.federation import SETTLE_S, FederationError
from dpfedavg.flower.testing import InProcessGrid

DIM = 4


def _cfg(**overrides) -> RunConfig:
    base = {"num-clients": 20, "clients-per-round": 5.0, "num-rounds": 2, "dim": DIM, "epsilon": 0.0,
            "noise-multiplier": 0.0, "node-wait-timeout": 300.0}  # fmt: skip
    return RunConfig.from_run_config({**base, **overrides})


class SimulatedGrid(InProcessGrid):
    """Nodes as Flower's simulation registers them: all at once, heartbeats off (``HEARTBEAT_INTERVAL_INF``)."""

    def get_nodes(self):
        return [NodeInfo(node_id=nid, heartbeat_interval=HEARTBEAT_INTERVAL_INF) for nid in self.get_node_ids()]


@pytest.mark.parametrize(("supernodes", "per_node", "needed"), [(2, 1, 20), (3, 5, 4), (30, 1, 20)])
def test_a_simulation_of_the_wrong_size_fails_before_any_node_is_asked(supernodes, per_node, needed) -> None:
    """One line naming num-supernodes, num-clients, clients-per-node and the fix; no message sent (so no ClientApp
    or Ray was needed), no waiting out node-wait-timeout: at most the settle time (sleeps counted, not timed)."""
    cfg = _cfg(**{"clients-per-node": per_node})
    grid = SimulatedGrid(client_app, supernodes, cfg.to_run_config())
    slept: list[float] = []
    with pytest.raises(FederationError) as err:
        DPFedAvg(cfg, dim=DIM, sleep=slept.append).discover_clients(grid)
    line = str(err.value)
    assert "\n" not in line
    assert f"num-supernodes={supernodes}" in line and "num-clients=20" in line
    assert f"clients-per-node={per_node}" in line
    assert f'--federation-config "num-supernodes={needed}"' in line
    assert grid.sent == [] and sum(slept) <= SETTLE_S + 1e-9


class RegisteringGrid(SimulatedGrid):
    """A simulation whose nodes appear a few per poll, as while Flower's registration loop runs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.polls = 0

    def get_node_ids(self):
        self.polls += 1
        return list(self.contexts)[: min(len(self.contexts), self.polls)]


@pytest.mark.parametrize(("supernodes", "fails"), [(4, False), (3, True)])
def test_nodes_still_being_registered_are_waited_for(supernodes, fails) -> None:
    cfg = _cfg(**{"clients-per-node": 5})
    grid = RegisteringGrid(client_app, supernodes, cfg.to_run_config())
    strategy = DPFedAvg(cfg, dim=DIM, sleep=lambda s: None)
    if fails:
        with pytest.raises(FederationError, match="the simulation has num-supernodes=3 "):
            strategy.discover_clients(grid)
        assert grid.sent == []
    else:
        assert sorted(strategy.discover_clients(grid)) == list(range(4))


def test_a_simulation_of_the_right_size_is_discovered_as_before() -> None:
    cfg = _cfg(**{"clients-per-node": 5})
    grid = SimulatedGrid(client_app, 4, cfg.to_run_config())
    mapping = DPFedAvg(cfg, dim=DIM, sleep=lambda s: None).discover_clients(grid)
    assert sorted(mapping) == list(range(4))  # partition ids of the 4 SuperNodes


def test_a_deployment_below_the_size_still_waits_for_late_supernodes() -> None:
    """Deployed SuperNodes (finite heartbeats) may connect later: they keep node-wait-timeout."""
    cfg = _cfg()

    class Late(InProcessGrid):
        polls = 0

        def get_nodes(self):
            return [NodeInfo(node_id=nid, heartbeat_interval=30.0) for nid in self.get_node_ids()]

        def get_node_ids(self):
            Late.polls += 1
            return list(self.contexts)[: min(20, 5 * Late.polls)]

    mapping = DPFedAvg(cfg, dim=DIM, sleep=lambda s: None).discover_clients(Late(client_app, 20, cfg.to_run_config()))
    assert sorted(mapping) == list(range(20)) and Late.polls >= 4


# ------------------------------------------------------- one retry of a start-up that timed out (with fakes)
RAY_TIMEOUT = (
    "Exception: The current node timed out during startup. This could happen because some of the raylet failed to "
    "startup or the GCS has become overloaded."
)


class Attempts:
    """A start-up that gives ``outcomes`` in turn: an exception to raise or a result to return."""

    def __init__(self, *outcomes) -> None:
        self.outcomes, self.calls = list(outcomes), 0

    def __call__(self):
        outcome = self.outcomes[self.calls]
        self.calls += 1
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def test_a_start_up_that_timed_out_is_retried_once_with_a_warning_naming_the_cause(dpfedavg_log) -> None:
    from dpfedavg.engines.local_superlink import StartupTimeout, retry_startup_once

    cleaned: list[int] = []
    attempt = Attempts(StartupTimeout("flower-superlink did not become healthy within 60s; see x.log"), "up")
    assert retry_startup_once(attempt, "the local SuperLink", before_retry=lambda: cleaned.append(1)) == "up"
    assert attempt.calls == 2 and cleaned == [1]
    (record,) = [r for r in dpfedavg_log if r.levelname == "WARNING"]
    line = record.getMessage()
    assert "the local SuperLink did not start in time" in line and "within 60s" in line and "retrying once" in line


@pytest.mark.parametrize(
    "output",
    [
        RAY_TIMEOUT,
        "Failed to start local SuperLink within 15s. Check the log",
        "raylet: node timed out during startup (GCS)",
    ],
)
def test_the_start_up_messages_of_flower_and_ray_are_retried_once_only(output, dpfedavg_log) -> None:
    """A second start-up failure is the answer (no third try), and it is returned as it is."""
    from dpfedavg.engines.local_superlink import retry_startup_once, startup_failure

    attempt = Attempts(f"INFO : starting\n{output}\n", f"again\n{output}\n", "never")
    assert retry_startup_once(attempt, "flwr run", failure=startup_failure) == f"again\n{output}\n"
    assert attempt.calls == 2
    (record,) = [r for r in dpfedavg_log if r.levelname == "WARNING"]
    assert output.split(".")[0] in record.getMessage()


@pytest.mark.parametrize(
    "outcome",
    [AssertionError("assert 0.87 > 0.9"), RuntimeError("flwr run did not finish"), TimeoutError("flwr run: 600s")],
)
def test_anything_but_a_start_up_timeout_is_raised_at_once(outcome, dpfedavg_log) -> None:
    from dpfedavg.engines.local_superlink import retry_startup_once, startup_failure

    attempt = Attempts(outcome, "up")
    with pytest.raises(type(outcome)):
        retry_startup_once(attempt, "flwr run", failure=startup_failure)
    assert attempt.calls == 1 and not dpfedavg_log


def test_a_healthy_runs_line_that_happens_to_say_node_timed_out_is_not_a_start_up_failure() -> None:
    from dpfedavg.engines.local_superlink import startup_failure

    assert startup_failure("INFO : Results will be written to /tmp/node timed out/quadratic-norm-1") is None


def test_a_run_that_failed_otherwise_is_not_retried(dpfedavg_log) -> None:
    from dpfedavg.engines.local_superlink import retry_startup_once, startup_failure

    failed = "ERROR : invalid run config: unknown key 'num-round'\nTraceback (most recent call last):\n"
    attempt = Attempts(failed, "up")
    assert retry_startup_once(attempt, "flwr run", failure=startup_failure) == failed
    assert attempt.calls == 1 and not dpfedavg_log


@pytest.fixture
def idle_link(tmp_path):
    """A LocalSuperLink whose SuperLink is a stand-in (nothing of Flower is started)."""
    import shutil

    from dpfedavg.engines.local_superlink import LocalSuperLink

    link = LocalSuperLink(tmp_path / "link")

    class Running:
        pid = 2**31 - 1  # no such process: nothing is remembered or stopped

        def poll(self):
            return None

    link.process = Running()
    yield link
    shutil.rmtree(link.ray_tmp, ignore_errors=True)


def test_flwr_run_retries_a_ray_start_up_timeout_and_removes_the_half_written_run(idle_link, tmp_path, monkeypatch):
    import subprocess

    run_dir, earlier = tmp_path / "out" / "run", tmp_path / "out" / "earlier"
    earlier.mkdir(parents=True)
    outputs = iter([RAY_TIMEOUT, "Done after 2 rounds"])
    seen: list[bool] = []

    def once(command, timeout, **where):
        seen.append(run_dir.exists())
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text("{}")  # what a ServerApp writes before Ray has started
        return subprocess.CompletedProcess(command, 0, next(outputs), "")

    monkeypatch.setattr(idle_link, "_flwr_run_once", once)
    result = idle_link.flwr_run("num-rounds=2", "num-supernodes=2", app=tmp_path, run_dir=run_dir)
    assert result.stdout == "Done after 2 rounds" and seen == [False, False]
    # a folder that was there before the call (a resume) is never removed
    outputs = iter([RAY_TIMEOUT, "Done after 2 rounds"])
    seen.clear()
    monkeypatch.setattr(idle_link, "_flwr_run_once", lambda command, timeout, **where: (seen.append(earlier.exists()),
                        subprocess.CompletedProcess(command, 0, next(outputs), ""))[1])  # fmt: skip
    idle_link.flwr_run("resume=true", "num-supernodes=2", app=tmp_path, run_dir=earlier)
    assert seen == [True, True]


def test_a_tutorial_block_naming_a_start_up_timeout_runs_once_more_in_its_folder(idle_link, tmp_path, dpfedavg_log):
    """`LocalSuperLink.run_command`: a shell block (its own folder and environment) whose output says Ray did not
    start runs again after ``before_retry()``, once; the second output is the result."""
    project = tmp_path / "project"
    project.mkdir()
    block = 'echo "in $(basename "$PWD") with $MARK"\n'
    block += f"[ -e tried ] && echo done || {{ touch tried; echo {RAY_TIMEOUT!r}; }}"
    cleaned: list[int] = []
    result = idle_link.run_command(
        ["bash", "-e", "-c", block], cwd=project, env={"MARK": "m1", "PATH": "/usr/bin:/bin"},
        before_retry=lambda: cleaned.append(1),
    )  # fmt: skip
    assert result.returncode == 0 and result.stdout == "in project with m1\ndone\n" and cleaned == [1]
    (record,) = [r for r in dpfedavg_log if r.levelname == "WARNING"]
    assert "did not start in time" in record.getMessage() and "timed out during startup" in record.getMessage()


def test_flwr_run_stops_a_cli_that_waits_for_a_simulation_that_died_starting_ray(idle_link) -> None:
    """`flwr run --stream` may keep waiting once the simulation died: stopped after the grace, the output returned."""
    import sys

    idle_link.startup_failure_grace_s = 0.2
    script = f"import time; print({RAY_TIMEOUT!r}, flush=True); time.sleep(120)"
    result = idle_link._flwr_run_once([sys.executable, "-c", script], timeout=120)
    assert RAY_TIMEOUT in result.stdout and result.returncode != 0


def test_a_superlink_that_did_not_become_healthy_is_started_once_more_on_new_ports(idle_link, monkeypatch) -> None:
    from dpfedavg.engines.local_superlink import StartupTimeout

    ports: list[int] = []
    attempt = Attempts(StartupTimeout("flower-superlink did not become healthy within 60s"), None)

    def start_once(timeout):
        ports.append(idle_link.http_port)
        return attempt()

    monkeypatch.setattr(idle_link, "_start_once", start_once)
    idle_link.start()
    assert attempt.calls == 2 and ports[0] != ports[1]
    assert idle_link.env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] == str(ports[1]) and idle_link.ray_tmp.is_dir()


def test_a_ray_node_that_timed_out_starting_is_dropped_and_started_once_more(dpfedavg_log) -> None:
    """LoopbackRayCluster: the failed head is forgotten (its processes stopped by PID) and restarted on a new port."""
    import shutil

    from dpfedavg.deploy.ray_loopback import LoopbackRayCluster
    from dpfedavg.engines.local_superlink import StartupTimeout

    cluster = LoopbackRayCluster(workers=0)
    ports: list[int] = []

    class Exited:
        pid = 2**31 - 1  # no such process

        def wait(self, timeout=None):
            return 1

    def start_once(index, head, timeout):
        ports.append(cluster.port)
        cluster.nodes.append(Exited())
        cluster._trees[index] = {}
        if len(ports) == 1:
            raise StartupTimeout("ray start exited with 1: The current node timed out during startup.")

    cluster._start_node_once = start_once
    try:
        cluster.start()
    finally:
        shutil.rmtree(cluster.root, ignore_errors=True)
    assert len(ports) == 2 and ports[0] != ports[1] and len(cluster.nodes) == 1
    assert cluster.address == f"127.0.0.1:{ports[1]}"
    (record,) = [r for r in dpfedavg_log if r.levelname == "WARNING"]
    assert "Ray node 0 did not start in time" in record.getMessage()


def test_rays_raylet_wait_is_set_for_what_the_helpers_start_unless_the_user_set_it(tmp_path, monkeypatch) -> None:
    import shutil

    from dpfedavg.deploy.ray_loopback import LoopbackRayCluster
    from dpfedavg.engines.local_superlink import LocalSuperLink

    def envs():
        link, cluster = LocalSuperLink(tmp_path / "link"), LoopbackRayCluster()
        shutil.rmtree(link.ray_tmp), shutil.rmtree(cluster.root)
        return link.env, cluster.env

    monkeypatch.delenv("RAY_raylet_start_wait_time_s", raising=False)
    assert [env["RAY_raylet_start_wait_time_s"] for env in envs()] == ["120", "120"]
    monkeypatch.setenv("RAY_raylet_start_wait_time_s", "300")
    assert [env["RAY_raylet_start_wait_time_s"] for env in envs()] == ["300", "300"]


@pytest.mark.parametrize("written", [None, "{}"], ids=["no-folder", "no-final"])
def test_run_flower_raises_with_one_line_when_flwr_run_exited_0_without_a_final_record(tmp_path, written) -> None:
    """`flwr run --stream` exits 0 whatever happened: the scripts' wrapper reads the `final` record instead."""
    import subprocess

    from dpfedavg.engines.flower import run_flower

    cfg = _cfg(**{"output-dir": str(tmp_path), "run-name": "r"})

    class Link:
        def flwr_run(self, run_config, federation_config, *, timeout, run_dir):
            assert run_dir == tmp_path / "r"  # given, so that a start-up retry can remove what it made
            if written is not None:
                run_dir.mkdir()
                (run_dir / "config.json").write_text(written)
            return subprocess.CompletedProcess(["flwr"], 0, "ERROR : the ServerApp failed\n", "")

    with pytest.raises(RuntimeError) as err:
        run_flower(cfg, Link())
    first = str(err.value).splitlines()[0]
    assert first.startswith("the run did not finish (flwr run exited 0): ") and "NOT FINISHED" in first
    assert ("no 'final' record" in first) == (written is not None)


def test_the_server_app_names_a_wrong_simulation_size_in_one_line_before_writing_anything(
    tmp_path, dpfedavg_log, monkeypatch
):
    from flwr.app import Context, RecordDict

    from dpfedavg.flower import server_app

    monkeypatch.setattr("dpfedavg.flower.federation.SETTLE_S", 0.2)  # one poll instead of ten (it sleeps for real)

    cfg = _cfg(**{"output-dir": str(tmp_path / "out"), "run-name": "r", "clients-per-node": 5})
    grid = SimulatedGrid(client_app, 3, cfg.to_run_config())
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg.to_run_config())
    server_app.main(grid, context)
    (error,) = [r.getMessage() for r in dpfedavg_log if r.levelname == "ERROR"]
    assert "num-supernodes=3" in error and 'num-supernodes=4"' in error and "\n" not in error
    assert grid.sent == [] and not (tmp_path / "out").exists()


# ------------------------------------------------ the deployment tests' background blocks (a fake block, no Flower)
# A block that says it is up only when started the second time, as a SuperNode slow to start once would.
SLOW_ONCE = 'if [ -e started ]; then echo "SuperNode ID 1"; else touch started; fi\nexec sleep 60\n'


def test_a_block_that_is_not_up_in_time_is_restarted_once_with_a_warning(tmp_path, dpfedavg_log) -> None:
    import os

    import psutil
    from test_readme_deploy import Processes

    from dpfedavg.engines.local_superlink import leftover_pids

    bg = Processes(dict(os.environ), tmp_path)
    try:
        first = bg.start("supernode-0", SLOW_ONCE, tmp_path / "client-0")
        bg.wait_for_start("supernode-0", lambda: "SuperNode ID" in bg.log("supernode-0"), 1, "'SuperNode ID' line")
        assert not psutil.pid_exists(first.pid) or psutil.Process(first.pid).status() == psutil.STATUS_ZOMBIE
        assert bg.procs["supernode-0"].pid != first.pid and bg.procs["supernode-0"].poll() is None
    finally:
        bg.stop()
    assert leftover_pids(bg.known) == []
    (record,) = [r for r in dpfedavg_log if r.levelname == "WARNING"]
    line = record.getMessage()
    assert "supernode-0 ('SuperNode ID' line) did not start in time" in line and "retrying once" in line, line


def test_a_block_that_is_not_up_after_its_restart_fails_the_test(tmp_path, dpfedavg_log) -> None:
    import os

    from test_readme_deploy import Processes

    from dpfedavg.engines.local_superlink import StartupTimeout, leftover_pids

    bg = Processes(dict(os.environ), tmp_path)
    try:
        bg.start("superlink", "exec sleep 60\n", tmp_path / "server")
        with pytest.raises(StartupTimeout, match="superlink: no listener within 0 s"):
            bg.wait_for_start("superlink", lambda: False, 0.3, "listener")
    finally:
        bg.stop()
    assert leftover_pids(bg.known) == []
    assert len([r for r in dpfedavg_log if r.levelname == "WARNING"]) == 1  # one retry, no third start
