"""Flower ServerApp: build the task and strategy from run_config, run, write results."""

from __future__ import annotations

import logging

import numpy as np
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from dpfedavg.config import ConfigError, RunConfig
from dpfedavg.engines.batched import recording
from dpfedavg.errors import ResultsError
from dpfedavg.flower.federation import SETTLE_S, Federation, FederationError
from dpfedavg.flower.protocol import from_array_record, to_array_record
from dpfedavg.flower.runtime import setup_app_process
from dpfedavg.flower.strategy import RunStrategy
from dpfedavg.io.results import RunResult, check_output_dir, check_run_directory
from dpfedavg.privacy.setup import PrivacySetup
from dpfedavg.server.health import TrainingStopped
from dpfedavg.server.run import prepare_run
from dpfedavg.tasks import resolve_task
from dpfedavg.tasks.errors import DataUnavailableError

logger = logging.getLogger(__name__)

app = ServerApp()


def run(grid: Grid, cfg: RunConfig, run_id: int | str = "local", setup: PrivacySetup | None = None) -> RunResult:
    """Train with the Flower strategy on ``grid`` and write results (`dpfedavg.server.run.prepare_run()`).

    Raises `ConfigError` (from the task, the privacy plan or the server) before anything is written, and
    `TrainingStopped` (after the results are written) when the run stopped
    because its clients' replies were unusable.
    """
    prepared = prepare_run(cfg, setup=setup, run_id=run_id, engine="flower", inserts_canaries=True)
    session, canaries = prepared.session, prepared.canaries
    strategy = RunStrategy(
        cfg, server=prepared.server, canaries=canaries.inserted_directions if canaries is not None else None
    )
    session.description["privacy"]["reply_checks"] = strategy.describe_reply_checks()
    recorder = recording(session, canaries, prepared.w)  # the session, or the canary audit around it
    result = strategy.run(
        grid,
        to_array_record(prepared.w),
        first_round=prepared.first_round,
        on_round_end=recorder.end_round,
    )
    w_final = from_array_record(result.arrays) if result.arrays is not None else prepared.w
    session.description["timing"] = timing_summary(strategy)
    failed = strategy.failed
    outcome = recorder.finish(
        w_final, stopped_before_round=strategy.stopped_before_round, failed=str(failed) if failed else None
    )
    if failed is not None:
        failed.result = outcome
        raise failed
    return outcome


def timing_summary(strategy: RunStrategy) -> dict[str, float | None]:
    """Median seconds per round in each phase, and the discovery time (for ``config.json``)."""
    out: dict[str, float | None] = {"discovery_s": strategy.discovery_seconds}
    if strategy.timings:
        for key in next(iter(strategy.timings.values())):
            out[f"median_{key}"] = float(np.median([t[key] for t in strategy.timings.values()]))
    return out


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Validate ``run_config``, then `run()`. Bad config, federation, a failed write of results: one ERROR line."""
    setup_app_process()
    try:
        cfg = RunConfig.from_run_config(context.run_config)
        check_output_dir(cfg.output_dir, cfg.run_name)  # a read-only output-dir: one error, not a traceback later
        check_run_directory(cfg)  # a reused run-name: one error before the calibration
        resolve_task(cfg.task)  # a misspelled task: one error before the calibration
        setup = PrivacySetup.resolve(cfg)
        # a simulation of the wrong size: one error before the run's folder is made (Flower registers its nodes
        # just after this thread starts, so wait a little for the first)
        Federation(cfg).check_simulation_size(grid, first_node_wait=SETTLE_S)
    except ConfigError as err:
        logger.error("%s", err)
        return
    except FederationError as err:
        logger.error("federation does not match the run: %s", err)
        return
    try:
        run(grid, cfg, run_id=context.run_id, setup=setup)
    except FederationError as err:
        logger.error("federation does not match the run: %s", err)
    except (ConfigError, DataUnavailableError, ResultsError, TrainingStopped) as err:
        logger.error("%s", err)
