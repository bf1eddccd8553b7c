"""The batched engine with a leading run axis: many runs of one federation in one round loop.

A sweep's cells differ in ``C``, ``eta``, ``beta``, ``mu``, ``z``, the initialization, the algorithm (``clip``,
``norm``, ``adaptive-clip``) or the seed, over the same task data, ``n``, ``r``, ``d``, ``E`` and ``K``. This
engine runs such a *batch* of runs together, round by round:

* every run keeps its own server (`DPServer`: Poisson sampling, the
  privacy budget, the random iterate, adaptive clipping's ``C_k``, momentum, the accountant) and its own
  results (`RunSession`): the files of a run are those `run_batched()` writes
  for it alone, except ``metrics.png`` and the final ``checkpoint.npz`` (a sweep's figures replace the
  first, and a sweep reruns an interrupted cell whole, so the second would never be read);
* the clients' work is vectorized over runs x clients: the task's ``client_runs_update_fn`` (local steps,
  Alg. 1 lines 5-9, for ``(R, B)`` runs x clients) and `dpfedavg.core.runs.released_sums()` (the bound,
  the noise and the sum of lines 9-12, through the same `bound_block()` as
  every engine);
* runs with the same seed sample the same clients and share every client's noise stream, so the standard
  normal draws of a round are made once (`shared_standard_normals()`), summed over the clients once, and
  scaled by each run's own std: a run's noise is the sum of the draws it makes alone (rounded differently);
* the server evaluates every run due in one call when the task has ``evaluate_runs`` (the quadratic).

So a run gives what it gives alone, up to floating-point rounding in the products and sums (tested to 1e-9
on ``synthetic.csv`` and ``table1.csv``; ``tests/test_batched_runs.py``).

A run can join a batch when `unbatchable_reason()` says nothing (not ``secure-noise``: its draws
cannot be shared; not secure aggregation: the encoding is per run; not ``resume``) and its task has
``client_runs_update_fn``. Runs join the same batch when `batch_key()` is equal: every key other than
`RUN_KEYS` and the task's ``run_axis_keys`` (e.g. the quadratic's ``init``) must match.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from dpfedavg.config import RunConfig
from dpfedavg.core.runs import RunSums, released_sums, shared_standard_normals
from dpfedavg.core.types import RoundInstructions, Vector
from dpfedavg.engines.allocator import keep_freed_memory
from dpfedavg.engines.batched import BLOCK_ELEMENTS, diverged
from dpfedavg.server.round import RoundRecord, RoundReplies
from dpfedavg.tasks import Task, build_task, task_hooks

__all__ = ["RUN_KEYS", "BatchError", "batch_key", "run_batch", "task_reason", "unbatchable_reason"]

logger = logging.getLogger(__name__)

#: run_config keys that may differ between the runs of one batch: the engine handles them run by run.
#: (``seed``: runs with another seed sample other clients and draw other noise, so they form their own group
#: inside the batch; it is only in a batch key when the task's data depends on it.)
RUN_KEYS: frozenset[str] = frozenset(
    {
        "algorithm", "clip", "local-lr", "lr-decay", "server-lr", "server-momentum", "epsilon", "delta",
        "noise-multiplier", "accountant", "max-epsilon", "noise-placement", "target-quantile", "clip-lr",
        "clip-count-stddev", "diagnostics", "output-dir", "run-name", "node-wait-timeout", "round-timeout",
        "clients-per-node", "save-trajectory", "checkpoint-every", "eval-every", "secagg-quantization-bits",
        "secagg-modulus-bits", "secagg-clip-stds", "secagg-num-shares", "secagg-reconstruction-threshold",
        "secagg-timeout",
    }
)  # fmt: skip


class BatchError(ValueError):
    """The runs given to `run_batch()` cannot run as one batch (the message says which key differs)."""


def unbatchable_reason(cfg: RunConfig) -> str | None:
    """Why ``cfg`` cannot join a batch (``None``: it can, if its task has a run axis; see `task_reason()`)."""
    if cfg.secure_noise:
        return "secure-noise = true: its noise comes from the OS and cannot be shared with other runs"
    if cfg.secure_aggregation:
        return "secure-aggregation = true: each client encodes its update on the run's own grid"
    if cfg.resume:
        return "resume = true: it continues one run from its checkpoint"
    return None


def task_reason(task: Task) -> str | None:
    """Why ``task`` cannot run on a run axis (``None``: it can)."""
    hooks = task_hooks(task)
    if not callable(hooks.runs_update):
        return f"task {task.name!r} has no client_runs_update_fn (its local steps over runs x clients)"
    if not hooks.supports_run_axis:
        return f"task {task.name!r}: {hooks.run_axis_limitation}"
    return None


def batch_key(cfg: RunConfig, task: Task | None = None) -> tuple:
    """What must be equal for runs to share a batch: every key but `RUN_KEYS` and the task's ``run_axis_keys``."""
    free = RUN_KEYS | set(task_hooks(task).run_axis_keys) if task is not None else RUN_KEYS
    values = cfg.to_run_config()
    return tuple(sorted((k, repr(v)) for k, v in values.items() if k not in free))


class _Evaluations:
    """A run's task as its `RunSession` sees it: ``evaluate`` gives the batch's.

    Everything else is the run's own task. When the batch evaluated no metrics for this round (a task
    without ``evaluate_runs``, or round 0), the batch's shared task evaluates ``w``: the keys a batch's runs may
    differ in do not change the evaluation, and the runs' own tasks then never load the evaluation data.
    """

    def __init__(self, task: Task, shared: Task) -> None:
        self._task, self._shared = task, shared
        self.pending: dict[str, float] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def evaluate(self, w: Vector) -> dict[str, float]:
        metrics, self.pending = self.pending, None
        return metrics if metrics is not None else self._shared.evaluate(w)


@dataclass
class _Run:
    """One run of a batch: its config, server, results and model."""

    cfg: RunConfig
    server: Any  # DPServer
    session: Any  # RunSession
    view: _Evaluations
    w: Vector
    stopped_before_round: int | None = None
    directory: Path | None = None
    #: The run's last closed round (`DPServer.close_round()`), recorded by its session.
    closed: RoundRecord | None = None

    def close(self, server_round: int, replies: RoundReplies) -> None:
        """Close the run's open round (the one way: `DPServer.close_round()`) and move to ``w_{k+1}``."""
        self.closed = self.server.close_round(server_round, replies)
        self.w = self.closed.w

    @property
    def active(self) -> bool:
        return self.directory is None


def run_batch(
    cfgs: Sequence[RunConfig],
    *,
    progress: bool = False,
    on_run_done: Callable[[RunConfig, Path], None] | None = None,
) -> list[Path]:
    """Run ``cfgs`` as one batch (see the module docstring); returns each run's directory, in order.

    Parameters
    ----------
    cfgs:
        Runs with equal `batch_key()` and nothing in `unbatchable_reason()`.
    progress:
        Show a progress bar over the rounds.
    on_run_done:
        Called with ``(cfg, run directory)`` as each run finishes.

    Raises
    ------
    BatchError
        When a run cannot join the batch (the reason, naming the key).
    """
    if not cfgs:
        return []
    keep_freed_memory()  # the rounds' temporaries are reused instead of page-faulted in again (engines.allocator)
    # One BLAS thread: a batch's products then give the same bits in this process, in a sweep's worker
    # processes and in a Ray task (a multi-threaded product may round differently); sweeps run batches in parallel.
    with threadpool_limits(limits=1, user_api="blas"):
        return _run_batch(cfgs, progress=progress, on_run_done=on_run_done)


def _open_runs(cfgs: Sequence[RunConfig]) -> tuple[Task, list[_Run]]:
    """Check that ``cfgs`` can share a batch and assemble each run; the batch's shared task and its runs."""
    from dpfedavg.privacy.setup import PrivacySetup
    from dpfedavg.server.run import prepare_run

    tasks = [build_task(cfg) for cfg in cfgs]
    for cfg, task in zip(cfgs, tasks, strict=True):
        reason = unbatchable_reason(cfg) or task_reason(task)
        if reason is not None:
            raise BatchError(f"run {cfg.run_name or cfg.task!r} cannot join a batch: {reason}")
    key = batch_key(cfgs[0], tasks[0])
    for cfg, task in zip(cfgs[1:], tasks[1:], strict=True):
        other = batch_key(cfg, task)
        if other != key:
            diff = sorted({k for k, _ in set(key) ^ set(other)})
            raise BatchError(
                f"run {cfg.run_name!r} cannot join the batch of {cfgs[0].run_name!r}: {', '.join(diff)} differ"
            )
    shared = tasks[0]  # the clients' data and the server's evaluation of every run (keys outside the run axis)
    dims = {task.dim for task in tasks}
    if len(dims) != 1:
        raise BatchError(f"the runs' models differ in size ({sorted(dims)}): they cannot share a batch")
    order = sorted(range(len(cfgs)), key=lambda i: cfgs[i].algorithm)  # one algorithm's runs are contiguous
    setups = [PrivacySetup.resolve(cfg) for cfg in cfgs]  # every run's ConfigError before any run's folder is made
    runs: list[_Run] = []
    for i in order:
        cfg, task = cfgs[i], tasks[i]
        view = _Evaluations(task, shared)
        prepared = prepare_run(cfg, task=view, setup=setups[i], run_id="batched", engine="batched")
        if prepared.first_round != 1:
            raise BatchError(f"run {cfg.run_name!r} resumed from a checkpoint: it cannot join a batch")
        runs.append(_Run(prepared.cfg, prepared.server, prepared.session, view, prepared.w))
    return shared, runs


def _run_batch(
    cfgs: Sequence[RunConfig], *, progress: bool, on_run_done: Callable[[RunConfig, Path], None] | None
) -> list[Path]:
    from tqdm.auto import tqdm

    from dpfedavg.server.dp_server import PrivacyBudgetExhausted

    shared, runs = _open_runs(cfgs)
    num_rounds = cfgs[0].num_rounds
    local_steps = cfgs[0].local_steps
    evaluate_runs = task_hooks(shared).evaluate_runs
    logger.info("batch of %d runs (%s), %d rounds", len(runs), shared.name, num_rounds)
    bar = tqdm(range(1, num_rounds + 1), desc=f"batch of {len(runs)} runs", leave=False, disable=not progress)
    for run in runs:  # metrics.csv's rows in one write per run (a cell that stops early reruns whole)
        run.session.recorder.hold_rows()
    try:
        for server_round in bar:
            opened: list[tuple[_Run, np.ndarray, RoundInstructions]] = []
            for run in runs:
                if not run.active:
                    continue
                try:
                    start = run.server.begin_round(server_round, run.w)
                except PrivacyBudgetExhausted as stop:
                    logger.warning("%s: %s", run.cfg.run_name, stop)
                    run.stopped_before_round = stop.server_round
                    _finish(run, on_run_done)
                    continue
                assert start.instructions is not None  # no rule closes a batched run's round (no SecAgg+)
                opened.append((run, start.clients, start.instructions))
            for group in _groups(opened):
                _round(shared, server_round, local_steps, group)
            _evaluate(evaluate_runs, server_round, [run for run, _, _ in opened])
            for run, _, _ in opened:
                assert run.closed is not None and run.closed.round == server_round
                run.session.record_round(server_round, run.w, run.closed.stats)  # no checkpoint: reruns whole
        for run in runs:
            if run.active:
                _finish(run, on_run_done)
    finally:  # a batch that fails keeps the rows its runs finished (beside their rerun)
        for run in runs:
            run.session.recorder.flush_rows()
        bar.close()
    by_cfg = {id(run.cfg): run.directory for run in runs}
    return [by_cfg[id(cfg)] for cfg in cfgs]


def _finish(run: _Run, on_run_done: Callable[[RunConfig, Path], None] | None) -> None:
    run.session.recorder.flush_rows()
    run.session.write_final(run.w, run.stopped_before_round, checkpoint=False, plot=False)
    run.directory = run.session.directory
    if on_run_done is not None:
        on_run_done(run.cfg, run.directory)


def _groups(
    opened: list[tuple[_Run, np.ndarray, RoundInstructions]],
) -> list[list[tuple[_Run, np.ndarray, RoundInstructions]]]:
    """The round's runs by (seed, sampled clients): each group shares its clients and their noise streams."""
    groups: dict[tuple, list] = {}
    for item in opened:
        run, clients, ins = item
        groups.setdefault((run.cfg.seed, ins.noise_seed, clients.tobytes()), []).append(item)
    return list(groups.values())


def _round(task: Task, server_round: int, local_steps: int, group: list) -> None:
    """Lines 4-12 of one round for a group of runs that sampled the same clients; moves each run to ``w_{k+1}``."""
    clients = group[0][1]
    if not len(clients):  # nobody sampled: every run releases its server's noise alone
        for run, _, _ in group:
            run.close(server_round, RoundReplies())
        return
    instructions = [ins for _, _, ins in group]
    algorithms = [ins.algorithm for ins in instructions]
    stds = np.array([ins.noise_std for ins in instructions])
    release_dims = [run.server.release_dim for run, _, _ in group]
    sums = RunSums.zeros(release_dims, [run.cfg.diagnostics for run, _, _ in group])
    w = np.stack([run.w for run, _, _ in group])
    lrs = np.array([ins.local_lr for ins in instructions])
    clips = np.array([ins.clip for ins in instructions])
    scales = np.array([ins.count_scale for ins in instructions])
    noise_dim = max(d for d, s in zip(release_dims, stds, strict=True) if s > 0) if np.any(stds > 0) else 0
    block = max(1, min(len(clients), BLOCK_ELEMENTS // max(1, len(group) * max(release_dims))))
    for start in range(0, len(clients), block):
        ids = clients[start : start + block]
        u = task.client_runs_update_fn(ids, server_round=server_round)(w, lrs, local_steps)
        normals = shared_standard_normals(instructions[0].noise_seed, ids, noise_dim) if noise_dim else None
        released_sums(u, ids, algorithms=algorithms, clips=clips, noise_stds=stds, count_scales=scales,
                      normals=normals, into=sums)  # fmt: skip
    for r, (run, _, _) in enumerate(group):
        failed = sums.failed[r]
        for client_id in failed:
            logger.warning("%s: round %d: client %d: local training diverged (NaN/Inf)", run.cfg.run_name,
                           server_round, client_id)  # fmt: skip
        norms = sums.update_norms(r)
        run.close(server_round, RoundReplies(total=sums.noisy[r], num_summed=len(norms), norms=norms,
                                             clean_total=sums.clean[r], num_failed=len(failed),
                                             failed_reasons=diverged(failed) if failed else ()))  # fmt: skip


def _evaluate(evaluate_runs: Callable | None, server_round: int, runs: list[_Run]) -> None:
    """The server's evaluation of every run due after this round, in one call when the task can."""
    if evaluate_runs is None:
        return
    due = [run for run in runs if run.session.evaluates_after(server_round)]
    if not due:
        return
    for run, metrics in zip(due, evaluate_runs(np.stack([run.w for run in due])), strict=True):
        run.view.pending = metrics
