"""One run's bookkeeping, shared by every engine: results files, evaluation, logging, summary.

A :class:`RunSession` owns the run directory (``metrics.csv``, ``config.json``,
``model.npz``), decides when the server evaluates (``eval-every`` and the last
5 rounds), logs one line per round, and writes the final summary (epsilon
spent, the paper's last-5-round metric). The Flower ServerApp and the batched
engine both use it, so their outputs have one schema.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from dpfedavg.config import RunConfig
from dpfedavg.core.types import Vector
from dpfedavg.io.checkpoint import (
    CHECKPOINT_FILE,
    Checkpoint,
    check_compatible,
    load_checkpoint,
    privacy_signature,
    save_checkpoint,
)
from dpfedavg.io.metrics import RoundStats
from dpfedavg.io.results import RunRecorder, package_versions, read_metrics
from dpfedavg.privacy.guarantee import released_metric_names
from dpfedavg.server.dp_server import DPServer
from dpfedavg.tasks import Task, task_hooks

__all__ = ["RunResult", "RunSession", "run_directory"]

logger = logging.getLogger(__name__)


def run_directory(cfg: RunConfig, run_id: int | str) -> Path:
    """``<output-dir>/<run-name>``; the default name is ``<task>-<algorithm>-<UTC time>-<run id>``."""
    task = re.sub(r"[^A-Za-z0-9._-]+", "-", cfg.task.rsplit("/", 1)[-1])  # a user's "/path/mytask.py:make_task"
    name = cfg.run_name or f"{task}-{cfg.algorithm}-{datetime.now(UTC):%Y%m%d-%H%M%S}-{run_id}"
    return Path(cfg.output_dir).expanduser().resolve() / name


@dataclass(frozen=True)
class RunResult:
    """What a finished run returns (its files are in :attr:`directory`).

    Attributes
    ----------
    weights:
        ``w_K``, the last model (flat, float64), as in ``model.npz`` ``w_final``.
    random_iterate:
        ``w_{k~}`` (Alg. 1 line 13), the iterate the paper's guarantee is about, and its round.
    epsilon, delta:
        The ``(epsilon, delta)`` the run spent (``inf`` without DP).
    guarantee:
        ``"dp"``, ``"seeded"`` or ``"none"`` (``config.json`` ``privacy.guarantee`` explains it).
    history:
        ``metrics.csv`` as a list of rows (round 0 first): column -> value, NaN where empty.
    directory:
        The run directory: ``metrics.csv``, ``config.json``, ``model.npz``, ``metrics.png``.
    """

    weights: np.ndarray
    random_iterate: np.ndarray
    random_round: int
    epsilon: float
    delta: float
    guarantee: str
    history: list[dict[str, float]]
    directory: Path
    stopped_by_budget_before_round: int | None = None


class RunSession:
    """Results and logging of one run.

    Parameters
    ----------
    cfg, task, server:
        The run's config, task and server state.
    run_id:
        Flower's run id (or any label) for the default run name and ``config.json``.
    engine:
        ``flower`` or ``batched``, recorded in ``config.json``.
    """

    def __init__(self, cfg: RunConfig, task: Task, server: DPServer, run_id: int | str, engine: str) -> None:
        self.cfg, self.task, self.server = cfg, task, server
        self.directory = run_directory(cfg, run_id)
        #: The checkpoint this run resumes from (``resume=true``), checked before anything is written.
        self.resumed: Checkpoint | None = None
        if cfg.resume:
            self.resumed = load_checkpoint(self.directory)
            check_compatible(self.resumed, cfg, server.plan, server.dim)
        elif (self.directory / CHECKPOINT_FILE).exists():
            logger.warning(
                "%s holds a checkpoint of an earlier run; starting over (resume=true would continue it, "
                "without spending the privacy budget again)",
                self.directory,
            )
        keep = self.resumed.round if self.resumed is not None else None
        #: The task metrics this run computes (training-data metrics are withheld with secure-noise).
        self.metric_names = released_metric_names(
            task.metric_names, task_hooks(task).training_data_metrics, cfg.secure_noise
        )
        self.recorder = RunRecorder(self.directory, RoundStats.columns(self.metric_names), keep_rounds_through=keep)
        self.evaluated: dict[int, dict[str, float]] = {}
        self.trajectory: list[np.ndarray] = []
        self.description = self._describe(run_id, engine)
        self.recorder.write_config(self.description)
        self._t0 = time.monotonic() - (self.resumed.elapsed_s if self.resumed is not None else 0.0)
        logger.info("Results will be written to %s", self.directory)
        self._log_privacy()

    def _describe(self, run_id: int | str, engine: str) -> dict[str, Any]:
        cfg = self.cfg
        client_std, server_std = self.server.noise_stds(round(cfg.clients_per_round))
        return {
            "run_config": cfg.to_run_config(),
            "run_id": run_id,
            "engine": engine,
            "seed": cfg.seed,
            "derived": {
                "n": cfg.num_clients,
                "r": cfg.clients_per_round,
                "q": cfg.sampling_rate,
                "dim": self.server.dim,
                "client_noise_std_at_r": client_std,
                "server_noise_std": server_std,
            },
            "privacy": self.server.describe_privacy(),
            "versions": package_versions(),
            "started_utc": datetime.now(UTC).isoformat(),
        }

    def _log_privacy(self) -> None:
        plan, cfg = self.server.plan, self.cfg
        if plan.dp:
            logger.info(
                "Privacy: z = %.5g (%s), %s accountant, delta = %g, %s placement; epsilon after %d rounds: %.4g",
                plan.noise_multiplier,
                f"calibrated for epsilon = {plan.target_epsilon:g}" if plan.calibrated else "given",
                plan.accountant,
                plan.delta,
                cfg.noise_placement,
                plan.rounds,
                plan.nominal_epsilon,
            )
            g = self.description["privacy"]["guarantee"]
            (logger.info if g["level"] == "dp" else logger.warning)("Guarantee: %s", g["text"])
            withheld = set(self.task.metric_names) - set(self.metric_names)
            if withheld:
                logger.info(
                    "secure-noise: not computing %s (from the clients' private data)", ", ".join(sorted(withheld))
                )
        else:
            logger.warning(
                "NO DIFFERENTIAL PRIVACY: %s",
                f"algorithm={cfg.algorithm!r} (epsilon, delta and noise-multiplier are not used)"
                if not self.server.bound.private
                else "noise multiplier 0 (updates are clipped/normalized but not noised; epsilon is infinite)",
            )

    def begin(self, w0: Vector) -> tuple[Vector, int]:
        """Start the run: ``(w_0, 1)`` after recording round 0, or a resumed run's ``(w_k, k + 1)``.

        On resume the server gets back its momentum, random iterate, per-round
        statistics and the accountant's history (epsilon continues; it never
        restarts from 0).
        """
        ckpt = self.resumed
        if ckpt is None:
            self.record_round(0, w0)
            return w0, 1
        self.server.restore(ckpt.server)
        self.evaluated = dict(ckpt.evaluated)
        if ckpt.trajectory is not None:
            self.trajectory = list(ckpt.trajectory)
        spent = self.server.epsilon if self.server.accountant is not None else float("inf")
        logger.info(
            "Resuming after round %d of %d from %s (epsilon spent so far: %.4g)",
            ckpt.round,
            self.cfg.num_rounds,
            self.directory / CHECKPOINT_FILE,
            spent,
        )
        return ckpt.w.copy(), ckpt.round + 1

    def end_round(self, server_round: int, w: Vector) -> dict[str, float]:
        """:meth:`record_round`, then a checkpoint every ``checkpoint-every`` rounds."""
        metrics = self.record_round(server_round, w)
        every = self.cfg.checkpoint_every
        if every and server_round % every == 0 and server_round < self.cfg.num_rounds:
            self.checkpoint(server_round, w)
        return metrics

    def checkpoint(self, server_round: int, w: Vector) -> bool:
        """Write the state after ``server_round``; a failed write is logged and the old checkpoint kept."""
        ckpt = Checkpoint(
            round=server_round,
            w=np.asarray(w, dtype=np.float64),
            server=self.server.state(),
            run_config=self.cfg.to_run_config(),
            privacy=privacy_signature(self.cfg, self.server.plan),
            evaluated=self.evaluated,
            elapsed_s=time.monotonic() - self._t0,
            trajectory=np.stack(self.trajectory) if self.trajectory else None,
        )
        try:
            save_checkpoint(self.directory, ckpt)
        except Exception as err:  # noqa: BLE001 - a failed checkpoint must not end the run
            logger.error(
                "checkpoint after round %d failed (%s: %s); the previous checkpoint is kept, training continues",
                server_round,
                type(err).__name__,
                err,
            )
            return False
        logger.debug("checkpoint written after round %d", server_round)
        return True

    def evaluates_after(self, server_round: int) -> bool:
        """Whether the server evaluates after ``server_round`` (round 0 = the initial model)."""
        k, total = server_round, self.cfg.num_rounds
        return k == 0 or k % self.cfg.eval_every == 0 or k > total - 5

    def record_round(self, server_round: int, w: Vector | None) -> dict[str, float]:
        """Evaluate ``w`` if due, write the round's row and log its line; returns the task metrics."""
        metrics = self.task.evaluate(w) if (w is not None and self.evaluates_after(server_round)) else {}
        metrics = {k: v for k, v in metrics.items() if k in self.metric_names}
        if self.cfg.save_trajectory and w is not None:
            self.trajectory.append(np.asarray(w, dtype=np.float32))
        if metrics:
            self.evaluated[server_round] = metrics
        stats: RoundStats | None = self.server.history.get(server_round)
        row: dict[str, Any] = {"round": server_round, **metrics, "elapsed_s": round(time.monotonic() - self._t0, 3)}
        if stats is not None:
            row.update(stats.as_metrics())
        self.recorder.write_row(row)
        shown = " | ".join(f"{k} {v:.4g}" for k, v in metrics.items()) or "not evaluated"
        if stats is None:
            logger.info("round %d/%d | %s", server_round, self.cfg.num_rounds, shown)
        else:
            clipped = "" if math.isnan(stats.frac_clipped) else f" | clipped {100 * stats.frac_clipped:.0f}%"
            if not math.isnan(stats.frac_unclipped):  # adaptive-clip: C_k and the released b_k
                clipped = f" | C {stats.clip:.4g}, unclipped (noised) {100 * stats.frac_unclipped:.0f}%"
            logger.info(
                "round %d/%d | sampled %d, received %d | %s%s | epsilon %.4g",
                server_round,
                self.cfg.num_rounds,
                stats.num_sampled,
                stats.num_received,
                shown,
                clipped,
                stats.epsilon,
            )
        return metrics

    def _write_final(
        self,
        last5: list[dict[str, float]],
        completed: int,
        stopped_before_round: int | None,
        k_random: int,
        failed: str | None,
    ) -> dict[str, float]:
        """``config.json``'s ``final``: the last-5-round metrics, epsilon, the guarantee; returns the metrics."""
        names = self.metric_names
        summary = {f"last5_{name}": float(np.mean([m[name] for m in last5])) for name in names} if last5 else {}
        self.description["final"] = {
            **summary,
            "epsilon": self.server.epsilon,
            "delta": self.server.plan.delta,
            "guarantee": self.description["privacy"]["guarantee"]["level"],
            "rounds_completed": completed,
            "stopped_by_budget_before_round": stopped_before_round,
            "random_iterate_round": k_random,
            "stopped_because": failed,
            "finished_utc": datetime.now(UTC).isoformat(),
        }
        self.recorder.write_config(self.description)
        return summary

    def finish(
        self,
        w_final: Vector,
        stopped_before_round: int | None = None,
        *,
        checkpoint: bool = True,
        plot: bool = True,
        failed: str | None = None,
    ) -> RunResult:
        """Write ``model.npz``, the final summary into ``config.json`` and ``metrics.png``; the run's result.

        ``checkpoint`` / ``plot``: also the final ``checkpoint.npz`` (with ``checkpoint-every``) and ``metrics.png``;
        a sweep's batch (:mod:`dpfedavg.engines.batched_runs`) writes neither (a cell reruns whole, figures
        come from the sweep). ``failed``: why the run stopped early because its replies were unusable
        (``config.json`` ``final.stopped_because``).
        """
        server = self.server
        w_random = server.random_iterate if server.random_iterate is not None else w_final
        k_random = server.random_round if server.random_round is not None else 0
        self.recorder.write_model(w_final=w_final, w_random_iterate=w_random, random_iterate_round=k_random)
        if checkpoint and self.cfg.checkpoint_every and server.history:
            self.checkpoint(max(server.history), w_final)
        if self.trajectory:
            np.save(self.directory / "trajectory.npy", np.stack(self.trajectory))
        completed = len(server.history)
        last5 = [self.evaluated[k] for k in sorted(self.evaluated) if k > 0][-5:]
        summary = self._write_final(last5, completed, stopped_before_round, k_random, failed)
        epsilon = server.epsilon
        try:
            title = f"{self.cfg.task}, {self.cfg.algorithm}, C = {self.cfg.clip:g}, {self.cfg.noise_placement} noise"
            if plot:
                self.recorder.write_plot(self.task.headline_metric, title)
        except Exception as err:  # noqa: BLE001 - a plot must never fail a finished run
            logger.warning("metrics.png not written (%s: %s)", type(err).__name__, err)
        if f"last5_{self.task.headline_metric}" in summary:
            headline = self.task.headline_metric
            value = summary[f"last5_{headline}"]
            logger.info("%s averaged over the last %d evaluated rounds: %.4f", headline, len(last5), value)
        level = self.description["privacy"]["guarantee"]["level"]
        label = {"dp": "", "seeded": " [seeded mode: no protection against anyone who knows the seed]"}.get(
            level, " [NO privacy guarantee, see config.json]"
        )
        logger.info(
            "Done after %d rounds: (epsilon, delta) = (%.4g, %g)%s; metrics in %s, model in %s",
            completed,
            epsilon,
            server.plan.delta,
            label,
            self.recorder.metrics_path,
            self.recorder.model_path,
        )
        return RunResult(
            weights=np.asarray(w_final, dtype=np.float64),
            random_iterate=np.asarray(w_random, dtype=np.float64),
            random_round=k_random,
            epsilon=epsilon,
            delta=server.plan.delta,
            guarantee=level,
            history=read_metrics(self.recorder.metrics_path),
            directory=self.directory,
            stopped_by_budget_before_round=stopped_before_round,
        )
