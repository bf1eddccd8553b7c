"""Flower ClientApp: read the message, call the core, reply. No math here.

Every message the node answers passes through one app-level mod, ``node_guard``, and every decision is the
node's one guard's (`dpfedavg.privacy.node_guard.guard()`, the rules ``dp_mod`` applies too): train messages
(``train``, ``train.default``) go to ``train``, whose instructions are checked once, against the node's
policy and the run config (in a SecAgg+ round, in the protocol's masked-vector stage and nowhere else), and
charged to the node's ledger; the partition query is answered with the node's ``partition-id`` and
``num-partitions`` only (its public node config, no data); every other message (``evaluate*``,
``query.<action>``, any other type) is refused. SecAgg+ content is answered only as a ``train`` message
inside Flower's protocol, whose masked-vector stage masks the vector.
"""

from __future__ import annotations

import logging
from functools import lru_cache

import numpy as np
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat

from dpfedavg.config import RunConfig
from dpfedavg.core import GradFn, LocalTrainingDiverged, client_round_update
from dpfedavg.core.check_in import node_update
from dpfedavg.core.local import ClientUpdate, zero_updates
from dpfedavg.core.types import ClientResult, RoundInstructions
from dpfedavg.flower.guard import answer_stage, refusal, secagg_stage_of, secagg_stage_within
from dpfedavg.flower.protocol import (
    ARRAYS,
    CLEAN_UPDATE_KEY,
    CLIENT_IDS,
    CONFIG,
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
    train_reply,
)
from dpfedavg.flower.runtime import setup_app_process
from dpfedavg.privacy.node_guard import BYPASSED, CLIENT_APP, Route, TrainRequest, Verdict, guard
from dpfedavg.privacy.node_guard import node_policy as _node_policy
from dpfedavg.privacy.policy import NodePolicy
from dpfedavg.privacy.secagg_stages import SecAggStage
from dpfedavg.tasks import Task, build_task, task_hooks

logger = logging.getLogger(__name__)


def node_policy(context: Context) -> NodePolicy:
    """This SuperNode's policy, from its ``--node-config`` (`dpfedavg.privacy.policy`); ``PolicyError`` if bad."""
    return _node_policy(context.node_config)


def node_guard(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """The one enforcement point of this ClientApp (an app-level mod: every message the node answers passes here).

    Train messages of any action Flower routes here go on (their instructions are checked by the guard in
    ``train`` or ``secure_aggregation_mod``; SecAgg+ content only through the protocol); the partition query
    goes on (its reply holds the node's partition id and count, not data); any other message is refused: its
    reply could be a function of the node's data that nothing here makes private (`dpfedavg.flower.guard`).
    """
    verdict = guard(CLIENT_APP, msg.metadata.message_type, context.node_config)
    return refusal(msg, verdict.reason, CLIENT_APP) if verdict.route is Route.REFUSE else call_next(msg, context)


app = ClientApp(mods=[node_guard])


def checked_round(
    msg: Message, context: Context, cfg: RunConfig, config: object, *, secagg: SecAggStage | None = None
) -> tuple[RoundInstructions | None, Message | None]:
    """The round's instructions as this client follows them (the guard's, checked and charged), or the refusal.

    Every round is checked here exactly once (`dpfedavg.privacy.node_guard.guard()`: the node's policy, the run config,
    the ledger: write-ahead, refused past ``max-epsilon``).
    """
    request = TrainRequest(config, context.run_id, cfg)  # type: ignore[arg-type]
    stage = None if secagg is None else secagg.stage
    verdict = guard(CLIENT_APP, msg.metadata.message_type, context.node_config, secagg_stage=stage, train=request,
                    secagg=secagg)  # fmt: skip
    if verdict.route is Route.REFUSE:
        return None, refusal(msg, verdict.reason, CLIENT_APP)
    return verdict.instructions, None


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
    (local steps that depend on the round: the torch tasks' mini-batches), else the cached `_grad_fn()`."""
    hooks = task_hooks(_task(cfg))
    if hooks.round_grad is not None:
        return hooks.round_grad(client_id, server_round)
    return _grad_fn(cfg, client_id)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Report this node's client id so the server can sample by client.

    The reply is the node's ``partition-id`` and ``num-partitions`` (its public node config), whatever the
    message holds: no function of the node's data, so it is answered under any policy.
    """
    pid, num = _partition(context)
    return Message(RecordDict({METRICS: MetricRecord({PARTITION_ID: pid, NUM_PARTITIONS: num})}), reply_to=msg)


def secure_aggregation_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's ``secaggplus_mod`` for the rounds the server runs through SecAgg+, a pass-through otherwise.

    ``secaggplus_mod`` handles the protocol's four stages (keys, shares, the masked vector, unmasking); in its
    masked-vector stage it calls ``_secure_train``, quantizes the reply (exactly: it is already on the grid,
    see ``dpfedavg.core.secagg``), masks it and removes the unmasked arrays from the reply before it leaves
    this node. Before that stage reaches the mod, the round's instructions are checked against the node's
    policy and the run config: a refused round is an error reply (the protocol then treats this node as
    dropped out), not a masked vector. SecAgg+ content in a ``train.<action>`` message (which ``secaggplus_mod``
    would pass through unmasked) is refused, and the plain train handler never answers SecAgg+ content.
    Every stage's own parameters (the cohort, the shares, the threshold, who is dropped, the stages' order) are
    checked by the guard before ``secaggplus_mod`` sees the stage (`dpfedavg.flower.guard`), and in the
    masked-vector stage the setup's cohort against the round's ``|S_k|``.
    """
    checked = secagg_stage_of(msg, context)
    if checked is None:
        return call_next(msg, context)
    return answer_stage(CLIENT_APP, msg, context, checked, lambda v: _secure_stage(msg, context, v, checked))


def _secure_stage(msg: Message, context: Context, verdict: Verdict, checked: SecAggStage) -> Message:
    """A SecAgg+ stage the guard let on: ``secaggplus_mod``'s reply, or in the masked-vector stage the vector."""
    if verdict.route is Route.PROTOCOL:
        return secaggplus_mod(msg, context, _no_training_outside_the_masked_vector_stage)
    setup_app_process()
    cfg = _run_config(context)
    client_id, _ = _partition(context)
    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    ins, refused = checked_round(msg, context, cfg, fitins.config, secagg=checked)
    if refused is not None:
        return refused

    def masked_vector(inner: Message, ctxt: Context) -> Message:
        return _secure_train(inner, cfg, client_id, ins, under_policy=node_policy(context).active)

    return secaggplus_mod(msg, context, masked_vector)


def _no_training_outside_the_masked_vector_stage(msg: Message, context: Context) -> Message:
    raise RuntimeError("secaggplus_mod trains only in its masked-vector stage")


def _run_config(context: Context) -> RunConfig:
    return _config(tuple(sorted(context.run_config.items())))


def _secure_train(
    msg: Message, cfg: RunConfig, client_id: int, ins: RoundInstructions, *, under_policy: bool
) -> Message:
    """The masked-vector stage of SecAgg+ (called by ``secaggplus_mod`` only): ``g~ + zeta~`` as a legacy ``FitRes``.

    ``ins`` are the round's instructions as ``secure_aggregation_mod`` checked them. The reply is a legacy
    ``FitRes`` holding only the encoded ``g~ + zeta~`` (weight ``num_examples = 1``: the server needs the plain
    sum); the mod masks it. No norms or other per-client metrics are sent.
    """
    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    (w,) = parameters_to_ndarrays(fitins.parameters)
    result = _round_update(w, cfg, client_id, ins, under_policy=under_policy)
    return train_reply(msg, {UPDATE_KEY: result.noisy})


@app.train(mods=[secure_aggregation_mod])
def train(msg: Message, context: Context) -> Message:
    """Alg. 1 / Alg. 2 lines 4-10 for this client: reply with ``g + zeta``, or refuse the round.

    The round's instructions are checked against this node's policy and the run config before anything
    is trained (``dpfedavg.privacy.policy``); a refusal is an error reply naming the rule. SecAgg+
    content is answered only inside the protocol (``secure_aggregation_mod``), never here.
    """
    setup_app_process()
    cfg = _run_config(context)
    client_id, _ = _partition(context)
    secure_content = RECORD_KEY_CONFIGS in msg.content.config_records
    bypassed = secagg_stage_within(msg, context, BYPASSED) if secure_content else None
    ins, refused = checked_round(msg, context, cfg, msg.content.config_records.get(CONFIG), secagg=bypassed)
    if refused is not None:
        return refused
    try:
        w = from_array_record(msg.content.array_records[ARRAYS])
    except KeyError as err:
        return refusal(msg, f"refused: the TRAIN message has no model ({err})", CLIENT_APP)
    secure = node_policy(context).demands_noise or cfg.secure_noise
    if cfg.clients_per_node > 1:
        return _train_block(msg, context, cfg, ins, w, secure)
    result = _round_update(w, cfg, client_id, ins, under_policy=node_policy(context).active)
    metrics: dict[str, int | float] = {NUM_EXAMPLES: 1, PARTITION_ID: client_id}
    if not secure:  # un-noised statistics of this client's data: seeded research mode only
        metrics[UPDATE_NORM] = result.update_norm
    clean = {CLEAN_UPDATE_KEY: result.clean} if ins.diagnostics else None
    return train_reply(msg, {UPDATE_KEY: result.noisy}, metrics, clean)


def _round_update(
    w: np.ndarray, cfg: RunConfig, client_id: int, ins: RoundInstructions, *, under_policy: bool
) -> ClientUpdate:
    """Alg. 1 / Alg. 2 lines 4-10 for this client; under a node policy a diverged local training sends ``0 + zeta``
    (`dpfedavg.core.local.zero_updates()`); without one ``LocalTrainingDiverged`` is raised (the error reply of
    research runs)."""
    try:
        update = client_round_update(w, _round_grad_fn(cfg, client_id, ins.server_round), ins, client_id)
    except LocalTrainingDiverged:
        if not under_policy:
            raise
        logger.warning("round %d: local training diverged; under this node's policy a zero update is sent, noised",
                       ins.server_round)  # fmt: skip
        (update,) = zero_updates([client_id], len(w), ins, dtype=w.dtype)
    return node_update(update, sampling=cfg.sampling, q=cfg.sampling_rate, client_id=client_id, dim=len(w), ins=ins,
                       dtype=w.dtype)  # fmt: skip


def hosted_clients(cfg: RunConfig, partition_id: int) -> range:
    """The client ids the SuperNode with ``partition-id`` p hosts: ``p m .. min(p m + m, n) - 1``."""
    m = cfg.clients_per_node
    return range(partition_id * m, min(partition_id * m + m, cfg.num_clients))


def _train_block(
    msg: Message, context: Context, cfg: RunConfig, ins: RoundInstructions, w: np.ndarray, secure: bool
) -> Message:
    """Virtual clients: Alg. 1 / Alg. 2 lines 4-10 for the sampled clients this node hosts, one update each.

    The block goes through the batched engine's pipeline, each client's noise from its own stream
    ``noise_rng(noise_seed, client_id)`` (OS-seeded under secure noise), so every client's ``g + zeta`` is the
    one it sends from a SuperNode of its own. A torch task stays on its device
    (`dpfedavg.engines.batched.device_client_results()`: local steps, bound and noise there, one crossing to
    the host per block with the clients' noisy rows, norms and finite flags); any other task goes through
    `dpfedavg.engines.batched.client_results()` (the task's closed form or vectorized gradients, then
    `dpfedavg.core.private_block_update()`). A client whose local training diverges is listed in
    ``diverged-client-ids`` and sends nothing (under a node policy: ``0 + zeta``, see `_round_update()`).
    """
    from dpfedavg.engines.batched import client_results, device_client_results, runs_on_device

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
    task = _task(cfg)
    block_results = device_client_results if runs_on_device(task, ins) else client_results
    results = list(block_results(task, np.asarray(ids, dtype=np.int64), w, ins, failed=diverged))
    if diverged and node_policy(context).active:  # not reported under a policy: see _round_update
        logger.warning("round %d: local training of clients %s diverged; zero updates are sent, noised",
                       ins.server_round, diverged)  # fmt: skip
        zeros = zero_updates(diverged, len(w), ins)
        results = sorted(
            [*results, *(ClientResult(c, u.noisy, u.update_norm, u.clean if ins.diagnostics else None)
                         for c, u in zip(diverged, zeros, strict=True))],
            key=lambda r: r.client_id,
        )  # fmt: skip
        diverged = []
    metrics: dict[str, int | float | list[int] | list[float]] = {NUM_EXAMPLES: len(results)}
    if results:
        metrics[CLIENT_IDS] = [r.client_id for r in results]
        if not secure:  # un-noised statistics of the clients' data: seeded research mode only
            metrics[UPDATE_NORMS] = [float(r.update_norm) for r in results]
    if diverged:
        metrics[DIVERGED_CLIENT_IDS] = diverged
    clean = {block_key(CLEAN_UPDATE_KEY, r.client_id): r.clean for r in results} if ins.diagnostics else None
    return train_reply(msg, {block_key(UPDATE_KEY, r.client_id): r.noisy for r in results}, metrics, clean)
