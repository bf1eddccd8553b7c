"""The batched engine: Alg. 1 / Alg. 2 vectorized over the sampled clients, in one process.

The same core functions as the Flower ClientApp (``client_update``,
``bound_sensitivity``, the noise law's ``add`` with the per-client generator
``noise_rng(noise_seed, client_id)``) applied to a ``(B, dim)`` block of
clients at a time, and the same server (`DPServer`):
one seed gives the Flower engine's trajectory, noise on or off, without
Flower's per-message cost. Blocks of clients bound the memory. A task may
offer an exact closed form of ``client_update`` for a block of clients
(``client_batch_update_fn``; logistic regression computes its local steps in
the span of each client's data), tested equal to the step-by-step loop.

A torch task runs a round on its device instead (`device_round_sums()`): the local steps leave ``u``
there and `dpfedavg.core.pipeline.round_block_sum()` bounds, noises and sums it with the same core
functions, so the host sees ``w_k`` go out and the round's sum (plus one norm and one finite flag per
client) come back once per round.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
from threadpoolctl import threadpool_limits

from dpfedavg.config import RunConfig
from dpfedavg.core import client_update, round_block_update
from dpfedavg.core.pipeline import HostSums, block_rows, round_block_sum
from dpfedavg.core.types import ClientResult, RoundInstructions, Vector
from dpfedavg.server.round import RoundRecord, RoundReplies
from dpfedavg.tasks import Task, task_hooks

if TYPE_CHECKING:  # the server side is imported by run_batched: a ClientApp that computes blocks needs none of it
    from dpfedavg.engines.audit import AuditedSession
    from dpfedavg.privacy.canary import CanarySet
    from dpfedavg.privacy.setup import PrivacySetup
    from dpfedavg.io.results import RunResult
    from dpfedavg.server.dp_server import DPServer
    from dpfedavg.server.session import RunSession

__all__ = ["run_batched", "recording", "client_results", "device_client_results", "device_round_sums", "runs_on_device"]

logger = logging.getLogger(__name__)

#: Upper bound on the elements of one ``(B, dim)`` block (32 MiB in float64).
BLOCK_ELEMENTS = 4_000_000
#: GPU blocks: device bytes a client's block takes per coordinate of ``u`` (its float64 ``u``, ``g``, noise,
#: ``g + zeta`` and the float32 iterates and gradients of the local steps).
DEVICE_BYTES_PER_COORDINATE = 64


def _block_results(
    task: Task, ids: np.ndarray, w: Vector, ins: RoundInstructions
) -> tuple[list[ClientResult], list[int]]:
    """One block of clients: their results in ascending id, and the ids whose local training diverged."""
    hooks = task_hooks(task)
    closed_form = hooks.block_update(ids, ins.server_round)
    if closed_form is not None:  # the task's client_update for a block (closed form or vmapped; tested against it)
        u = closed_form(w, ins.local_lr, ins.local_steps)
    else:
        w_block = np.repeat(w[None, :], len(ids), axis=0)
        u = client_update(w_block, hooks.block_grad(task, ids, ins.server_round), ins.local_lr, ins.local_steps)
    # the ClientApp's pipeline, on the block (with secure aggregation: what each client hands to the protocol)
    updates = round_block_update(u, ins, ids)
    results, failed = [], []
    for client_id, update in zip(ids, updates, strict=True):
        if update is None:
            logger.warning("Round %d: client %d: local training diverged (NaN/Inf)", ins.server_round, client_id)
            failed.append(int(client_id))
            continue
        clean = update.clean if ins.diagnostics else None
        results.append(ClientResult(int(client_id), update.noisy, update.update_norm, clean))
    return results, failed


def client_results(
    task: Task,
    clients: np.ndarray,
    w: Vector,
    ins: RoundInstructions,
    block: int | None = None,
    failed: list[int] | None = None,
    threads: int = 1,
) -> Iterator[ClientResult]:
    """Alg. 1 / Alg. 2 lines 4-10 for the sampled ``clients``, in ascending client id, block by block.

    A client whose local training diverges (NaN/Inf in ``u``) sends nothing, as
    the ClientApp does (`LocalTrainingDiverged`); its id
    is appended to ``failed``. With ``threads > 1`` blocks run concurrently
    (numpy releases the GIL in the products and in the noise draws), each with
    ``CPUs // threads`` BLAS threads (threadpoolctl); every
    client still uses its own noise generator and the results come in the same
    order, so the round is bit-identical to ``threads = 1``.
    """
    block = block or max(1, min(512, BLOCK_ELEMENTS // max(len(w), 1)))
    if threads > 1:
        block = max(1, min(block, -(-len(clients) // threads)))
    blocks = [clients[start : start + block] for start in range(0, len(clients), block)]
    if threads > 1 and len(blocks) > 1:
        # threads x BLAS threads = the CPUs: 2 blocks x 1 BLAS thread on 2 cores took 0.21 s against 0.27 s with
        # BLAS's own 2 threads each (fmnist closed form, 600 clients; docs/development/benchmarks.md)
        blas = max(1, (os.cpu_count() or 1) // threads)
        with threadpool_limits(limits=blas, user_api="blas"), ThreadPoolExecutor(max_workers=threads) as pool:
            outcomes = pool.map(lambda ids: _block_results(task, ids, w, ins), blocks)
            for results, bad in outcomes:
                if failed is not None:
                    failed.extend(bad)
                yield from results
        return
    for ids in blocks:
        results, bad = _block_results(task, ids, w, ins)
        if failed is not None:
            failed.extend(bad)
        yield from results


def device_block_size(task: Task, dim: int) -> int:
    """Clients per block of the device pipeline.

    CPU: `BLOCK_ELEMENTS` of ``u`` (the blocks of `client_results()`). GPU: as many clients as half of the
    free device memory holds at `DEVICE_BYTES_PER_COORDINATE` bytes per coordinate of a client's ``u``, so
    that a cohort is one or a few vmapped calls.
    """
    device = getattr(task, "device", None)
    if device is None or getattr(device, "type", "cpu") == "cpu":
        return max(1, min(512, BLOCK_ELEMENTS // max(dim, 1)))
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return max(1, int(0.5 * free) // (DEVICE_BYTES_PER_COORDINATE * max(dim, 1)))


def runs_on_device(task: Task, ins: RoundInstructions) -> bool:
    """Whether a round of ``task`` goes through the device pipeline (`device_round_sums()`, `device_client_results()`).

    It does for a task with ``device_block_update`` (the torch tasks) in a round whose noise is Gaussian: secure
    aggregation encodes each client's vector on the host.
    """
    return getattr(task, "device_block_update", None) is not None and ins.secagg_step <= 0


def _device_blocks(
    task: Task, clients: np.ndarray, w: Vector, ins: RoundInstructions, block: int = 0
) -> Iterator[tuple[np.ndarray, Any]]:
    """``(ids, u)`` block by block (``block`` clients, default `device_block_size()`), ``u`` left on the device.

    ``w_k`` goes to the device once; ``u`` is the task's local steps (``task.device_block_update``, Alg. 1 / Alg. 2
    lines 4-9).
    """
    import torch

    block = block or device_block_size(task, int(np.asarray(w).shape[-1]))
    w_device = torch.as_tensor(np.asarray(w, dtype=np.float64), device=task.device)
    for start in range(0, len(clients), block):
        ids = clients[start : start + block]
        yield ids, task.device_block_update(ids, ins.server_round)(w_device, ins.local_lr, ins.local_steps)


def device_round_sums(
    task: Task,
    clients: np.ndarray,
    w: Vector,
    ins: RoundInstructions,
    *,
    keep_clean: bool = False,
    block: int = 0,
) -> HostSums:
    """Alg. 1 / Alg. 2 lines 4-12 of the sampled ``clients`` on the task's device; the round's sums on the host.

    Block by block (``block`` clients, default `device_block_size()`): the task's local steps leave ``u`` on
    the device (``task.device_block_update``), `round_block_sum()` bounds, noises and adds it to the round's
    sum there. ``w_k`` goes to the device once; the sum, the clients' norms and finite flags come back once
    (`BlockSums.to_host()`).
    """
    dim = int(np.asarray(w).shape[-1])
    block = block or device_block_size(task, dim)
    sums = None
    for ids, u in _device_blocks(task, clients, w, ins, block):
        sums = round_block_sum(u, ins, ids, sums, keep_clean=keep_clean)
    if sums is None:  # nobody sampled: an empty sum of the release's length
        release = dim + (1 if ins.count_scale > 0 else 0)
        return HostSums(np.zeros(release), np.zeros(release) if keep_clean else None, np.zeros(0), np.zeros(0, bool))
    return sums.to_host()


def device_client_results(
    task: Task, clients: np.ndarray, w: Vector, ins: RoundInstructions, *, failed: list[int] | None = None,
    block: int | None = None,
) -> Iterator[ClientResult]:
    """`client_results()` on the task's device: each sampled client's own ``g + zeta``, in ascending client id.

    A SuperNode hosting several virtual clients replies for each of them (the server sums): block by block
    (``block`` clients, default `device_block_size()`), the local steps leave ``u`` on the device,
    `dpfedavg.core.pipeline.block_rows()` bounds and noises it there (the code of `round_block_sum()`, each
    client's noise from its own stream), and the block's rows, norms and finite flags cross to the host at once
    (`BlockRows.to_host()`). The results equal `client_results()`'s (the same noise; the bound to the rounding
    of a norm). A client whose ``u`` is not finite sends nothing; its id is appended to ``failed``.
    """
    for ids, u in _device_blocks(task, clients, w, ins, block or 0):
        results, bad = block_rows(u, ins, ids, keep_clean=ins.diagnostics).to_host().client_results(ids)
        for client_id in bad:
            logger.warning("Round %d: client %d: local training diverged (NaN/Inf)", ins.server_round, client_id)
        if failed is not None:
            failed.extend(bad)
        yield from results


def run_batched(
    cfg: RunConfig,
    *,
    task: Task | Callable[[RunConfig], Task] | None = None,
    setup: PrivacySetup | None = None,
    run_id: int | str = "batched",
    progress: bool = False,
    on_round=None,
    client_results_fn=client_results,
    engine: str = "batched",
    threads: int | None = None,
) -> RunResult:
    """Run ``cfg`` with the batched engine; writes the usual results and returns the run's result.

    Parameters
    ----------
    task:
        A Task, or a factory called with ``cfg``; ``None`` builds the task ``cfg.task`` names.
    setup:
        The run's privacy set-up, when the caller resolved it already (`PrivacySetup.resolve()`).
    progress:
        Show a progress bar over rounds.
    on_round:
        Optional ``callback(server_round, w_k)`` after every round (e.g. to keep
        the trajectory for Figure 3).
    client_results_fn, engine:
        How the sampled clients' results are computed (default: vectorized
        `client_results()`) and the engine name recorded in ``config.json``;
        the scale benchmark passes a one-client-at-a-time loop here.
    threads:
        Threads computing blocks of clients concurrently (default: the CPUs, or 1 for a task whose local
        steps are parallel themselves, ``parallel_steps``: the torch tasks; sweeps that run several cells in
        parallel pass 1). The result does not depend on it.
    """
    from tqdm.auto import tqdm

    from dpfedavg.engines.canaries import WithCanaries
    from dpfedavg.server.loop import ClientRunner, run_rounds
    from dpfedavg.server.run import prepare_run

    run = prepare_run(cfg, task=task, setup=setup, run_id=run_id, engine=engine, inserts_canaries=True)
    if threads is None:  # a torch task's steps use torch's own threads: blocks in parallel only contend (benchmarks)
        threads = 1 if task_hooks(run.task).parallel_steps else (os.cpu_count() or 1)
    session, w, first_round = run.session, run.w, run.first_round
    if on_round is not None and first_round == 1:
        on_round(0, w)

    recorder = recording(session, run.canaries, w)

    def record(closed: RoundRecord) -> None:
        recorder.end_round(closed)
        if on_round is not None:
            on_round(closed.round, closed.w)

    rounds = tqdm(range(first_round, cfg.num_rounds + 1), desc=cfg.run_name or "rounds", disable=not progress)
    runner: ClientRunner = InProcessRunner(run.task, client_results_fn, threads)
    if run.canaries is not None:  # the inserted canaries: clients n .. of the server's federation
        runner = WithCanaries(runner, run.canaries.inserted_directions, run.task.num_clients)
    ahead = _prefetch_epsilons(run.server, run.task, cfg.num_rounds - first_round + 1)
    try:
        result = run_rounds(run.server, runner, w, rounds, on_round_end=record)
    finally:
        if ahead is not None:
            ahead.stop()
    return recorder.finish(result.w, stopped_before_round=result.stopped_before_round)


def _prefetch_epsilons(server: DPServer, task: Task, rounds: int) -> Any:
    """On a GPU, the epsilon of each coming round (a PLD composition on a cold privacy cache, 20-110 ms) is
    computed by a host thread while the device trains (`PldAccountant.prefetch()`); the same values."""
    device = getattr(task, "device", None)
    if server.accountant is None or device is None or getattr(device, "type", "cpu") == "cpu":
        return None
    from dpfedavg.privacy.accountants import RoundEvent

    return server.accountant.prefetch(RoundEvent(server.params.q, server.plan.noise_multiplier), rounds)


def recording(session: RunSession, canaries: CanarySet | None, w0: Vector) -> RunSession | AuditedSession:
    """How a run records its closed rounds and finishes: its session, or the canary audit around it
    (`dpfedavg.engines.audit.AuditedSession`; scipy.stats is imported only by runs with canaries)."""
    if canaries is None:
        return session
    from dpfedavg.engines.audit import AuditedSession

    return AuditedSession(session, canaries, w0)


class InProcessRunner:
    """The batched engine's `ClientRunner`: the sampled clients in this process.

    A task with ``device_block_update`` (the torch tasks) runs the round on its device
    (`device_round_sums()`) unless secure
    aggregation encodes each client's vector or the caller asked for its own ``client_results_fn``; every other
    task goes client by client through `client_results()`.
    """

    def __init__(self, task: Task, client_results_fn=client_results, threads: int = 1) -> None:
        self.task, self.client_results_fn, self.threads = task, client_results_fn, threads

    def _on_device(self, ins: RoundInstructions) -> bool:
        """Whether this round runs through the device pipeline (`device_round_sums()`)."""
        return runs_on_device(self.task, ins) and self.client_results_fn is client_results

    def run_round(self, server_round: int, clients: np.ndarray, w: Vector, ins: RoundInstructions) -> RoundReplies:
        if self._on_device(ins):
            sums = device_round_sums(self.task, clients, w, ins, keep_clean=ins.diagnostics)
            ok = sums.finite
            failed = [int(c) for c in clients[~ok]]
            for client_id in failed:
                logger.warning("Round %d: client %d: local training diverged (NaN/Inf)", server_round, client_id)
            norms = sums.norms[ok]
            return RoundReplies(total=sums.noisy, num_summed=len(norms), norms=norms, clean_total=sums.clean,
                                num_failed=len(failed), failed_reasons=diverged(failed))  # fmt: skip
        failed: list[int] = []
        results = list(self.client_results_fn(self.task, clients, w, ins, failed=failed, threads=self.threads))
        return RoundReplies(tuple(results), num_failed=len(failed), failed_reasons=diverged(failed))


def diverged(clients: Iterable[int]) -> tuple[str, ...]:
    """The failure reasons of clients whose local training diverged (what fail-fast reports)."""
    return tuple(f"client {c}: local training diverged (NaN/Inf)" for c in clients)
