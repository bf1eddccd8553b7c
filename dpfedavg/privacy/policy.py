"""The SuperNode operator's privacy policy, checked by the client before it trains.

The person who runs a SuperNode agrees to take part under some conditions and states them in the
node's ``--node-config`` (`POLICY_KEYS`); the ClientApp checks every round's instructions against
them, and against the run config (or, for ``dp_mod``, the train config's public terms), *before* it trains
(`check_round()`, the one rule set; `dpfedavg.flower.guard` applies it to every message). A round that breaks a rule
is refused with one line naming the rule (`RoundRefused`; the ClientApp sends it as an error reply,
which the server counts as a rejection). Where the client can compute its own noise share from public
parameters, it does, and the server's ``noise-std`` is only compared with it:

    ``s = placement.client_std(z, C, r, |S_k|)``  (``client-calibrated``: ``z C / sqrt(|S_k|)``; Alg. 1 line 10)

with ``z`` and ``|S_k|`` from the instructions, the placement and ``r`` from the run config, ``C`` the round's
bound (``C_aug = sqrt(C_k^2 + s_b^2 / 4)`` with adaptive clipping, ``s_b`` recomputed here too).

A policy that states a floor (``min-noise-multiplier``, ``min-update-noise-multiplier``, ``max-clip``,
``max-epsilon``) or ``secure-noise`` means "this node never sends an un-noised update": it refuses
``algorithm = none``, ``z = 0``, a ``z`` that is not a finite number and the ``server`` placement (whose
clients send their clean clipped update), the last unless ``allow-server-noise = true`` says the operator
trusts the server with central DP (``NodePolicy.demands_noise``, ``check_noise_demand``). Such a node also
draws its noise from the OS CSPRNG as ``secure-noise`` does (noise from the server's seed is noise the server
can regenerate and subtract) and, unless ``allow-diagnostics = true``, never sends the clean update.

What a client cannot check: which rounds it is sampled in (the server could sample it more often than
``q``), ``|S_k|`` itself (bounded only by ``min-update-noise-multiplier``), the model ``w_k`` it is sent, and
anything the SuperLink's operator does to the run config itself (the policy is the node's; the run config is
the server's). The privacy pages' trust table says what each party learns with and without a policy.

Pure Python over `RunConfig` and `RoundInstructions`; no
Flower import (the ClientApp, `dpfedavg.flower.client_app`, turns a refusal into an error reply).
"""

from __future__ import annotations

import dataclasses
import decimal
import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from dpfedavg.config import RunConfig
from dpfedavg.core import SECURE_NOISE_SEED, local_lr_at
from dpfedavg.core.adaptive_clip import augmented_bound, auto_count_stddev, count_scale
from dpfedavg.core.check_in import CHECK_IN, CHECK_IN_RATE, CheckInRateMismatch, resolve_rate
from dpfedavg.core.dp import ALGORITHMS, get_bound, is_private_algorithm
from dpfedavg.core.mechanism import PLACEMENTS, NoisePlacement, get_placement
from dpfedavg.core.types import RoundInstructions
from dpfedavg.errors import ConfigError
from dpfedavg.privacy.accountants import AccountingRangeError
from dpfedavg.privacy.calibration import epsilon_for
from dpfedavg.privacy.secure_aggregation import MIN_SECAGG_COHORT, SecAggSettings
from dpfedavg.privacy.setup import FederationSize

__all__ = [
    "NODE_SECURE_NOISE",
    "NodePolicy",
    "POLICY_KEYS",
    "PolicyError",
    "RoundRefused",
    "PublicTerms",
    "check_declared_task",
    "check_noise_demand",
    "check_round",
    "client_noise_std",
    "noise_bound",
]

#: ``--node-config`` key with which a SuperNode's owner makes its client draw noise from the OS CSPRNG whatever the
#: server sends (and, by default, never send diagnostics).
NODE_SECURE_NOISE = "secure-noise"
#: The node-config keys the Flower SuperNode itself needs (not policy keys).
NODE_IDENTITY_KEYS = ("partition-id", "num-partitions")
#: Relative tolerance when the server's floats are compared with the client's own (the same formulas, so equal).
_RTOL = 1e-9


class PolicyError(ValueError):
    """The node's policy (its ``--node-config``) is invalid: names the key, the value and what is allowed."""


class RoundRefused(Exception):
    """This round breaks a rule: ``rule`` is the policy key or the run-config key it breaks."""

    def __init__(self, rule: str, detail: str, *, policy: bool, where: str | None = None) -> None:
        where = where or ("this node's policy" if policy else "the run config")
        super().__init__(f"refused by {where} ({rule}): {detail}")
        self.rule = rule


@dataclass(frozen=True)
class NodePolicy:
    """What the operator of a SuperNode agreed to (the keys of `POLICY_KEYS`, snake_case).

    Attributes
    ----------
    secure_noise:
        Draw the noise from the OS CSPRNG, whatever seed the server sends (``secure-noise``).
    min_noise_multiplier:
        The smallest ``z`` of a round (the noise of the released sum over ``C``) the node takes part in.
    min_update_noise_multiplier:
        The smallest noise this client's own update carries over its bound (``s / C``): what a curious server
        without secure aggregation sees of it. ``z / sqrt(|S_k|)`` with the default placement, so it also caps
        the cohort size a server may claim.
    max_clip:
        The largest ``C`` (``C_k`` with adaptive clipping); a round without a bound (``algorithm = none``) breaks it.
    allowed_algorithms:
        The ``algorithm`` values the node accepts (``None``: any).
    require_secure_aggregation:
        Answer SecAgg+ rounds only.
    allow_diagnostics:
        Whether the clean ``g`` may ever leave the node (default: not under a policy that demands noise).
    max_epsilon:
        The budget of the privacy ledger's account against the server itself (what it sees of this node's
        updates, `dpfedavg.privacy.node_accounts`); with ``allow-server-noise`` (the server trusted with the clean
        update) and without ``max-epsilon-released``, the budget of the released account instead.
    allow_evaluate:
        Answer evaluate messages (``allow-evaluate``): their replies are the user's metrics of the node's data,
        un-noised (with ``dp_mod``; dpfedavg's own ClientApp answers none).
    allow_server_noise:
        Accept the ``server`` placement (``allow-server-noise``): central DP, the clean clipped update goes to a
        server trusted to add the noise. Off, a policy that demands noise refuses it.
    max_epsilon_delta:
        The delta both of the ledger's accounts are read at (``None``: 1e-6; never a delta a run declares).
    privacy_ledger:
        The ledger file (``None``: ``dpfedavg.privacy.ledger.ledger_path``'s default in the node's home).
    max_epsilon_released:
        The budget of the ledger's account against those who see the released model (``None``: ``max-epsilon``),
        and the largest epsilon of a run the node takes part in (at the run's delta, over its ``num-rounds``, by
        the run's own mechanism; the client computes it from the run config itself).
    allow_virtual_clients:
        Answer runs with ``clients-per-node`` > 1 (several updates of this node's data per round, each charged).
    secagg_min_cohort:
        The fewest nodes of a SecAgg+ round the node takes part in (``secagg-min-cohort``, default and least 3:
        in a cohort of 2 each node reads the other's vector from the sum, and a threshold above half of a node's
        shares, which keeps a server from rebuilding both its mask seed and its key, needs 3). Checked, with the
        protocol's other parameters, before any secret leaves the node (`dpfedavg.flower.guard`).
    check_in_rate:
        This node's probability of taking part in a round of a ``sampling = "check-in"`` run (``check-in-rate``;
        ``None``: the run's ``q``); a run whose ``q`` differs is refused (`dpfedavg.core.check_in.resolve_rate`).
    stated:
        The policy keys the node config names (an empty tuple: no policy).
    """

    secure_noise: bool = False
    min_noise_multiplier: float = 0.0
    min_update_noise_multiplier: float = 0.0
    max_clip: float = math.inf
    allowed_algorithms: tuple[str, ...] | None = None
    require_secure_aggregation: bool = False
    allow_diagnostics: bool | None = None
    max_epsilon: float = math.inf
    allow_evaluate: bool = False
    allow_server_noise: bool = False
    max_epsilon_delta: float | None = None
    privacy_ledger: str | None = None
    max_epsilon_released: float | None = None
    allow_virtual_clients: bool = False
    secagg_min_cohort: int = MIN_SECAGG_COHORT
    check_in_rate: float | None = None
    stated: tuple[str, ...] = ()

    @property
    def server_budget(self) -> float:
        """The bound of the ledger's account (b), against the server itself: ``max-epsilon`` (none when
        ``allow-server-noise = true``: the operator trusts the server with the clean update)."""
        return math.inf if self.allow_server_noise else self.max_epsilon

    @property
    def released_budget(self) -> float:
        """The bound of the ledger's account (a), against those who see the released model (and of each run's own
        epsilon): ``max-epsilon-released``, else ``max-epsilon``."""
        return self.max_epsilon if self.max_epsilon_released is None else self.max_epsilon_released

    @property
    def released_key(self) -> str:
        """The key that states `released_budget`."""
        return "max-epsilon" if self.max_epsilon_released is None else "max-epsilon-released"

    @property
    def diagnostics_allowed(self) -> bool:
        """Whether the clean update may leave the node: ``allow-diagnostics``, by default not under a policy that
        demands noise (``demands_noise``: the clean update beside the noised one is an un-noised update)."""
        return (not self.demands_noise) if self.allow_diagnostics is None else self.allow_diagnostics

    @property
    def active(self) -> bool:
        """Whether the node config states any policy key (then evaluate and query messages are refused by
        ``dp_mod`` unless ``allow-evaluate``)."""
        return bool(self.stated)

    @property
    def floors(self) -> tuple[str, ...]:
        """The keys of this policy that promise noise: a stated floor, or ``secure-noise = true``."""
        keys = [key for key in _FLOOR_KEYS if key in self.stated]
        return tuple(keys + ([NODE_SECURE_NOISE] if self.secure_noise else []))

    @property
    def demands_noise(self) -> bool:
        """Whether every update this node sends must carry its own noise (see the module docstring)."""
        return bool(self.floors)

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> NodePolicy:
        """Parse the policy keys of a node config; `PolicyError` naming every bad key, value and the allowed.

        Unknown keys (other than ``partition-id`` / ``num-partitions``) are errors, with a "did you mean":
        a misspelt rule must not be silently ignored.
        """
        errors: list[str] = []
        values: dict[str, Any] = {}
        stated: list[str] = []
        for key, value in node_config.items():
            if key in NODE_IDENTITY_KEYS:
                continue
            spec = POLICY_KEYS.get(key)
            if spec is None:
                hint = difflib.get_close_matches(key, list(POLICY_KEYS), n=1)
                errors.append(f"unknown key '{key}'" + (f" (did you mean '{hint[0]}'?)" if hint else ""))
                continue
            parse, allowed = spec
            parsed = parse(value)
            if parsed is None:
                errors.append(f"'{key}' = {value!r}: expected {allowed}")
            else:
                values[key.replace("-", "_")] = parsed
                stated.append(key)
        if errors:
            raise PolicyError(
                "this node's policy (--node-config) is invalid: "
                + "; ".join(errors)
                + f". Policy keys: {', '.join(POLICY_KEYS)}"
            )
        return cls(**values, stated=tuple(sorted(stated)))


def _flag(value: Any) -> bool | None:
    """``true`` / ``false``: a bool, or exactly the string ``'true'`` or ``'false'`` (nothing else: not 1, 'yes')."""
    if isinstance(value, bool):
        return value
    return {"true": True, "false": False}.get(value) if isinstance(value, str) else None


def _number(value: Any, check: Any) -> float | None:
    """A finite number (an int, a float or its string) that passes ``check``; ``None`` for anything else.

    A string that is not zero but rounds to 0.0 as a float (``'1e-400'``) is refused: it would turn a rule off.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)
        exact = decimal.Decimal(value.strip()) if isinstance(value, str) else None
    except (ValueError, OverflowError, decimal.InvalidOperation):
        return None
    if not math.isfinite(number) or (exact is not None and number == 0 and exact != 0):
        return None
    return number if check(number) else None


def _algorithms(value: Any) -> tuple[str, ...] | None:
    names = tuple(name.strip() for name in str(value).split(",") if name.strip()) if isinstance(value, str) else ()
    return names if names and all(name in ALGORITHMS for name in names) else None


def _cohort(value: Any) -> int | None:
    """An integer >= `MIN_SECAGG_COHORT` (an int, or a string of decimal digits); ``None`` for anything else."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if value >= MIN_SECAGG_COHORT else None


def _ledger_file(value: Any) -> str | None:
    if not isinstance(value, str) or not value.strip() or any(ord(c) < 32 for c in value):
        return None
    return value if Path(value).expanduser().is_absolute() else None


#: Policy key -> (parser returning ``None`` for a bad value, what is allowed).
_FLAG = "true or false"
_AT_LEAST_0 = "a number >= 0 (finite, and not one that rounds to 0)"
_ABOVE_0 = "a number > 0 (finite, and not one that rounds to 0)"
POLICY_KEYS: dict[str, tuple[Any, str]] = {
    NODE_SECURE_NOISE: (_flag, _FLAG),
    "min-noise-multiplier": (lambda v: _number(v, lambda x: x >= 0), _AT_LEAST_0),
    "min-update-noise-multiplier": (lambda v: _number(v, lambda x: x >= 0), _AT_LEAST_0),
    "max-clip": (lambda v: _number(v, lambda x: x > 0), _ABOVE_0),
    "allowed-algorithms": (_algorithms, f"a comma-separated list of {', '.join(map(repr, ALGORITHMS))}"),
    "require-secure-aggregation": (_flag, _FLAG),
    "allow-diagnostics": (_flag, _FLAG),
    "max-epsilon": (lambda v: _number(v, lambda x: x > 0), _ABOVE_0),
    "allow-evaluate": (_flag, _FLAG),
    "allow-server-noise": (_flag, _FLAG),
    "max-epsilon-delta": (lambda v: _number(v, lambda x: 0 < x < 1), "a number in (0, 1)"),
    "privacy-ledger": (_ledger_file, "an absolute file path (or ~/...), one line"),
    "max-epsilon-released": (lambda v: _number(v, lambda x: x > 0), _ABOVE_0),
    "allow-virtual-clients": (_flag, _FLAG),
    "secagg-min-cohort": (_cohort, f"an integer >= {MIN_SECAGG_COHORT} (a SecAgg+ cohort of 2 shows each node the "
                                   "other's vector; a majority threshold of a node's shares needs 3)"),
    CHECK_IN_RATE: (lambda v: _number(v, lambda x: 0 < x <= 1), "a number in (0, 1] (this node's check-in "
                                                                  "probability)"),
}
#: The policy keys that state a floor on the noise (or a ceiling on what it hides): each promises noise.
_FLOOR_KEYS = ("min-noise-multiplier", "min-update-noise-multiplier", "max-clip", "max-epsilon", "max-epsilon-released")


@lru_cache(maxsize=64)
def _run_epsilon(z: float, q: float, rounds: int, delta: float, accountant: str) -> float:
    """Epsilon of ``rounds`` rounds of ``(q, z)``, computed by the client itself (cached per process)."""
    if z <= 0:
        return math.inf
    try:
        return epsilon_for(z, q, rounds, delta, accountant)
    except AccountingRangeError:
        return math.inf


@lru_cache(maxsize=16)
def _plan_epsilon(cfg: RunConfig, z: float) -> float:
    """Epsilon at the run's delta of the run's own mechanism as the node charges it (`released_plan`, PLD)."""
    from dpfedavg.privacy.accountants import _run_pld
    from dpfedavg.privacy.node_accounts import released_plan

    if not z > 0:
        return math.inf
    try:
        charge = released_plan(cfg, z, cfg.clients_per_node)
    except ValueError as err:
        raise RoundRefused("noise-mechanism", str(err), policy=True) from None
    if not charge.event.z:
        return math.inf
    try:
        return float(_run_pld(charge.event, charge.count).get_epsilon_for_delta(cfg.delta))
    except AccountingRangeError:
        return math.inf


@lru_cache(maxsize=8)
def with_canaries(cfg: RunConfig) -> RunConfig:
    """The federation the server samples from: ``n`` plus the inserted canaries (``canary-clients``), same ``q``.

    The canaries inserted follow from the run's ``seed`` (``dpfedavg.core.canaries.inserted_canaries``), so a
    node checks ``|S_k|`` and its noise share against ``n' = n + inserted`` and ``r' = q n'``, not ``n`` and ``r``.
    """
    if not cfg.canary_clients:
        return cfg
    n, r = FederationSize.of(cfg).sampled
    return cfg.replace(num_clients=n, clients_per_round=r)


def client_noise_std(cfg: RunConfig, ins: RoundInstructions) -> tuple[float, float]:
    """``(bound, s)``: the round's norm bound of this client's vector and its own noise std, from public parameters.

    ``bound`` is ``C`` (``C_aug`` with adaptive clipping, the count scale recomputed from ``z``, ``C_k`` and
    ``sigma_b``); ``s = placement.client_std(z, bound, r, |S_k|)``.
    """
    bound = ins.clip
    if get_bound(cfg.algorithm).adaptive and ins.noise_multiplier > 0:
        bound = augmented_bound(ins.clip, count_scale(ins.noise_multiplier, ins.clip, _count_stddev(cfg, ins)))
    elif get_bound(cfg.algorithm).adaptive:
        bound = augmented_bound(ins.clip, ins.clip)  # z = 0: s = C (core.adaptive_clip.count_scale)
    placement = get_placement(cfg.noise_placement)
    return bound, placement.client_std(ins.noise_multiplier, bound, cfg.clients_per_round, ins.cohort_size)


def noise_bound(ins: RoundInstructions, cfg: RunConfig | None = None) -> float:
    """The norm bound of this client's vector in the round: ``C`` (``C_aug`` with adaptive clipping), from the run
    config (`client_noise_std()`) or, without one (``dp_mod``), the server's count scale."""
    if cfg is not None:
        return client_noise_std(with_canaries(cfg), ins)[0]
    return augmented_bound(ins.clip, ins.count_scale) if ins.count_scale > 0 else ins.clip


def _count_stddev(cfg: RunConfig, ins: RoundInstructions) -> float:
    """``sigma_b`` of the run: ``clip-count-stddev``, or ``"auto"`` recomputed from the round's ``z`` and ``r``."""
    if cfg.clip_count_stddev is not None:
        return cfg.clip_count_stddev
    return auto_count_stddev(ins.noise_multiplier, cfg.clients_per_round)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=_RTOL, abs_tol=0.0)


def check_noise_demand(policy: NodePolicy, ins: RoundInstructions, placement: str) -> None:
    """Under a policy that demands noise (``NodePolicy.demands_noise``), the update must carry its own.

    Refuses (``RoundRefused`` naming the policy's key) an algorithm without a bound (``none``: the raw
    update), a noise multiplier that is not a finite number > 0 (``z = 0``, NaN, inf), and the ``server``
    placement unless ``allow-server-noise = true`` (there each client sends its clean clipped ``g``).
    """
    if not policy.demands_noise:
        return
    rule = policy.floors[0]
    private = is_private_algorithm(ins.algorithm)
    if not private:
        raise RoundRefused(
            rule, f"algorithm {ins.algorithm!r} sends the update without a bound or noise; this node's policy "
            f"({', '.join(policy.floors)}) never sends an un-noised update", policy=True,
        )  # fmt: skip
    z = ins.noise_multiplier
    if not (math.isfinite(z) and z > 0):
        raise RoundRefused(
            rule, f"the round's noise multiplier z = {z!r} is not a finite number > 0; this node's policy "
            f"({', '.join(policy.floors)}) never sends an un-noised update", policy=True,
        )  # fmt: skip
    if not _server_placement(placement).adds_client_noise and not policy.allow_server_noise:
        raise RoundRefused(
            "allow-server-noise",
            f"the {placement!r} placement has this client send its clean update for the server to noise; this "
            f"node's policy ({', '.join(policy.floors)}) sends only noised updates (allow-server-noise = true "
            "trusts the server with central DP)",
            policy=True,
        )


def _check_policy(
    policy: NodePolicy, cfg: RunConfig | None, ins: RoundInstructions, secure_round: bool, placement: str
) -> None:
    """The operator's rules (checked first: a refusal names the node's own promise); ``cfg`` ``None``: no run config."""

    def refuse(rule: str, detail: str) -> RoundRefused:
        return RoundRefused(rule, detail, policy=True)

    if cfg is not None and policy.active:
        check_declared_task(cfg.task)
    if cfg is not None and cfg.sampling == CHECK_IN:
        try:
            resolve_rate(policy.check_in_rate, cfg.sampling_rate)
        except CheckInRateMismatch as err:
            raise refuse(CHECK_IN_RATE, str(err)) from None
    if policy.require_secure_aggregation and not secure_round:
        raise refuse(
            "require-secure-aggregation", "this node answers SecAgg+ rounds only; this is a plain TRAIN message"
        )
    if policy.allowed_algorithms is not None and ins.algorithm not in policy.allowed_algorithms:
        raise refuse(
            "allowed-algorithms", f"algorithm {ins.algorithm!r} is not one of {', '.join(policy.allowed_algorithms)}"
        )
    if ins.diagnostics and not policy.diagnostics_allowed:
        why = f" ({', '.join(policy.floors)}: the default is false)" if policy.allow_diagnostics is None else ""
        raise refuse(
            "allow-diagnostics", f"the server asks for the clean update (diagnostics), which this node never sends{why}"
        )
    check_noise_demand(policy, ins, placement)
    private = is_private_algorithm(ins.algorithm)
    clip = ins.clip if private else math.inf
    if not clip <= policy.max_clip:  # also NaN
        raise refuse("max-clip", f"the round's C = {clip:g} exceeds this node's max-clip = {policy.max_clip:g}")
    if not ins.noise_multiplier >= policy.min_noise_multiplier:  # also NaN
        raise refuse(
            "min-noise-multiplier",
            f"the round's noise multiplier z = {ins.noise_multiplier:g} is below {policy.min_noise_multiplier:g}",
        )
    if cfg is not None and cfg.clients_per_node > 1 and policy.active and not policy.allow_virtual_clients:
        raise refuse(
            "allow-virtual-clients",
            f"the run config's clients-per-node = {cfg.clients_per_node} has this node answer for several clients, "
            "each update of its data separately noised; this node answers as one client unless allow-virtual-clients "
            "= true (then each client's update is charged to its ledger)",
        )
    if cfg is not None and math.isfinite(policy.released_budget):
        if cfg.noise_mechanism == "independent" and cfg.clients_per_node == 1:
            eps = _run_epsilon(ins.noise_multiplier, cfg.sampling_rate, cfg.num_rounds, cfg.delta, cfg.accountant)
        else:
            eps = _plan_epsilon(cfg, ins.noise_multiplier)
        if eps > policy.released_budget:
            raise refuse(
                policy.released_key,
                f"the run's epsilon at delta = {cfg.delta:g} over {cfg.num_rounds} rounds of z = "
                f"{ins.noise_multiplier:g}, q = {cfg.sampling_rate:.4g} ({cfg.noise_mechanism} noise, "
                f"clients-per-node = {cfg.clients_per_node}) is {eps:.4g} > {policy.released_budget:g}",
            )


def check_declared_task(task: str) -> None:
    """On a policy node the run config's ``task`` must be one the approved app declares: its registered tasks
    (``dpfedavg.tasks.TASKS``, code the app hash pins, `dpfedavg.deploy.approval`). A ``module:factory`` (or a
    file) names code outside the approved app and would be imported by the node: refused before any import.
    """
    from dpfedavg.tasks import registered_tasks  # the registry's names only: no task module is imported

    declared = registered_tasks()
    if task not in declared:
        raise RoundRefused(
            "task",
            f"the run config's task = {task!r} is not a task the approved app declares; this node runs only "
            f"{', '.join(repr(name) for name in declared)} (a module:factory task would import code the approval "
            "does not cover)",
            policy=True,
        )


def _check_run_config(cfg: RunConfig, ins: RoundInstructions, secure_round: bool) -> None:
    """The instructions must be what the run config implies (a server that lies is caught here)."""

    def refuse(rule: str, detail: str) -> RoundRefused:
        return RoundRefused(rule, detail, policy=False)

    if cfg.secure_aggregation and not secure_round:
        raise refuse(
            "secure-aggregation",
            "the run config says secure-aggregation = true: this client answers SecAgg+ rounds only, never a plain "
            "TRAIN message, whose update the server would see in the clear",
        )
    if secure_round and not cfg.secure_aggregation:
        raise refuse("secure-aggregation", "a SecAgg+ round in a run whose config says secure-aggregation = false")
    if not 1 <= ins.server_round <= cfg.num_rounds:
        raise refuse("num-rounds", f"round {ins.server_round} is outside 1..num-rounds = {cfg.num_rounds}")
    if ins.algorithm != cfg.algorithm:
        raise refuse(
            "algorithm", f"the server asks for algorithm {ins.algorithm!r}, the run config says {cfg.algorithm!r}"
        )
    if ins.diagnostics != cfg.diagnostics:
        raise refuse(
            "diagnostics", f"the server asks for diagnostics = {ins.diagnostics}, the run config says {cfg.diagnostics}"
        )
    if ins.local_steps != cfg.local_steps:
        raise refuse(
            "local-steps", f"the server asks for {ins.local_steps} local steps, the run config says {cfg.local_steps}"
        )
    eta = local_lr_at(ins.server_round - 1, cfg.local_lr, cfg.lr_decay)
    if not _close(ins.local_lr, eta):
        raise refuse("local-lr", f"the server asks for eta_k = {ins.local_lr:g}, the run config gives {eta:g}")
    bound = get_bound(cfg.algorithm)
    if bound.adaptive:
        low, high = cfg.clip_limits
        if not low * (1 - _RTOL) <= ins.clip <= high * (1 + _RTOL):
            raise refuse("clip", f"C_k = {ins.clip:g} is outside [{low:g}, {high:g}] (clip / clip-range-factor)")
    elif bound.private and not _close(ins.clip, cfg.clip):
        raise refuse("clip", f"the server asks for C = {ins.clip:g}, the run config says {cfg.clip:g}")
    _check_noise_multiplier(cfg, ins, refuse)
    if bound.adaptive:
        expected = count_scale(ins.noise_multiplier, ins.clip, _count_stddev(cfg, ins))
        if not _close(ins.count_scale, expected):
            raise refuse("clip-count-stddev", f"count scale {ins.count_scale:g}; z, C_k and sigma_b give {expected:g}")
    elif ins.count_scale != 0:
        raise refuse("algorithm", f"a count scale {ins.count_scale:g} in a run without adaptive clipping")
    if get_placement(cfg.noise_placement).clients_learn_cohort_size and not 1 <= ins.cohort_size <= cfg.num_clients:
        raise refuse(
            "num-clients", f"cohort size |S_k| = {ins.cohort_size} is outside 1..num-clients = {cfg.num_clients}"
        )


def _check_noise_multiplier(cfg: RunConfig, ins: RoundInstructions, refuse: Any) -> None:
    """``z`` of the instructions against the run config: the given one, or (calibrated) one that meets the target."""
    z = ins.noise_multiplier
    if not (math.isfinite(z) and z >= 0):
        raise refuse("noise-multiplier", f"z = {z!r} is not a number >= 0")
    if not get_bound(cfg.algorithm).private:
        if z != 0:
            raise refuse("noise-multiplier", f"z = {z:g} in a run without DP")
        return
    if cfg.epsilon > 0:  # calibrated by the server: the client checks that z meets the target itself
        eps = _run_epsilon(z, cfg.sampling_rate, cfg.num_rounds, cfg.delta, cfg.accountant)
        if not eps <= cfg.epsilon * (1 + _RTOL):
            raise refuse(
                "epsilon",
                f"z = {z:g} gives epsilon {eps:.4g} > the run's target {cfg.epsilon:g} over {cfg.num_rounds} rounds "
                f"(q = {cfg.sampling_rate:.4g}, delta = {cfg.delta:g}, computed by this client)",
            )
    elif not _close(z, cfg.noise_multiplier or 0.0):
        raise refuse(
            "noise-multiplier", f"the server sends z = {z:g}, the run config says {cfg.noise_multiplier or 0.0:g}"
        )


@dataclass(frozen=True)
class PublicTerms:
    """What a client without a run config (``dp_mod`` in a user's own app) knows of the run: the train config's
    noise ``placement`` and expected cohort ``r`` (``clients_per_round``), with ``z``, ``C`` and ``|S_k|`` of the
    round's instructions."""

    placement: str
    clients_per_round: float


def _public_noise_share(ins: RoundInstructions, terms: PublicTerms) -> tuple[float, float, bool]:
    """``(bound, s, private)`` from the round's public parameters alone, each checked (`RoundRefused` otherwise)."""

    def refuse(rule: str, detail: str) -> RoundRefused:
        return RoundRefused(rule, detail, policy=False)

    placement, clients_per_round = terms.placement, terms.clients_per_round
    rule = _server_placement(placement)
    if not (math.isfinite(clients_per_round) and clients_per_round > 0):
        raise refuse("clients-per-round", f"r = {clients_per_round!r} is not a finite number > 0")
    z = ins.noise_multiplier
    if not (math.isfinite(z) and z >= 0):
        raise refuse("noise-multiplier", f"z = {z!r} is not a finite number >= 0")
    private = is_private_algorithm(ins.algorithm)
    if not private and z != 0:
        raise refuse("noise-multiplier", f"z = {z:g} with algorithm {ins.algorithm!r}, which has no bound to scale it")
    bound = noise_bound(ins)
    if private and not (math.isfinite(bound) and bound > 0):
        raise refuse("clip", f"C = {bound!r} is not a finite number > 0")
    if private and z > 0 and rule.clients_learn_cohort_size and ins.cohort_size < 1:
        raise refuse("cohort-size", f"|S_k| = {ins.cohort_size} with the {placement!r} placement (needs >= 1)")
    return bound, (rule.client_std(z, bound, clients_per_round, ins.cohort_size) if private else 0.0), private


def check_round(
    policy: NodePolicy,
    ins: RoundInstructions,
    *,
    secure_round: bool,
    cfg: RunConfig | None = None,
    public: PublicTerms | None = None,
) -> RoundInstructions:
    """The instructions this client follows in the round, or `RoundRefused` naming the rule it breaks.

    One rule set for every client of a node: the node's policy first (`_check_policy`), then what the client
    knows of the run, and its own noise share (Alg. 1 line 10: ``s = placement.client_std(z, C, r, |S_k|)``;
    the server's ``noise-std`` is only compared with it), the update-noise floor of the policy and, in a
    SecAgg+ round with a run config, the grid. What the client knows of the run is either

    * the run config ``cfg`` (the project's ClientApp): the SecAgg+ rule (a run configured with secure
      aggregation never answers a plain TRAIN message), the algorithm, diagnostics, ``E``, ``eta_k``, ``C`` (or
      ``C_k`` within its floor and ceiling), ``z`` (the run's, or one whose epsilon, computed here, meets the
      target), the count scale, ``|S_k|`` (`client_noise_std()`: ``C_aug`` with the count scale recomputed); or
    * the train config's ``public`` terms (``dp_mod`` in a user's own app: `PublicTerms`): a known placement,
      ``r > 0``, ``z >= 0`` (0 without a bound), ``C > 0`` (``C_aug = sqrt(C_k^2 + s_b^2/4)`` with the server's
      count scale), ``|S_k| >= 1`` where the placement needs it. ``max-epsilon`` is then held by the node's
      ledger alone, which charges each release as an unamplified Gaussian (``dpfedavg.privacy.ledger``).

    The result carries the client's own ``noise_std`` and, with ``secure-noise`` (the run's, or a node policy
    that demands noise), no seed.
    """
    if cfg is not None:
        cfg = with_canaries(cfg)
        placement, r = cfg.noise_placement, cfg.clients_per_round
    elif public is not None:
        placement, r = public.placement, public.clients_per_round
    else:
        raise TypeError("check_round needs the run config (cfg) or the train config's public terms (public)")
    _check_policy(policy, cfg, ins, secure_round, placement)
    if cfg is not None:
        _check_run_config(cfg, ins, secure_round)
        (bound, own), private = client_noise_std(cfg, ins), get_bound(cfg.algorithm).private
    else:
        bound, own, private = _public_noise_share(ins, public)  # type: ignore[arg-type]
    if not _close(ins.noise_std, own):
        asked = f"{ins.noise_std:g}" if cfg is not None else repr(ins.noise_std)
        raise RoundRefused(
            "noise-std",
            f"the server asks for noise std {asked}; z = {ins.noise_multiplier:g}, C = {bound:g}, r = {r:g} and "
            f"|S_k| = {ins.cohort_size} give this client's share {own:g} ({placement} placement)",
            policy=False,
        )
    if private and not own >= policy.min_update_noise_multiplier * bound:
        raise RoundRefused(
            "min-update-noise-multiplier",
            f"this client's own noise would be {own / bound:.4g} C (z = {ins.noise_multiplier:g}, |S_k| = "
            f"{ins.cohort_size}), below {policy.min_update_noise_multiplier:g} C",
            policy=True,
        )
    if cfg is not None and secure_round:
        grid = SecAggSettings.from_config(cfg).grid(bound, own)
        if not (_close(ins.secagg_step, grid.step) and _close(ins.secagg_range, grid.clipping_range)):
            raise RoundRefused(
                "secagg-clip-stds",
                f"the server's grid (step {ins.secagg_step:g}, range {ins.secagg_range:g}) is not the one the run "
                f"config gives (step {grid.step:g}, range {grid.clipping_range:g})",
                policy=False,
            )
    elif cfg is not None and (ins.secagg_step != 0 or ins.secagg_range != 0):
        raise RoundRefused("secure-aggregation", "a secure-aggregation grid in a plain round", policy=False)
    secure = policy.demands_noise or (cfg is not None and cfg.secure_noise)
    seed = SECURE_NOISE_SEED if secure else ins.noise_seed
    return dataclasses.replace(ins, noise_std=own, noise_seed=seed)


def _server_placement(name: str) -> NoisePlacement:
    """The noise placement a server's message names, or `RoundRefused` naming the allowed ones."""
    try:
        return get_placement(name)
    except ConfigError:
        raise RoundRefused(
            "noise-placement", f"{name!r} is not one of {', '.join(map(repr, PLACEMENTS))}", policy=False
        ) from None
