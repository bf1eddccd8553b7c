"""Assembling a run, once for every engine: the task, the privacy plan, the server, the session.

`prepare_run()` is the one validation path after the config: the task's name is checked first
(cheap), then ``z`` is calibrated and every budget rule checked (`plan_privacy()`),
then the task is built, the server checks what needs the model's size (secure aggregation's terms),
and the session opens the run directory (or the checkpoint of a resumed run). The Flower ServerApp
and the batched engine both start here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dpfedavg.config import RunConfig
from dpfedavg.core.dp import BOUNDS
from dpfedavg.core.types import Vector
from dpfedavg.io.results import check_output_dir
from dpfedavg.privacy.params import DpParams
from dpfedavg.privacy.plan import PrivacyPlan, plan_privacy
from dpfedavg.server.dp_server import DPServer
from dpfedavg.server.session import RunSession, check_run_directory
from dpfedavg.tasks import Task, build_task, resolve_task

__all__ = ["PreparedRun", "plan_for", "prepare_run"]


@dataclass
class PreparedRun:
    """A run ready for its first round: ``w`` is ``w_0`` and ``first_round`` 1 (resumed: ``w_k`` and ``k + 1``)."""

    cfg: RunConfig
    task: Task
    server: DPServer
    session: RunSession
    w: Vector
    first_round: int


def plan_for(cfg: RunConfig) -> PrivacyPlan:
    """The privacy plan of ``cfg`` (``z`` calibrated or given, the budget checked)."""
    return plan_privacy(DpParams.from_config(cfg), BOUNDS[cfg.algorithm], cfg.clip_count_stddev)


def prepare_run(
    cfg: RunConfig,
    *,
    task: Task | Callable[[RunConfig], Task] | None = None,
    plan: PrivacyPlan | None = None,
    run_id: int | str = "local",
    engine: str,
    epsilon_each_round: bool = True,
) -> PreparedRun:
    """Check, plan and open a run of ``cfg`` (see the module docstring); nothing is written before it is valid.

    ``task``: a Task, or a factory called with ``cfg``; ``None`` builds the task ``cfg.task`` names. A run
    given a task records its ``name`` as ``cfg.task`` (in ``config.json``, the run's folder name, the checkpoint).

    Raises
    ------
    dpfedavg.errors.ConfigError
        An ``output-dir`` this process cannot write in, a ``run-name`` whose folder holds an earlier run's results
        (without ``resume``), an unknown task, a privacy plan that cannot hold, secure-aggregation settings that
        void the guarantee, or a checkpoint that does not fit (``resume``).
    dpfedavg.errors.ResultsError
        The run's first files could not be written.
    """
    check_output_dir(cfg.output_dir, cfg.run_name)  # a read-only output-dir: one ConfigError, before the calibration
    check_run_directory(cfg)  # a reused run-name: refused before the calibration
    source = task if task is not None else resolve_task(cfg.task)
    plan = plan if plan is not None else plan_for(cfg)
    built = build_task(cfg, source)
    if task is not None and cfg.task != built.name:
        cfg = cfg.replace(task=built.name)
    server = DPServer(cfg, built.dim, plan=plan, epsilon_each_round=epsilon_each_round)
    session = RunSession(cfg, built, server, run_id, engine=engine)
    w, first_round = session.begin(built.initial_weights())
    return PreparedRun(cfg, built, server, session, w, first_round)
