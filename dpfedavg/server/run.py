"""Assembling a run, once for every engine: the task, the privacy plan, the server, the session.

`prepare_run()` is the one validation path after the config: the task's name is checked first
(cheap), then the privacy set-up is resolved, ``z`` calibrated and every budget rule checked
(`PrivacySetup.resolve()`, unless the caller resolved it already), then the task is built, the server
checks what needs the model's size (secure aggregation's terms), and the session opens the run directory
(or the checkpoint of a resumed run). The Flower ServerApp and the batched engine both start here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpfedavg.config import RunConfig
from dpfedavg.core.check_in import check_engine
from dpfedavg.core.types import Vector
from dpfedavg.errors import ConfigError
from dpfedavg.io.results import check_output_dir, check_run_directory
from dpfedavg.privacy.setup import PrivacySetup
from dpfedavg.server.dp_server import DPServer
from dpfedavg.server.session import RunSession
from dpfedavg.tasks import Task, build_task, resolve_task

if TYPE_CHECKING:  # scipy.stats is imported only by runs with canaries
    from dpfedavg.privacy.canary import CanarySet

__all__ = ["PreparedRun", "prepare_run"]


@dataclass
class PreparedRun:
    """A run ready for its first round: ``w`` is ``w_0`` and ``first_round`` 1 (resumed: ``w_k`` and ``k + 1``)."""

    cfg: RunConfig
    task: Task
    server: DPServer
    session: RunSession
    w: Vector
    first_round: int
    #: ``canary-clients > 0``: the canaries; the inserted ones are clients ``n .. n + inserted - 1`` of the server.
    canaries: CanarySet | None = None


def prepare_run(
    cfg: RunConfig,
    *,
    task: Task | Callable[[RunConfig], Task] | None = None,
    setup: PrivacySetup | None = None,
    run_id: int | str = "local",
    engine: str,
    epsilon_each_round: bool = True,
    inserts_canaries: bool = False,
) -> PreparedRun:
    """Check, plan and open a run of ``cfg`` (see the module docstring); nothing is written before it is valid.

    ``task``: a Task, or a factory called with ``cfg``; ``None`` builds the task ``cfg.task`` names. A run
    given a task records its ``name`` as ``cfg.task`` (in ``config.json``, the run's folder name, the checkpoint).
    ``setup``: the run's privacy set-up when the caller resolved it already (`PrivacySetup.resolve()`, once per
    run). ``inserts_canaries``: the engine hosts ``canary-clients`` (a single batched or Flower run); the others
    refuse it.

    Raises
    ------
    dpfedavg.errors.ConfigError
        An ``output-dir`` this process cannot write in, a ``run-name`` whose folder holds an earlier run's results
        (without ``resume``), an unknown task, a privacy plan that cannot hold, secure-aggregation settings that
        void the guarantee, or a checkpoint that does not fit (``resume``).
    dpfedavg.errors.ResultsError
        The run's first files could not be written.
    """
    if cfg.canary_clients and not inserts_canaries:
        raise ConfigError(
            f"invalid run config: 'canary-clients' = {cfg.canary_clients}: this {engine!r} run does not insert "
            "canary clients; a single run does (python -m dpfedavg, dpfedavg.run(), flwr run with dpfedavg's "
            "own apps), not a sweep's batch of runs; set canary-clients = 0 here"
        )
    check_engine(cfg.sampling, engine)
    check_output_dir(cfg.output_dir, cfg.run_name)  # a read-only output-dir: one ConfigError, before the calibration
    check_run_directory(cfg)  # a reused run-name: refused before the calibration
    source = task if task is not None else resolve_task(cfg.task)
    setup = setup if setup is not None else PrivacySetup.resolve(cfg)
    built = build_task(cfg, source)
    if task is not None and cfg.task != built.name:
        cfg = cfg.replace(task=built.name)
    canaries = None
    if cfg.canary_clients:  # the task holds the n real clients; the server samples them and the inserted canaries
        from dpfedavg.privacy.canary import CanarySet

        canaries = CanarySet.draw(cfg.seed, cfg.canary_clients, built.dim)  # inserted: setup.federation's
    session = RunSession(cfg, built, run_id, engine, plan=setup.plan, dim=built.dim, server_for=lambda log: DPServer(
        cfg, built.dim, setup=setup, epsilon_each_round=epsilon_each_round, release_log=log
    ))  # fmt: skip
    server = session.server
    assert isinstance(server, DPServer)
    w, first_round = session.begin(built.initial_weights())
    return PreparedRun(cfg, built, server, session, w, first_round, canaries)
