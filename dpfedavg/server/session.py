"""One run's bookkeeping, shared by every engine: results files, evaluation, logging, summary.

A `RunSession` owns the run directory (``metrics.csv``, ``config.json``,
``model.npz``), decides when the server evaluates (``eval-every`` and the last
5 rounds), logs one line per round, and writes the final summary (epsilon
spent, the paper's last-5-round metric). The Flower ServerApp and the batched
engine both use it, so their outputs have one schema.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from dpfedavg.config import RunConfig
from dpfedavg.core.dp import SensitivityBound
from dpfedavg.core.types import Vector
from dpfedavg.errors import ResultsError
from dpfedavg.io.checkpoint import (
    CHECKPOINT_FILE,
    Checkpoint,
    CheckpointError,
    ServerState,
    check_compatible,
    check_resumable,
    load_checkpoint,
    nominal_accountant_state,
    privacy_signature,
    save_checkpoint,
)
from dpfedavg.io.metrics import NO_STATS, RoundStats
from dpfedavg.io.results import (
    RunRecorder,
    RunResult,
    check_run_directory,
    package_versions,
    read_metrics,
    run_directory,
)
from dpfedavg.privacy.guarantee import audit_clause, released_metric_names
from dpfedavg.privacy.plan import PrivacyPlan
from dpfedavg.server.releases import RELEASES_FILE, ReleaseLog, charges_redone_rounds
from dpfedavg.server.round import RoundRecord
from dpfedavg.tasks import Task, task_hooks

__all__ = ["RunSession"]

logger = logging.getLogger(__name__)


def _claim(cfg: RunConfig, run_id: int | str) -> Path:
    """The new run's directory, created: the named one (checked again), or the default name with a free suffix."""
    directory = run_directory(cfg, run_id)
    if cfg.run_name:
        check_run_directory(cfg)
        directory.mkdir(parents=True, exist_ok=True)
        return directory
    candidate, n = directory, 1
    while True:
        try:
            candidate.mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            n += 1
            candidate = directory.with_name(f"{directory.name}-{n}")
            continue
        if candidate != directory:
            logger.warning("%s exists (another run started in the same second): writing to %s", directory, candidate)
        return candidate


class RunServer(Protocol):
    """What a `RunSession` reads of the run's server (`dpfedavg.server.dp_server.DPServer`), and nothing more."""

    random_iterate: Vector | None
    random_round: int | None
    #: The sensitivity bound (``algorithm``); ``bound.private``: whether each client's vector is bounded.
    bound: SensitivityBound

    @property
    def epsilon(self) -> float: ...  # noqa: D102

    @property
    def history(self) -> Mapping[int, RoundStats]: ...  # noqa: D102

    @property
    def charges_redone_rounds(self) -> bool: ...  # noqa: D102

    def noise_stds(self, num_sampled: int) -> tuple[float, float]: ...  # noqa: D102

    def describe_privacy(self) -> dict[str, Any]: ...  # noqa: D102

    def state(self) -> ServerState: ...  # noqa: D102

    def restore(self, state: ServerState) -> None: ...  # noqa: D102


class RunSession:
    """Results and logging of one run.

    Parameters
    ----------
    cfg, task:
        The run's config and task.
    plan, dim:
        The run's privacy plan and the model's length (what a checkpoint is checked against).
    server_for:
        Builds the run's server given its write-ahead record of releases (``secure-noise``; ``None`` otherwise),
        once the session has opened the run directory or the checkpoint: the record is the server's from the
        start. The session reads the server through `RunServer` only.
    run_id:
        Flower's run id (or any label) for the default run name and ``config.json``.
    engine:
        ``flower`` or ``batched``, recorded in ``config.json``.
    """

    def __init__(
        self,
        cfg: RunConfig,
        task: Task,
        run_id: int | str,
        engine: str,
        *,
        plan: PrivacyPlan,
        dim: int,
        server_for: Callable[[ReleaseLog | None], RunServer],
    ) -> None:
        self.cfg, self.task, self.plan, self.dim = cfg, task, plan, dim
        #: ``checkpoint-every``; ``"auto"``: every round under Flower (each durable before the next is sent), else 10.
        every = cfg.checkpoint_every
        self.checkpoint_every = every if every is not None else (1 if engine == "flower" else 10)
        #: The canary audit to record in ``config.json`` ``final.audit`` and the last log line (set before ``finish``).
        self.audit: dict[str, Any] | None = None
        #: The task metrics this run computes (training-data metrics are withheld with secure-noise).
        self.metric_names = released_metric_names(
            task.metric_names, task_hooks(task).training_data_metrics, cfg.secure_noise
        )
        columns = RoundStats.columns(self.metric_names)
        #: The checkpoint this run resumes from (``resume=true``), checked before anything is written.
        self.resumed: Checkpoint | None = None
        #: Releases charged beyond the completed rounds without a write-ahead record (a resumed checkpoint's).
        self._redone_before = 0
        #: The write-ahead record of releases (``secure-noise``), the server's from its construction; its file is
        #: opened once the run directory is (the server's own checks come first: nothing is written before them).
        # a Flower run's nodes may draw their own noise whatever the seed (a node policy's secure-noise): its redone
        # rounds may be fresh releases the server cannot rule out, so it keeps the record too
        own_noise = cfg.secure_noise or engine == "flower"
        self.release_log = ReleaseLog.pending(plan) if charges_redone_rounds(own_noise, plan) else None
        self.server = server_for(self.release_log)
        if cfg.resume:
            self.directory = run_directory(cfg, run_id)
            self.resumed = load_checkpoint(self.directory)
            check_compatible(self.resumed, cfg, plan, dim)
            rows_after = check_resumable(self.directory, self.resumed, columns, cfg.num_rounds)
            if self.release_log is not None:
                assert self.resumed.releases is not None
                self.release_log.open_resumed(
                    self.directory, plan, self.resumed.round, self.resumed.releases, rows_after
                )
            # the accountant is rebuilt from the releases (the round count, plus every round started after a
            # checkpoint with secure-noise) and the plan; the stored one was checked equal to it above
            releases = self._releases_on_resume(self.resumed)
            self._redone_before = releases - self.resumed.round
            self.resumed.server.accountant = nominal_accountant_state(plan, releases)
            try:  # the server's own checks of its state (the noise mechanism's history), before any file is touched
                self.server.restore(self.resumed.server)
            except (ValueError, TypeError, KeyError) as err:
                raise CheckpointError(f"checkpoint {self.directory / CHECKPOINT_FILE}: {err}") from None
        else:
            self.directory = _claim(cfg, run_id)
        #: The round of the last checkpoint written (or resumed from), for the messages of a failed write.
        self.last_checkpoint: int | None = self.resumed.round if self.resumed is not None else None
        #: The last round whose row is in metrics.csv.
        self.last_row: int | None = self.resumed.round if self.resumed is not None else None
        keep = self.resumed.round if self.resumed is not None else None
        self.evaluated: dict[int, dict[str, float]] = {}
        self.trajectory: list[np.ndarray] = []
        self.description = self._describe(run_id, engine)
        try:
            self.recorder = RunRecorder(self.directory, columns, keep_rounds_through=keep)
            self.recorder.write_config(self.description)
            if self.resumed is None and self.release_log is not None:
                self.release_log.open_new(self.directory)
        except OSError as err:
            raise self._results_error(
                f"the run's first files (metrics.csv, config.json, {RELEASES_FILE})", err
            ) from None
        self._t0 = time.monotonic() - (self.resumed.elapsed_s if self.resumed is not None else 0.0)
        logger.info("Results will be written to %s", self.directory)
        self._log_privacy()

    def _releases_on_resume(self, ckpt: Checkpoint) -> int:
        """The releases to charge on resume: the checkpoint's, plus the rounds this run redoes (``secure-noise``).

        With ``secure-noise`` the write-ahead record (``dpfedavg.server.releases``, read before the server was
        built and given to it): each round started after the checkpoint was a fresh release, and is charged.
        Seeded mode: the checkpoint's count (a redone round is bit-identical to its first attempt, it releases
        nothing new).
        """
        assert ckpt.releases is not None
        log = self.release_log
        if log is None:
            return ckpt.releases
        redone = log.count - ckpt.releases
        if redone and not self.server.charges_redone_rounds:
            raise CheckpointError(
                f"cannot resume {self.directory}: {redone} round(s) ran after the checkpoint (round {ckpt.round}) "
                f"with secure-noise, and noise-mechanism = {self.cfg.noise_mechanism!r} cannot account a round "
                "released twice; redoing them would release more than the reported epsilon covers. Start a new run "
                "(it spends a new budget), and use checkpoint-every = 1 with this mechanism"
            )
        if redone:
            logger.warning(
                "%d round(s) started after the checkpoint of round %d before the run stopped; with secure-noise each "
                "was a fresh release and is charged: the rounds redone now cost epsilon again (%d releases so far)",
                redone,
                ckpt.round,
                log.count,
            )
        return log.count

    def _results_error(self, what: str, err: OSError) -> ResultsError:
        """The one error of a failed write: what is on disk, and how to continue."""
        rows = f"metrics.csv holds rounds 0..{self.last_row}" if self.last_row is not None else "metrics.csv is empty"
        ckpt = (
            f"the last checkpoint is after round {self.last_checkpoint}"
            if self.last_checkpoint is not None
            else "there is no checkpoint yet"
        )
        how = (
            f"free space and rerun with resume=true and run-name='{self.directory.name}' to continue from it"
            if self.last_checkpoint is not None
            else "free space and start the run again"
        )
        reason = err.strerror or str(err)
        return ResultsError(
            f"could not write {what} in {self.directory} ({reason}); the run stops. Every file there is complete: "
            f"{rows}, {ckpt}; {how}"
        )

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
                "dim": self.dim,
                "client_noise_std_at_r": client_std,
                "server_noise_std": server_std,
            },
            "privacy": self.server.describe_privacy(),
            "versions": package_versions(),
            "started_utc": datetime.now(UTC).isoformat(),
        }

    def _log_privacy(self) -> None:
        plan, cfg = self.plan, self.cfg
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

        On resume the server got back its momentum, random iterate, per-round
        statistics, the accountant's history (epsilon continues; it never
        restarts from 0) and its noise mechanism's state when the session was made.
        """
        ckpt = self.resumed
        if ckpt is None:
            self.record_round(0, w0)
            return w0, 1
        self.evaluated = dict(ckpt.evaluated)
        if ckpt.trajectory is not None:
            self.trajectory = list(ckpt.trajectory)
        spent = self.server.epsilon
        logger.info(
            "Resuming after round %d of %d from %s (epsilon spent so far: %.4g)",
            ckpt.round,
            self.cfg.num_rounds,
            self.directory / CHECKPOINT_FILE,
            spent,
        )
        return ckpt.w.copy(), ckpt.round + 1

    def end_round(self, record: RoundRecord) -> dict[str, float]:
        """`record_round()` of a closed round, then a checkpoint every ``checkpoint-every`` rounds."""
        server_round, w = record.round, record.w
        metrics = self.record_round(server_round, w, record.stats)
        every = self.checkpoint_every
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
            privacy=privacy_signature(self.cfg, self.plan),
            evaluated=self.evaluated,
            elapsed_s=time.monotonic() - self._t0,
            trajectory=np.stack(self.trajectory) if self.trajectory else None,
            releases=self.releases,
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
        self.last_checkpoint = server_round
        logger.debug("checkpoint written after round %d", server_round)
        return True

    @property
    def releases(self) -> int:
        """The releases charged so far: the rounds completed, plus the rounds redone after crashes (secure-noise)."""
        log = self.release_log
        return log.count if log is not None else len(self.server.history) + self._redone_before

    def evaluates_after(self, server_round: int) -> bool:
        """Whether the server evaluates after ``server_round`` (round 0 = the initial model)."""
        k, total = server_round, self.cfg.num_rounds
        return k == 0 or k % self.cfg.eval_every == 0 or k > total - 5

    def record_round(self, server_round: int, w: Vector | None, stats: RoundStats | None = None) -> dict[str, float]:
        """Evaluate ``w`` if due, write the round's row (``stats``: its statistics; none for round 0) and log its
        line; returns the task metrics."""
        metrics = self.task.evaluate(w) if (w is not None and self.evaluates_after(server_round)) else {}
        metrics = {k: v for k, v in metrics.items() if k in self.metric_names}
        if self.cfg.save_trajectory and w is not None:
            self.trajectory.append(np.asarray(w, dtype=np.float32))
        if metrics:
            self.evaluated[server_round] = metrics
        head, tail = stats.csv_parts() if stats is not None else NO_STATS
        row = [server_round, *head, *[metrics.get(name, math.nan) for name in self.metric_names], *tail,
               round(time.monotonic() - self._t0, 3)]  # fmt: skip
        try:
            self.recorder.write_values(row)
        except OSError as err:
            raise self._results_error(f"round {server_round}'s row of metrics.csv", err) from None
        self.last_row = server_round
        if not logger.isEnabledFor(logging.INFO):  # a sweep's runs: the line is not shown
            return metrics
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

    def _final(
        self, last5: list[dict[str, float]], completed: int, stopped_before_round: int | None, k_random: int,
        failed: str | None,
    ) -> tuple[dict[str, float], dict[str, Any]]:  # fmt: skip
        """The last-5-round metrics and ``config.json``'s ``final``: those, epsilon, the guarantee, why it stopped."""
        names = self.metric_names
        summary = {f"last5_{name}": float(np.mean([m[name] for m in last5])) for name in names} if last5 else {}
        final = {
            **summary,
            "epsilon": self.server.epsilon,
            "delta": self.plan.delta,
            "guarantee": self.description["privacy"]["guarantee"]["level"],
            "rounds_completed": completed,
            "releases": self.releases,
            "stopped_by_budget_before_round": stopped_before_round,
            "random_iterate_round": k_random,
            "stopped_because": failed,
            "finished_utc": datetime.now(UTC).isoformat(),
        }
        if self.audit is not None:
            final["audit"] = self.audit
        return summary, final

    def finish(self, w_final: Vector, stopped_before_round: int | None = None, **options: Any) -> RunResult:
        """`write_final()` (``options``: its ``checkpoint``, ``plot`` and ``failed``), then the run's result, with
        ``metrics.csv`` read back."""
        w_random, k_random, epsilon, level = self.write_final(w_final, stopped_before_round, **options)
        return RunResult(
            weights=np.asarray(w_final, dtype=np.float64),
            random_iterate=np.asarray(w_random, dtype=np.float64),
            random_round=k_random,
            epsilon=epsilon,
            delta=self.plan.delta,
            guarantee=level,
            history=read_metrics(self.recorder.metrics_path),
            directory=self.directory,
            stopped_by_budget_before_round=stopped_before_round,
            audit=self.audit,
        )

    def write_final(
        self,
        w_final: Vector,
        stopped_before_round: int | None = None,
        *,
        checkpoint: bool = True,
        plot: bool = True,
        failed: str | None = None,
    ) -> tuple[Vector, int, float, str]:
        """Write the final checkpoint, ``model.npz``, then ``config.json``'s summary (last: a run is finished once it is
        there) and ``metrics.png``, and log the run's last lines; ``(w_{k~}, k~, epsilon, guarantee level)``.

        `finish()` is this plus the run's result; a sweep's batch reads no result and calls this alone.
        ``checkpoint`` / ``plot``: also the final ``checkpoint.npz`` (with ``checkpoint-every``) and ``metrics.png``;
        a sweep's batch (`dpfedavg.engines.batched_runs`) writes neither (a cell reruns whole, figures
        come from the sweep). ``failed``: why the run stopped early because its replies were unusable
        (``config.json`` ``final.stopped_because``).

        A failed write of the model, the trajectory or ``config.json`` is one `ResultsError`: the run reads
        as unfinished, and ``resume=true`` from the final checkpoint writes them (no round is run again).
        """
        server = self.server
        w_random = server.random_iterate if server.random_iterate is not None else w_final
        k_random = server.random_round if server.random_round is not None else 0
        if checkpoint and self.checkpoint_every and server.history:
            self.checkpoint(max(server.history), w_final)
        completed = len(server.history)
        last5 = [self.evaluated[k] for k in sorted(self.evaluated) if k > 0][-5:]
        summary, final = self._final(last5, completed, stopped_before_round, k_random, failed)
        epsilon = server.epsilon
        try:
            self.recorder.write_model(w_final=w_final, w_random_iterate=w_random, random_iterate_round=k_random)
            if self.trajectory:
                self.recorder.write_array("trajectory.npy", np.stack(self.trajectory))
            self.recorder.write_config({**self.description, "final": final})
        except OSError as err:
            raise self._results_error("the finished run's model.npz, trajectory.npy or config.json", err) from None
        self.description["final"] = final
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
        logger.info("Done after %d rounds: (epsilon, delta) = (%.4g, %g)%s%s; metrics in %s, model in %s", completed,
                    epsilon, self.plan.delta, label, audit_clause(self.audit), self.recorder.metrics_path,
                    self.recorder.model_path)  # fmt: skip
        return w_random, k_random, epsilon, level

