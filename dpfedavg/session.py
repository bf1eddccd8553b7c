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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from dpfedavg.checkpoint import (
    CHECKPOINT_FILE,
    Checkpoint,
    check_compatible,
    load_checkpoint,
    privacy_signature,
    save_checkpoint,
)
from dpfedavg.config import RunConfig
from dpfedavg.core import server_noise_std
from dpfedavg.core.adaptive_clip import update_noise_multiplier
from dpfedavg.core.dp import get_bound
from dpfedavg.core.mechanism import get_placement
from dpfedavg.core.secagg import quantization_error_bound
from dpfedavg.core.types import Vector
from dpfedavg.privacy.accounting import PrivacyPlan
from dpfedavg.results import RunRecorder, package_versions
from dpfedavg.server.dp_server import DPServer, RoundStats, secagg_privacy_terms
from dpfedavg.tasks import Task

__all__ = ["RunSession", "describe_privacy", "guarantee", "released_metric_names", "run_directory"]

logger = logging.getLogger(__name__)


def run_directory(cfg: RunConfig, run_id: int | str) -> Path:
    """``<output-dir>/<run-name>``; the default name is ``<task>-<algorithm>-<UTC time>-<run id>``."""
    task = re.sub(r"[^A-Za-z0-9._-]+", "-", cfg.task.rsplit("/", 1)[-1])  # a user's "/path/mytask.py:make_task"
    name = cfg.run_name or f"{task}-{cfg.algorithm}-{datetime.now(UTC):%Y%m%d-%H%M%S}-{run_id}"
    return Path(cfg.output_dir).expanduser().resolve() / name


#: Per-round columns computed from un-noised client data (only in seeded mode; see :func:`guarantee`).
NON_PRIVATE_TRAIN_COLUMNS = ("frac_clipped", "mean_update_norm", "snr")


def released_metric_names(cfg: RunConfig, task: Task) -> tuple[str, ...]:
    """The task's metrics this run computes: with ``secure-noise`` those from the clients' data are withheld."""
    private = set(getattr(task, "training_data_metrics", ()))
    return tuple(m for m in task.metric_names if not (cfg.secure_noise and m in private))


def guarantee(cfg: RunConfig, plan: PrivacyPlan) -> dict[str, str]:
    """What the reported (epsilon, delta) protects, and against whom (``config.json``, start-up log, summary).

    ``level`` is ``"dp"`` only with noise, ``secure-noise = true`` and no ``diagnostics``; ``"seeded"`` means
    the guarantee holds only against someone who does not know ``seed``; ``"none"`` means no guarantee.
    """
    adjacency = get_placement(cfg.noise_placement).adjacency
    if not plan.dp:
        return {"level": "none", "text": "NONE: the run adds no noise (epsilon is infinite)"}
    if cfg.diagnostics:
        return {
            "level": "none",
            "text": "NONE: diagnostics = true sends every client's clean update to the server (research only)",
        }
    if not cfg.secure_noise:
        return {
            "level": "seeded",
            "text": (
                f"NONE against anyone who knows seed = {cfg.seed} (recorded here): the noise, the sampled clients "
                "and the random iterate can be regenerated from it (seeded research mode). The reported epsilon "
                f"holds only against an observer who does not know the seed; unit: {adjacency}. "
                "Use secure-noise = true for real users."
            ),
        }
    return {
        "level": "dp",
        "text": (
            f"(epsilon, delta)-DP for one client's whole dataset ({adjacency}) for everything this run releases "
            "(the models, the random iterate, the test-set metrics); see the README's Privacy section for "
            "what each party sees"
        ),
    }


def describe_privacy(cfg: RunConfig, plan: PrivacyPlan, server: DPServer | None = None) -> dict[str, Any]:
    """The privacy set-up for ``config.json`` (with ``server``, also its secure-aggregation encoding)."""
    placement = get_placement(cfg.noise_placement)
    return {
        "guarantee": guarantee(cfg, plan),
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
        "privacy_unit": f"one client's whole dataset; neighbours: {placement.adjacency}",
        "noise": placement.description,
        "non_private_outputs": (
            "none: per-client norms are not sent and training-data metrics are not computed"
            if cfg.secure_noise
            else "metrics.csv columns " + ", ".join(NON_PRIVATE_TRAIN_COLUMNS) + " and the training-data metrics "
            "of the task are computed from un-noised client data (seeded research mode; not covered)"
        ),
        "counts_not_covered": (
            "metrics.csv's num_sampled / num_received / num_failed / num_dropped / num_rejected / skipped "
            "(the server's view of participation; publish the model and epsilon, not metrics.csv)"
            + ("; each sampled client also learns |S_k|" if placement.per_client == "cohort" else "")
        ),
        "sensitivity_of_sum": cfg.clip,
        "adaptive_clipping": describe_adaptive_clipping(cfg, plan) if get_bound(cfg.algorithm).adaptive else None,
        "secure_aggregation": (
            describe_secure_aggregation(server) if server is not None and cfg.secure_aggregation else None
        ),
    }


def describe_adaptive_clipping(cfg: RunConfig, plan: PrivacyPlan) -> dict[str, Any]:
    """``adaptive-clip``'s noise split (Andrew et al. 2021, Theorem 1) and what each round releases."""
    z = plan.noise_multiplier
    return {
        "reference": "Andrew, Thakkar, McMahan, Ramaswamy 2021, Differentially private learning with adaptive clipping",
        "initial_clip": cfg.clip,
        "target_quantile": cfg.target_quantile,
        "clip_lr": cfg.clip_lr,
        "count_stddev": cfg.count_stddev,
        "update_noise_multiplier": update_noise_multiplier(z, cfg.count_stddev) if plan.dp else 0.0,
        "released": (
            "per round: the update sum with N(0, (z_u C_k)^2 I) and T_k = sum_i (1[||u_i|| <= C_k] - 1/2) + "
            "N(0, sigma_b^2); b_k = 1/2 + T_k / r (metrics.csv frac_unclipped), C_{k+1} = C_k exp(-eta_C (b_k - "
            "gamma)); together one Gaussian mechanism with noise multiplier z (sensitivity C_k and 1/2)"
        ),
        "sensitivity_of_sum": "C_k (metrics.csv clip), changing every round",
    }


def describe_secure_aggregation(server: DPServer) -> dict[str, Any]:
    """The SecAgg+ encoding at ``|S_k| = r`` and its error and privacy terms (see :mod:`dpfedavg.core.secagg`).

    ``clip_probability_bound`` is a union bound over every coordinate of every
    client that could be sampled in every round (``K n d``, each at most
    ``2 exp(-k^2/2)``); the run's guarantee is then
    ``(epsilon, delta + (1 + e^epsilon) p)``. ``ddg_tau`` is the distance of
    the summed discrete Gaussians from a discrete Gaussian (at ``|S_k| = n``, the
    worst case). The same terms decide :func:`~dpfedavg.server.dp_server.check_secure_aggregation`.
    """
    cfg, plan, d = server.cfg, server.plan, server.dim
    r = max(1, round(cfg.clients_per_round))
    grid = server.secagg_grid(r)
    assert grid is not None  # secure-aggregation is on
    terms = secagg_privacy_terms(server)
    return {
        "protocol": "SecAgg+ (Flower SecAggPlusWorkflow / secaggplus_mod)",
        "num_shares": cfg.secagg_num_shares,
        "reconstruction_threshold": cfg.secagg_reconstruction_threshold,
        "grid_step_at_r": grid.step,
        "clipping_range_at_r": grid.clipping_range,
        "quantization_levels": grid.levels,
        "modulus": grid.modulus,
        "max_clients_per_round": grid.max_participants,
        "quantization_error_bound_of_sum_at_r": quantization_error_bound(grid, r, d),
        "clip_probability_bound": terms.clip_probability,
        "delta_including_clipping": terms.delta_including_clipping if plan.dp else None,
        "ddg_tau": terms.tau,
    }


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
        self.metric_names = released_metric_names(cfg, task)
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
            "privacy": describe_privacy(cfg, self.server.plan, self.server),
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
            g = guarantee(cfg, plan)
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
                if not get_bound(cfg.algorithm).private
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
        self.server.restore(
            momentum=ckpt.momentum,
            random_iterate=ckpt.random_iterate,
            random_round=ckpt.random_round,
            accountant_history=ckpt.accountant_history,
            history=ckpt.history,
            adaptive_clip=ckpt.adaptive_clip,
        )
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
        state = self.server.state()
        ckpt = Checkpoint(
            round=server_round,
            w=np.asarray(w, dtype=np.float64),
            momentum=state["momentum"],
            random_iterate=state["random_iterate"],
            random_round=state["random_round"],
            run_config=self.cfg.to_run_config(),
            privacy=privacy_signature(self.cfg, self.server.plan),
            accountant_history=state["accountant_history"],
            history=state["history"],
            evaluated=self.evaluated,
            elapsed_s=time.monotonic() - self._t0,
            trajectory=np.stack(self.trajectory) if self.trajectory else None,
            adaptive_clip=state["adaptive_clip"],
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

    def finish(
        self, w_final: Vector, stopped_before_round: int | None = None, *, checkpoint: bool = True, plot: bool = True
    ) -> Path:
        """Write ``model.npz`` and the final summary into ``config.json``; returns the run directory.

        ``checkpoint`` / ``plot``: also the final ``checkpoint.npz`` (with ``checkpoint-every``) and ``metrics.png``;
        a sweep's batch (:mod:`dpfedavg.engines.batched_runs`) writes neither (a cell reruns whole, figures
        come from the sweep).
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
        names = self.metric_names
        summary = {f"last5_{name}": float(np.mean([m[name] for m in last5])) for name in names} if last5 else {}
        epsilon = server.epsilon
        self.description["final"] = {
            **summary,
            "epsilon": epsilon,
            "delta": server.plan.delta,
            "guarantee": self.description["privacy"]["guarantee"]["level"],
            "rounds_completed": completed,
            "stopped_by_budget_before_round": stopped_before_round,
            "random_iterate_round": k_random,
            "finished_utc": datetime.now(UTC).isoformat(),
        }
        self.recorder.write_config(self.description)
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
        return self.directory
