"""Flower ServerApp: build the task and strategy from run_config, run, write results."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from dpfedavg.config import ConfigError, RunConfig
from dpfedavg.core import server_noise_std
from dpfedavg.protocol import from_array_record, to_array_record
from dpfedavg.results import RunRecorder, package_versions
from dpfedavg.runtime import setup_app_process
from dpfedavg.strategies import DPFedAvg, FederationError, PrivacyPlan, plan_privacy
from dpfedavg.tasks import Task, build_task
from dpfedavg.tasks.datasets import DataUnavailableError

logger = logging.getLogger(__name__)

app = ServerApp()


def run_directory(cfg: RunConfig, run_id: int | str) -> Path:
    """``<output-dir>/<run-name>``; the default name is ``<task>-<algorithm>-<UTC time>-<run id>``."""
    name = cfg.run_name or f"{cfg.task}-{cfg.algorithm}-{datetime.now(UTC):%Y%m%d-%H%M%S}-{run_id}"
    return Path(cfg.output_dir).expanduser().resolve() / name


def describe_privacy(cfg: RunConfig, plan: PrivacyPlan) -> dict[str, Any]:
    """The privacy set-up for ``config.json``."""
    return {
        "dp": plan.dp,
        "noise_multiplier": plan.noise_multiplier,
        "noise_multiplier_calibrated": plan.calibrated,
        "target_epsilon": plan.target_epsilon,
        "delta": plan.delta,
        "q": plan.q,
        "sigma": server_noise_std(plan.noise_multiplier, cfg.clip, cfg.clients_per_round),
        "accountant": plan.accountant,
        "noise_placement": plan.placement,
        "max_epsilon": plan.max_epsilon,
        "nominal_epsilon": plan.nominal_epsilon,
        "privacy_unit": "one client's whole dataset (add/remove one client)",
        "sensitivity_of_sum": cfg.clip,
    }


def describe_run(cfg: RunConfig, task: Task, strategy: DPFedAvg, run_id: int | str) -> dict[str, Any]:
    """The resolved config plus derived quantities, for ``config.json``."""
    client_std, server_std = strategy.noise_stds(round(cfg.clients_per_round))
    return {
        "run_config": cfg.to_run_config(),
        "run_id": run_id,
        "seed": cfg.seed,
        "derived": {
            "n": cfg.num_clients,
            "r": cfg.clients_per_round,
            "q": cfg.sampling_rate,
            "dim": task.dim,
            "client_noise_std_at_r": client_std,
            "server_noise_std": server_std,
        },
        "privacy": describe_privacy(cfg, strategy.plan),
        "versions": package_versions(),
        "started_utc": datetime.now(UTC).isoformat(),
    }


def run(grid: Grid, cfg: RunConfig, run_id: int | str = "local", plan: PrivacyPlan | None = None) -> Path:
    """Train with the strategy on ``grid`` and write results; returns the run directory.

    Raises :class:`ConfigError` (from the privacy plan) before anything is written.
    """
    plan = plan if plan is not None else plan_privacy(cfg)
    task = build_task(cfg)
    w0 = task.initial_weights()
    strategy = DPFedAvg(cfg, dim=task.dim, plan=plan)
    out_dir = run_directory(cfg, run_id)
    recorder = RunRecorder(out_dir, task.metric_names)
    description = describe_run(cfg, task, strategy, run_id)
    recorder.write_config(description)
    logger.info("Results will be written to %s", out_dir)
    if plan.dp:
        logger.info(
            "Privacy: z = %.5g (%s), %s accountant, delta = %g; nominal epsilon after %d rounds: %.4g",
            plan.noise_multiplier,
            f"calibrated for epsilon = {plan.target_epsilon:g}" if plan.calibrated else "given",
            plan.accountant,
            plan.delta,
            plan.rounds,
            plan.nominal_epsilon,
        )
    else:
        logger.warning(
            "NO DIFFERENTIAL PRIVACY: %s",
            "algorithm='none' (epsilon, delta and noise-multiplier are not used)"
            if cfg.algorithm == "none"
            else "noise multiplier 0 (updates are clipped/normalized but not noised; epsilon is infinite)",
        )
    t0 = time.monotonic()

    evaluated: dict[int, dict[str, float]] = {}

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        due = server_round == 0 or server_round % cfg.eval_every == 0 or server_round > cfg.num_rounds - 5
        metrics = task.evaluate(from_array_record(arrays)) if due else {}
        if due:
            evaluated[server_round] = metrics
        stats = strategy.history.get(server_round)
        row: dict[str, Any] = {"round": server_round, **metrics, "elapsed_s": round(time.monotonic() - t0, 3)}
        if stats is not None:
            row.update(stats.as_metrics())
        recorder.write_row(row)
        shown = " | ".join(f"{k} {v:.4g}" for k, v in metrics.items()) or "not evaluated"
        if stats is None:
            logger.info("round %d/%d | %s", server_round, cfg.num_rounds, shown)
        else:
            logger.info(
                "round %d/%d | sampled %d, received %d | %s | clipped %.0f%% | epsilon %.4g",
                server_round,
                cfg.num_rounds,
                stats.num_sampled,
                stats.num_received,
                shown,
                100 * stats.frac_clipped if stats.num_received else 0.0,
                stats.epsilon,
            )
        return MetricRecord(metrics) if due else None

    result = strategy.start(grid=grid, initial_arrays=to_array_record(w0), evaluate_fn=evaluate_fn)
    w_final = from_array_record(result.arrays) if result.arrays is not None else w0
    w_random = strategy.random_iterate if strategy.random_iterate is not None else w0
    k_random = strategy.random_round if strategy.random_round is not None else 0
    recorder.write_model(w_final=w_final, w_random_iterate=w_random, random_iterate_round=k_random)
    completed = len(strategy.history)
    last5 = [evaluated[k] for k in sorted(evaluated) if k > 0][-5:]
    summary = {f"last5_{name}": float(np.mean([m[name] for m in last5])) for name in task.metric_names} if last5 else {}
    description["final"] = {
        **summary,
        "epsilon": strategy.epsilon,
        "delta": plan.delta,
        "rounds_completed": completed,
        "stopped_by_budget_before_round": strategy.stopped_before_round,
        "random_iterate_round": k_random,
        "finished_utc": datetime.now(UTC).isoformat(),
    }
    recorder.write_config(description)
    if summary:
        headline = task.headline_metric
        logger.info(
            "%s averaged over the last %d evaluated rounds: %.4f", headline, len(last5), summary[f"last5_{headline}"]
        )
    logger.info(
        "Done after %d rounds: (epsilon, delta) = (%.4g, %g); metrics in %s, model in %s",
        completed,
        strategy.epsilon,
        plan.delta,
        recorder.metrics_path,
        recorder.model_path,
    )
    return out_dir


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Validate ``run_config``, then :func:`run`. Bad config or federation: one ERROR line."""
    setup_app_process()
    try:
        cfg = RunConfig.from_run_config(context.run_config)
        plan = plan_privacy(cfg)
    except ConfigError as err:
        logger.error("%s", err)
        return
    try:
        run(grid, cfg, run_id=context.run_id, plan=plan)
    except FederationError as err:
        logger.error("federation does not match the run: %s", err)
    except (ConfigError, DataUnavailableError) as err:
        logger.error("%s", err)
