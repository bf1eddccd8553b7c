"""Flower ClientApp: read the message, call the core, reply. No math here."""

from __future__ import annotations

import dataclasses
import logging
from functools import lru_cache

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat

from dpfedavg.config import RunConfig
from dpfedavg.core import SECURE_NOISE_SEED, GradFn, client_round_update
from dpfedavg.core.types import RoundInstructions
from dpfedavg.flower.protocol import (
    ARRAYS,
    CLEAN_UPDATE_KEY,
    CLIENT_IDS,
    CONFIG,
    DIAGNOSTICS,
    DIVERGED_CLIENT_IDS,
    METRICS,
    NUM_EXAMPLES,
    NUM_PARTITIONS,
    PARTITION_ID,
    UPDATE_KEY,
    UPDATE_NORM,
    UPDATE_NORMS,
    block_key,
    from_array_record,
    instructions_from_config_record,
    to_array_record,
)
from dpfedavg.flower.runtime import setup_app_process
from dpfedavg.tasks import Task, build_task, task_hooks

app = ClientApp()

logger = logging.getLogger(__name__)

#: ``--node-config`` key with which a SuperNode's owner makes its client draw noise from the OS CSPRNG
#: whatever the server sends (the client, not the server, decides that its noise cannot be replayed).
NODE_SECURE_NOISE = "secure-noise"
_TRUE = {"true", "1", "yes"}


def secure_noise_required(context: Context, cfg: RunConfig) -> bool:
    """Whether this client must draw its noise from the OS CSPRNG.

    True when the SuperNode's own ``--node-config`` says ``secure-noise=true`` (the client's decision,
    which no run config can override) or the run config does. A server cannot turn it off.
    """
    value = context.node_config.get(NODE_SECURE_NOISE, False)
    node = value if isinstance(value, bool) else str(value).strip().lower() in _TRUE
    return bool(node or cfg.secure_noise)


def enforce_secure_noise(ins: RoundInstructions, secure: bool) -> RoundInstructions:
    """The instructions this client follows: a server-sent noise seed is ignored when ``secure``."""
    if not secure or ins.noise_seed == SECURE_NOISE_SEED:
        return ins
    logger.warning(
        "round %d: the server sent a noise seed, but this client requires secure noise: ignoring the seed and "
        "drawing the noise from the OS CSPRNG",
        ins.server_round,
    )
    return dataclasses.replace(ins, noise_seed=SECURE_NOISE_SEED)


def _partition(context: Context) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` from the SuperNode's ``--node-config``."""
    try:
        return int(context.node_config[PARTITION_ID]), int(context.node_config[NUM_PARTITIONS])
    except KeyError as err:
        raise RuntimeError(
            f"this SuperNode has no {err} in its node config; start it with "
            '--node-config "partition-id=I num-partitions=N"'
        ) from None


@lru_cache(maxsize=4)
def _config(items: tuple[tuple[str, object], ...]) -> RunConfig:
    return RunConfig.from_run_config(dict(items))


@lru_cache(maxsize=4)
def _task(cfg: RunConfig) -> Task:
    return build_task(cfg)


@lru_cache(maxsize=4096)
def _grad_fn(cfg: RunConfig, client_id: int) -> GradFn:
    """Client ``i``'s objective, built once per process and reused every round."""
    return _task(cfg).client_grad_fn(client_id)


def _round_grad_fn(cfg: RunConfig, client_id: int, server_round: int) -> GradFn:
    """Client ``i``'s gradient oracle for this round: the task's ``client_round_grad_fn`` when it has one
    (local steps that depend on the round: the torch tasks' mini-batches), else the cached :func:`_grad_fn`."""
    hooks = task_hooks(_task(cfg))
    if hooks.round_grad is not None:
        return hooks.round_grad(client_id, server_round)
    return _grad_fn(cfg, client_id)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Report this node's client id so the server can sample by client."""
    pid, num = _partition(context)
    return Message(RecordDict({METRICS: MetricRecord({PARTITION_ID: pid, NUM_PARTITIONS: num})}), reply_to=msg)


def secure_aggregation_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's ``secaggplus_mod`` for the rounds the server runs through SecAgg+, a pass-through otherwise.

    ``secaggplus_mod`` handles the protocol's four stages (keys, shares, the
    masked vector, unmasking); in its masked-vector stage it calls
    :func:`train`, quantizes the reply (exactly: it is already on the grid, see
    :mod:`dpfedavg.core.secagg`), masks it and removes the unmasked arrays
    from the reply before it leaves this node.
    """
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


def _secure_train(msg: Message, context: Context, cfg: RunConfig, client_id: int) -> Message:
    """The masked-vector stage of SecAgg+: the round's instructions arrive as legacy ``FitIns``.

    The reply is a legacy ``FitRes`` holding only the encoded ``g~ + zeta~``
    (weight ``num_examples = 1``: the server needs the plain sum); the mod
    masks it. No norms or other per-client metrics are sent.
    """
    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    (w,) = parameters_to_ndarrays(fitins.parameters)
    ins = enforce_secure_noise(
        instructions_from_config_record(fitins.config),  # type: ignore[arg-type]
        secure_noise_required(context, cfg),
    )
    if ins.secagg_step <= 0:
        raise ValueError("a secure-aggregation round without a quantization grid (secagg-step)")
    result = client_round_update(w, _round_grad_fn(cfg, client_id, ins.server_round), ins, client_id)
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([result.noisy]), num_examples=1, metrics={})
    return Message(compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)


@app.train(mods=[secure_aggregation_mod])
def train(msg: Message, context: Context) -> Message:
    """Alg. 1 / Alg. 2 lines 4-10 for this client: reply with ``g + zeta``."""
    setup_app_process()
    cfg = _config(tuple(sorted(context.run_config.items())))
    client_id, _ = _partition(context)
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return _secure_train(msg, context, cfg, client_id)
    secure = secure_noise_required(context, cfg)
    ins = enforce_secure_noise(instructions_from_config_record(msg.content[CONFIG]), secure)
    w = from_array_record(msg.content[ARRAYS])
    if cfg.clients_per_node > 1:
        return _train_block(msg, context, cfg, ins, w, secure)
    result = client_round_update(w, _round_grad_fn(cfg, client_id, ins.server_round), ins, client_id)
    metrics: dict[str, int | float] = {NUM_EXAMPLES: 1, PARTITION_ID: client_id}
    if not secure:  # un-noised statistics of this client's data: seeded research mode only
        metrics[UPDATE_NORM] = result.update_norm
    content = RecordDict({ARRAYS: to_array_record(result.noisy, UPDATE_KEY), METRICS: MetricRecord(metrics)})
    if ins.diagnostics:
        content[DIAGNOSTICS] = to_array_record(result.clean, CLEAN_UPDATE_KEY)
    return Message(content, reply_to=msg)


def hosted_clients(cfg: RunConfig, partition_id: int) -> range:
    """The client ids the SuperNode with ``partition-id`` p hosts: ``p m .. min(p m + m, n) - 1``."""
    m = cfg.clients_per_node
    return range(partition_id * m, min(partition_id * m + m, cfg.num_clients))


def _train_block(
    msg: Message, context: Context, cfg: RunConfig, ins: RoundInstructions, w: np.ndarray, secure: bool
) -> Message:
    """Virtual clients: Alg. 1 / Alg. 2 lines 4-10 for the sampled clients this node hosts, one update each.

    The block goes through the batched engine's pipeline (:func:`dpfedavg.engines.batched.client_results`:
    the task's closed form or vectorized gradients, :func:`dpfedavg.core.private_block_update`, each
    client's noise from its own stream ``noise_rng(noise_seed, client_id)``), so every client's
    ``g + zeta`` is the one it sends from a SuperNode of its own. A client whose local training
    diverges is listed in ``diverged-client-ids`` and sends nothing.
    """
    from dpfedavg.engines.batched import client_results

    partition_id, num_partitions = _partition(context)
    if num_partitions != cfg.num_nodes:
        raise RuntimeError(
            f"num-partitions={num_partitions} but num-clients={cfg.num_clients} with clients-per-node="
            f"{cfg.clients_per_node} needs {cfg.num_nodes} SuperNodes"
        )
    ids = [int(c) for c in msg.content[CONFIG][CLIENT_IDS]]  # type: ignore[union-attr]
    hosted = hosted_clients(cfg, partition_id)
    if ids != sorted(set(ids)) or not all(c in hosted for c in ids):
        raise ValueError(
            f"node {partition_id} hosts clients {hosted.start}..{hosted.stop - 1}; asked for {ids[:10]} "
            "(expected ascending ids of hosted clients)"
        )
    diverged: list[int] = []
    results = list(client_results(_task(cfg), np.asarray(ids, dtype=np.int64), w, ins, failed=diverged))
    arrays = ArrayRecord({block_key(UPDATE_KEY, r.client_id): Array(np.ascontiguousarray(r.noisy)) for r in results})
    metrics: dict[str, int | float | list[int] | list[float]] = {NUM_EXAMPLES: len(results)}
    if results:
        metrics[CLIENT_IDS] = [r.client_id for r in results]
        if not secure:  # un-noised statistics of the clients' data: seeded research mode only
            metrics[UPDATE_NORMS] = [float(r.update_norm) for r in results]
    if diverged:
        metrics[DIVERGED_CLIENT_IDS] = diverged
    content = RecordDict({ARRAYS: arrays, METRICS: MetricRecord(metrics)})
    if ins.diagnostics:
        content[DIAGNOSTICS] = ArrayRecord(
            {block_key(CLEAN_UPDATE_KEY, r.client_id): Array(np.ascontiguousarray(r.clean)) for r in results}
        )
    return Message(content, reply_to=msg)
