"""Flower ServerApp: build the task and strategy from run_config, run, write results."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from dpfedavg.config import ConfigError, RunConfig
from dpfedavg.core import server_noise_std
from dpfedavg.protocol import from_array_record, to_array_record
from dpfedavg.results import RunRecorder, package_versions
from dpfedavg.runtime import setup_app_process
from dpfedavg.strategies import DPFedAvg, FederationError
from dpfedavg.tasks import Task, build_task

logger = logging.getLogger(__name__)

app = ServerApp()


def run_directory(cfg: RunConfig, run_id: int | str) -> Path:
    """``<output-dir>/<run-name>``; the default name is ``<task>-<algorithm>-<UTC time>-<run id>``."""
    name = cfg.run_name or f"{cfg.task}-{cfg.algorithm}-{datetime.now(UTC):%Y%m%d-%H%M%S}-{run_id}"
    return Path(cfg.output_dir).expanduser().resolve() / name


def describe_run(cfg: RunConfig, task: Task, strategy: DPFedAvg, run_id: int | str) -> dict[str, Any]:
    """The resolved config plus derived quantities, for ``config.json``."""
    return {
        "run_config": cfg.to_run_config(),
        "run_id": run_id,
        "seed": cfg.seed,
        "derived": {
            "n": cfg.num_clients,
            "r": cfg.clients_per_round,
            "q": cfg.sampling_rate,
            "dim": task.dim,
            "noise_multiplier": cfg.noise_multiplier if cfg.algorithm != "none" else 0.0,
            "sigma": server_noise_std(cfg.noise_multiplier, cfg.clip, cfg.clients_per_round)
            if cfg.algorithm != "none"
            else 0.0,
            "client_noise_std": strategy.client_noise_std,
            "random_iterate_round": strategy.random_round,
            "dp": cfg.dp_enabled,
        },
        "versions": package_versions(),
        "started_utc": datetime.now(UTC).isoformat(),
    }


def run(grid: Grid, cfg: RunConfig, run_id: int | str = "local") -> Path:
    """Train with the strategy on ``grid`` and write results; returns the run directory."""
    task = build_task(cfg)
    w0 = task.initial_weights()
    strategy = DPFedAvg(cfg, dim=task.dim)
    out_dir = run_directory(cfg, run_id)
    recorder = RunRecorder(out_dir, task.metric_names)
    recorder.write_config(describe_run(cfg, task, strategy, run_id))
    logger.info("Results will be written to %s", out_dir)
    if not cfg.dp_enabled:
        logger.warning(
            "NO DIFFERENTIAL PRIVACY: %s",
            "algorithm='none'"
            if cfg.algorithm == "none"
            else "noise-multiplier = 0 (updates are clipped/normalized but not noised)",
        )
    t0 = time.monotonic()

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        metrics = task.evaluate(from_array_record(arrays))
        stats = strategy.history.get(server_round)
        row: dict[str, Any] = {"round": server_round, **metrics, "elapsed_s": round(time.monotonic() - t0, 3)}
        if stats is not None:
            row.update(stats.as_metrics())
        recorder.write_row(row)
        shown = " | ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        if stats is None:
            logger.info("round %d/%d | %s", server_round, cfg.num_rounds, shown)
        else:
            logger.info(
                "round %d/%d | sampled %d, received %d | %s | clipped %.0f%%",
                server_round,
                cfg.num_rounds,
                stats.num_sampled,
                stats.num_received,
                shown,
                100 * stats.frac_clipped if stats.num_received else 0.0,
            )
        return MetricRecord(metrics)

    result = strategy.start(grid=grid, initial_arrays=to_array_record(w0), evaluate_fn=evaluate_fn)
    w_final = from_array_record(result.arrays) if result.arrays is not None else w0
    w_random = strategy.random_iterate if strategy.random_iterate is not None else w0
    recorder.write_model(w_final=w_final, w_random_iterate=w_random, random_iterate_round=strategy.random_round)
    logger.info("Done: metrics in %s, model in %s", recorder.metrics_path, recorder.model_path)
    return out_dir


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Validate ``run_config``, then :func:`run`. Bad config or federation: one ERROR line."""
    setup_app_process()
    try:
        cfg = RunConfig.from_run_config(context.run_config)
    except ConfigError as err:
        logger.error("%s", err)
        return
    try:
        run(grid, cfg, run_id=context.run_id)
    except FederationError as err:
        logger.error("federation does not match the run: %s", err)
