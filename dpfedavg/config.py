"""Run configuration: one frozen dataclass, validated at the boundary.

Flower hands the app a flat ``run_config`` dict with kebab-case keys (the
defaults live in ``pyproject.toml`` under ``[tool.flwr.app.config]``;
``--run-config`` overrides them). :func:`RunConfig.from_run_config` turns it
into a typed :class:`RunConfig` or raises one :class:`ConfigError` that names
every bad key, its value and what is allowed, before any expensive start-up.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from dpfedavg.core.adaptive_clip import DEFAULT_CLIP_LR, DEFAULT_TARGET_QUANTILE, default_count_stddev
from dpfedavg.core.dp import ALGORITHMS, get_bound
from dpfedavg.core.mechanism import PLACEMENTS
from dpfedavg.options import ConfigError, Option
from dpfedavg.options import non_negative as _non_negative
from dpfedavg.options import positive as _positive

__all__ = [
    "ACCOUNTANTS",
    "CLIP_COUNT_STDDEV_AUTO",
    "NOISE_MULTIPLIER_AUTO",
    "NOISE_PLACEMENTS",
    "OPTIONS",
    "SERVER_LR_FOLLOWS_LOCAL",
    "ConfigError",
    "Option",
    "RunConfig",
]

#: ``server-lr`` value meaning ``beta_k = eta_k`` (the paper's choice in §4.4 and §5).
SERVER_LR_FOLLOWS_LOCAL = "eta"

#: Default K. The paper's §4.4 uses K = 500; 200 keeps the README's first
#: command (install + run, 100 simulated clients) under 5 minutes on 2 cores.
DEFAULT_NUM_ROUNDS = 200

#: ``noise-multiplier`` value meaning "calibrate z from epsilon and delta".
NOISE_MULTIPLIER_AUTO = "auto"

#: ``clip-count-stddev`` value meaning ``sigma_b = r / 20`` (Andrew et al. 2021).
CLIP_COUNT_STDDEV_AUTO = "auto"

ACCOUNTANTS: tuple[str, ...] = ("pld", "rdp")
NOISE_PLACEMENTS: tuple[str, ...] = tuple(PLACEMENTS)


def _task_options() -> tuple[Option, ...]:
    from dpfedavg.tasks import task_options  # the tasks declare their own keys (tasks import config lazily)

    return task_options()


def _check_task(name: str) -> str | None:
    """``None`` if ``task`` names a registered task or loads a user's ``module:factory``, else the error text."""
    from dpfedavg.tasks import TASKS, load_task_factory

    if ":" in name:
        try:
            load_task_factory(name)
        except ConfigError as err:
            return str(err)
        return None
    if name in TASKS:
        return None
    allowed = ", ".join(repr(c) for c in TASKS)
    hint = difflib.get_close_matches(name, list(TASKS), n=1)
    more = f" (did you mean {hint[0]!r}?)" if hint else ""
    return (
        f"'task' = {name!r}: allowed values are {allowed}{more}, "
        "or your own 'module:factory' / '/path/to/file.py:factory' (README: Bring your own model)"
    )


_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

#: Every run_config key: the general ones here, then the keys each task declares beside itself
#: (``OPTIONS`` of the task modules, collected by :func:`dpfedavg.tasks.task_options`).
# fmt: off
OPTIONS: tuple[Option, ...] = (
    Option("task", str, "-", "objective and data: a registered task or a user's 'module:factory' / '/path/file.py:factory'", trajectory=True),  # noqa: E501
    Option("algorithm", str, "-", "clip = DP-FedAvg (Alg. 1), norm = DP-NormFedAvg (Alg. 2), none = FedAvg without DP, adaptive-clip = DP-FedAvg with C_k following a quantile of the update norms (Andrew et al. 2021)", choices=ALGORITHMS, privacy=True),  # noqa: E501
    Option("num-rounds", int, "K", "communication rounds", "an integer >= 1", lambda x: x >= 1),
    Option("local-steps", int, "E", "local full-batch gradient steps per round", "an integer >= 1", lambda x: x >= 1, trajectory=True),  # noqa: E501
    Option("local-lr", float, "eta_0", "initial local learning rate", "a float > 0", _positive, trajectory=True),
    Option("lr-decay", float, "gamma", "eta_k = eta_0 * gamma^k", "a float in (0, 1]", lambda x: _positive(x) and x <= 1, trajectory=True),  # noqa: E501
    Option("server-lr", float, "beta_k", 'global step; "eta" means beta_k = eta_k', f'a float > 0 or "{SERVER_LR_FOLLOWS_LOCAL}"', _positive, sentinel=SERVER_LR_FOLLOWS_LOCAL, trajectory=True),  # noqa: E501
    Option("server-momentum", float, "mu", "server momentum m_{k+1} = mu m_k + a_k; 0 is Alg. 1 exactly", "a float in [0, 1)", lambda x: _non_negative(x) and x < 1, trajectory=True),  # noqa: E501
    Option("num-clients", int, "n", "number of clients (= supernodes, or clients-per-node times them)", "an integer >= 1", lambda x: x >= 1, privacy=True),  # noqa: E501
    Option("clients-per-round", float, "r", "expected clients per round; q = r/n", "a number with 0 < r <= num-clients", _positive, privacy=True),  # noqa: E501
    Option("clip", float, "C", "clipping threshold (clip; adaptive-clip: the initial C_0) / scaling factor (norm)", "a float > 0", _positive, privacy=True),  # noqa: E501
    # privacy
    Option("epsilon", float, "epsilon", "target epsilon: z is calibrated so the run spends at most this; 0 = no target", "a float >= 0 (0 = no target)", _non_negative),  # noqa: E501
    Option("delta", float, "delta", "delta of the reported (epsilon, delta)", "a float in (0, 1)", lambda x: math.isfinite(x) and 0 < x < 1, privacy=True),  # noqa: E501
    Option("noise-multiplier", float, "z", 'std of the summed noise / C (sigma = z C / r); "auto" = calibrated from epsilon and delta', f'a float >= 0 or "{NOISE_MULTIPLIER_AUTO}"', _non_negative, sentinel=NOISE_MULTIPLIER_AUTO),  # noqa: E501
    Option("accountant", str, "-", "pld (privacy loss distributions, tight) or rdp (Renyi DP)", choices=ACCOUNTANTS, privacy=True),  # noqa: E501
    Option("max-epsilon", float, "-", "privacy budget: stop before a round that would exceed it; 0 = no budget", "a float >= 0 (0 = no budget)", _non_negative),  # noqa: E501
    Option("noise-placement", str, "-", "client-calibrated (each sampled client adds (zC)^2/|S_k|), client (Alg. 1 line 10: (zC)^2/r each; needs q = 1, zero-out adjacency) or server (central DP); the server tops up the noise of missing replies", choices=NOISE_PLACEMENTS, privacy=True),  # noqa: E501
    # adaptive clipping (algorithm = adaptive-clip; Andrew, Thakkar, McMahan, Ramaswamy 2021)
    Option("target-quantile", float, "gamma", "adaptive-clip: C_k follows this quantile of the update norms", "a float in [0, 1]", lambda x: 0 <= x <= 1, trajectory=True),  # noqa: E501
    Option("clip-lr", float, "eta_C", "adaptive-clip: C_{k+1} = C_k exp(-eta_C (b_k - gamma)), b_k the privately counted fraction of unclipped updates", "a float >= 0", _non_negative, trajectory=True),  # noqa: E501
    Option("clip-count-stddev", float, "sigma_b", f'adaptive-clip: std of the noise on the count of unclipped updates; must exceed z/2 (the update then gets z_u = (z^-2 - (2 sigma_b)^-2)^(-1/2)); "{CLIP_COUNT_STDDEV_AUTO}" = r/20', f'a float > 0 or "{CLIP_COUNT_STDDEV_AUTO}"', _positive, sentinel=CLIP_COUNT_STDDEV_AUTO, trajectory=True),  # noqa: E501
    # run
    Option("seed", int, "-", "seed of every random stream", "an integer >= 0", lambda x: x >= 0, trajectory=True),
    Option("diagnostics", bool, "-", "clients also send the noise-free g so the server can log SNR_k (breaks privacy; research only)", privacy=True),  # noqa: E501
    Option("output-dir", str, "-", "results root; relative paths are relative to the SuperLink's working directory", "a non-empty path", lambda x: bool(x.strip())),  # noqa: E501
    Option("run-name", str, "-", 'results subfolder; "" means <task>-<algorithm>-<timestamp>-<run id>', "empty or letters, digits, '.', '_', '-' (no '/')", lambda x: x == "" or bool(_RUN_NAME.match(x))),  # noqa: E501
    Option("node-wait-timeout", float, "-", "seconds to wait for all n supernodes to register before round 1", "a float > 0", _positive),  # noqa: E501
    Option("round-timeout", float, "-", "seconds a round waits for replies", "a float > 0", _positive),
    Option("clients-per-node", int, "-", "simulation: clients each SuperNode hosts (virtual clients); the node with partition-id p computes clients p*m .. p*m+m-1, so num-supernodes = ceil(num-clients / m); 1 = one SuperNode per client (deployment)", "an integer >= 1", lambda x: x >= 1),  # noqa: E501
    Option("save-trajectory", bool, "-", "also write trajectory.npy: w_k of every round (Figure 3)", trajectory=True),
    Option("checkpoint-every", int, "-", "write <run dir>/checkpoint.npz every this many rounds (and at the end); 0 = never", "an integer >= 0", lambda x: x >= 0),  # noqa: E501
    Option("resume", bool, "-", "continue the run in <output-dir>/<run-name> from its checkpoint (needs run-name)"),  # noqa: E501
    Option("secure-noise", bool, "-", "draw DP noise from OS-seeded generators nobody can replay (production); false = seeded, reproducible (research)", trajectory=True),  # noqa: E501
    # secure aggregation (SecAgg+, client-side noise)
    Option("secure-aggregation", bool, "-", "aggregate through Flower's SecAgg+ so the server learns only the sum (needs noise-placement client or client-calibrated)", trajectory=True, privacy=True),  # noqa: E501
    Option("secagg-quantization-bits", int, "-", "secure aggregation: Q = 2^bits grid levels per coordinate in [-c, c]; needs num-clients * 2^bits < 2^secagg-modulus-bits", "an integer in [1, 30]", lambda x: 1 <= x <= 30, trajectory=True, privacy=True),  # noqa: E501
    Option("secagg-modulus-bits", int, "-", "secure aggregation: the protocol adds integers mod M = 2^bits (Flower allows at most 2^32)", "an integer in [2, 32]", lambda x: 2 <= x <= 32),  # noqa: E501
    Option("secagg-clip-stds", float, "k", "secure aggregation: coordinates are clipped to c >= C + k s (s = a client's noise std); P(any clip) <= 2 exp(-k^2/2) per coordinate", "a float >= 0", _non_negative, trajectory=True, privacy=True),  # noqa: E501
    Option("secagg-num-shares", float, "-", "secure aggregation: SecAgg+ neighbours each client shares its keys with: an integer >= 3 (all clients when a round has fewer), or a fraction in (0, 1] of the round's clients (1.0 = every pair, classic SecAgg)", "an integer >= 3 or a fraction in (0, 1]", lambda x: (0 < x <= 1) or (x >= 3 and x == int(x))),  # noqa: E501
    Option("secagg-reconstruction-threshold", float, "-", "secure aggregation: fraction of a client's shares needed to unmask; above 0.5 so the server cannot learn both a client's mask and its pairwise keys; a round whose survivors fall below it is skipped", "a fraction in (0.5, 1]", lambda x: 0.5 < x <= 1),  # noqa: E501
    Option("secagg-timeout", float, "-", "secure aggregation: seconds each of the 4 SecAgg+ stages waits for replies; 0 = round-timeout", "a float >= 0", _non_negative),  # noqa: E501
    Option("eval-every", int, "-", "evaluate on the server every this many rounds (and in the last 5 rounds)", "an integer >= 1", lambda x: x >= 1),  # noqa: E501
) + _task_options()  # task-specific keys (ignored by tasks that do not use them)
# fmt: on

_BY_KEY = {opt.key: opt for opt in OPTIONS}


def _coerce(opt: Option, value: Any) -> tuple[Any, str | None]:
    """Return ``(typed value, None)`` or ``(None, error text)``."""
    if opt.sentinel is not None and value == opt.sentinel:
        return None, None
    kind = opt.kind
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            value = float(value)
    else:
        ok = isinstance(value, str)
    if not ok:
        want = opt.allowed or ("true or false" if kind is bool else f"a {kind.__name__}")
        return None, f"'{opt.key}' = {value!r} ({type(value).__name__}): expected {want}"
    if opt.key == "task":
        err = _check_task(value)
        return (None, err) if err else (value, None)
    choices = opt.choices
    if choices is not None and value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        more = f" (did you mean {hint[0]!r}?)" if hint else ""
        return None, f"'{opt.key}' = {value!r}: allowed values are {allowed}{more}"
    if opt.check is not None and not opt.check(value):
        return None, f"'{opt.key}' = {value!r}: expected {opt.allowed}"
    return value, None


@dataclass(frozen=True)
class RunConfig:
    """A validated run configuration (snake_case fields mirror the kebab-case keys)."""

    task: str = "quadratic"
    algorithm: str = "norm"
    num_rounds: int = DEFAULT_NUM_ROUNDS
    local_steps: int = 20
    local_lr: float = 0.003
    lr_decay: float = 1.0
    server_lr: float | None = None  # None: beta_k = eta_k
    server_momentum: float = 0.0
    num_clients: int = 100
    clients_per_round: float = 100.0
    clip: float = 50.0
    epsilon: float = 5.0
    delta: float = 1e-6
    noise_multiplier: float | None = None  # None: calibrated from epsilon, delta
    accountant: str = "pld"
    max_epsilon: float = 0.0
    noise_placement: str = "client-calibrated"
    target_quantile: float = DEFAULT_TARGET_QUANTILE
    clip_lr: float = DEFAULT_CLIP_LR
    clip_count_stddev: float | None = None  # None: r / 20
    seed: int = 0
    diagnostics: bool = False
    output_dir: str = "outputs"
    run_name: str = ""
    node_wait_timeout: float = 300.0
    round_timeout: float = 3600.0
    clients_per_node: int = 1
    save_trajectory: bool = False
    checkpoint_every: int = 10
    resume: bool = False
    secure_noise: bool = False
    secure_aggregation: bool = False
    secagg_quantization_bits: int = 16
    secagg_modulus_bits: int = 32
    secagg_clip_stds: float = 10.0
    secagg_num_shares: float = 11.0
    secagg_reconstruction_threshold: float = 0.67
    secagg_timeout: float = 0.0
    eval_every: int = 1
    init: str = "I1"
    dim: int = 200
    data_dir: str = ""
    cache_dir: str = ""
    data_seed: int = -1  # -1: the shard split follows seed
    weight_decay: float = 1e-4
    feature_image_size: int = 224
    backend: str = "numpy"
    device: str = "auto"
    torch_dtype: str = "float32"
    local_batch_size: int = 0

    @property
    def sampling_rate(self) -> float:
        """``q = r / n``: each client's per-round inclusion probability."""
        return self.clients_per_round / self.num_clients

    @property
    def num_nodes(self) -> int:
        """SuperNodes the federation has: ``ceil(num-clients / clients-per-node)``."""
        return -(-self.num_clients // self.clients_per_node)

    @property
    def count_stddev(self) -> float:
        """``sigma_b`` of ``adaptive-clip``: ``clip-count-stddev``, or ``r / 20`` for ``"auto"``."""
        if self.clip_count_stddev is None:
            return default_count_stddev(self.clients_per_round)
        return self.clip_count_stddev

    def to_run_config(self) -> dict[str, Any]:
        """The kebab-case dict this config came from (``server-lr`` None -> "eta")."""
        out: dict[str, Any] = {}
        for opt in OPTIONS:
            value = getattr(self, opt.attr)
            out[opt.key] = opt.sentinel if (value is None and opt.sentinel is not None) else value
        return out

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any], *, allow_missing: bool = True) -> RunConfig:
        """Validate a flat kebab-case ``run_config`` and build the config.

        Parameters
        ----------
        run_config:
            Flower's ``context.run_config`` (or any dict of kebab-case keys).
        allow_missing:
            Fill keys that are absent with the defaults (Flower always passes
            every key from ``pyproject.toml``; Python users may pass a subset).

        Raises
        ------
        ConfigError
            Listing every unknown key (with a "did you mean"), every value of
            the wrong type or out of range, and every inconsistent combination.
        """
        errors: list[str] = []
        values: dict[str, Any] = {}
        for key in run_config:
            if key not in _BY_KEY:
                hint = difflib.get_close_matches(key, list(_BY_KEY), n=1)
                more = f" (did you mean '{hint[0]}'?)" if hint else ""
                errors.append(f"unknown key '{key}'{more}")
        for opt in OPTIONS:
            if opt.key not in run_config:
                if not allow_missing:
                    errors.append(f"missing key '{opt.key}'")
                continue
            value, err = _coerce(opt, run_config[opt.key])
            if err:
                errors.append(err)
            else:
                values[opt.attr] = value
        if not errors:
            cfg = cls(**values)
            errors.extend(cfg._cross_check())
            if not errors:
                return cfg
        raise ConfigError("invalid run config: " + "; ".join(errors))

    def _cross_check(self) -> list[str]:
        errors = []
        if self.epsilon > 0 and self.noise_multiplier is not None:
            errors.append(
                f"'epsilon' = {self.epsilon:g} and 'noise-multiplier' = {self.noise_multiplier:g} are both set: "
                "set epsilon (z is calibrated) or noise-multiplier (fixed z, reported epsilon) — "
                "for a fixed z pass epsilon=0"
            )
        if self.clients_per_round > self.num_clients:
            errors.append(
                f"'clients-per-round' = {self.clients_per_round:g} exceeds 'num-clients' = {self.num_clients}: "
                "expected 0 < r <= n (set clients-per-round together with num-clients; r = n is full participation)"
            )
        if self.clients_per_node > self.num_clients:
            errors.append(
                f"'clients-per-node' = {self.clients_per_node} exceeds 'num-clients' = {self.num_clients}: "
                "expected 1 <= clients-per-node <= num-clients (num-clients = one SuperNode for every client)"
            )
        if self.noise_placement == "client" and self.clients_per_round != self.num_clients:
            errors.append(
                f"'noise-placement' = 'client' with 'clients-per-round' = {self.clients_per_round:g} < 'num-clients' "
                f"= {self.num_clients} (q = {self.sampling_rate:.4g}): each client adds (zC)^2/r, so the noise in the "
                "sum grows with the number of clients sampled and whether a client took part shows in its variance; "
                "no accounting here covers that. Allowed: 'client' only with clients-per-round = num-clients "
                "(q = 1, zero-out adjacency), or 'client-calibrated' / 'server' for any q"
            )
        if self.resume and not self.run_name:
            errors.append(
                "'resume' = True needs 'run-name': the interrupted run's folder <output-dir>/<run-name> "
                "holds the checkpoint (the default name has a timestamp, so give runs you may resume a name)"
            )
        errors.extend(self._check_secure_aggregation())
        return errors

    def _check_secure_aggregation(self) -> list[str]:
        if not self.secure_aggregation:
            return []
        errors = []
        if self.clients_per_node > 1:
            errors.append(
                f"'secure-aggregation' = True with 'clients-per-node' = {self.clients_per_node}: SecAgg+ hides each "
                "SuperNode's input from the server, and a node hosting several clients computes each of their updates "
                "in the clear, so the guarantee would be per node, not per client; allowed: clients-per-node = 1"
            )
        if self.noise_placement not in ("client", "client-calibrated"):
            errors.append(
                f"'secure-aggregation' = True with 'noise-placement' = {self.noise_placement!r}: the server only sees "
                "the sum, so the clients must add the noise; allowed: 'client', 'client-calibrated'"
            )
        if not get_bound(self.algorithm).private:
            errors.append(
                f"'secure-aggregation' = True with 'algorithm' = {self.algorithm!r}: the quantization range comes "
                "from the bound ||g|| <= C; allowed: 'clip', 'norm'"
            )
        if self.diagnostics:
            errors.append(
                "'secure-aggregation' = True with 'diagnostics' = True: diagnostics send every client's clean "
                "update to the server, which secure aggregation exists to prevent; set diagnostics=false"
            )
        bits, mbits = self.secagg_quantization_bits, self.secagg_modulus_bits
        if bits >= mbits:
            errors.append(f"'secagg-quantization-bits' = {bits} must be below 'secagg-modulus-bits' = {mbits}")
        elif self.num_clients * 2**bits >= 2**mbits:
            most = (2**mbits - 1) // 2**bits
            fit = max(1, mbits - math.ceil(math.log2(self.num_clients + 1)))
            errors.append(
                f"'secagg-quantization-bits' = {bits} with 'secagg-modulus-bits' = {mbits} lets at most {most} "
                f"clients be summed without wrapping around, but all 'num-clients' = {self.num_clients} may be "
                f"sampled; use secagg-quantization-bits <= {fit}"
            )
        return errors

    def replace(self, **changes: Any) -> RunConfig:
        """A validated copy with some fields changed (snake_case names)."""
        merged = self.to_run_config()
        for name, value in changes.items():
            key = name.replace("_", "-")
            sentinel = _BY_KEY[key].sentinel if key in _BY_KEY else None
            merged[key] = sentinel if (value is None and sentinel is not None) else value
        return RunConfig.from_run_config(merged)


#: The defaults, declared once: the :class:`RunConfig` fields (``pyproject.toml`` repeats them for Flower,
#: checked equal by ``tests/test_config.py``).
_FIELD_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(RunConfig)}


def _check_options_match_fields() -> None:
    """Every Option has a RunConfig field and every field an Option (import-time guard)."""
    keys = {opt.attr for opt in OPTIONS}
    if keys != set(_FIELD_DEFAULTS):
        raise AssertionError(f"OPTIONS and RunConfig differ: {sorted(keys ^ set(_FIELD_DEFAULTS))}")


_check_options_match_fields()
