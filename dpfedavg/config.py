"""Run configuration: one frozen dataclass whose fields declare every key, validated whenever one is built.

Flower hands the app a flat ``run_config`` dict with kebab-case keys (the defaults live in
``pyproject.toml`` under ``[tool.flwr.app.config]``; ``--run-config`` overrides them);
`RunConfig.from_run_config()` turns it into a typed `RunConfig`. From Python,
``RunConfig(algorithm="norm", epsilon=5.0)`` builds one directly. Either way every field is
checked in ``__post_init__`` (its type, range and allowed values, then the combinations) and a bad
value raises one `ConfigError` naming every bad key, its value and what is allowed, before
any expensive start-up.

Each key is declared once, on its field: ``local_steps: int = option(20, "E", "...")`` holds the
default, the paper's symbol, the help text, the allowed values and whether the key defines the
trajectory or the privacy guarantee (`Option`, collected in `OPTIONS`). The choices of
``algorithm``, ``noise-placement``, ``noise-mechanism`` and ``accountant`` are the names of their registries
(`dpfedavg.core.dp.BOUNDS`, `dpfedavg.core.mechanism.PLACEMENTS`,
`dpfedavg.privacy.noise_mechanisms.NOISE_MECHANISMS`, `dpfedavg.privacy.accountants.ACCOUNTANTS`),
and the noise mechanism checks its own keys
(`config_errors()`). Whether ``task`` names a task is
checked where tasks are built (`dpfedavg.tasks.resolve_task()`): this module imports no task and no user code.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from dpfedavg.core.adaptive_clip import DEFAULT_CLIP_LR, DEFAULT_TARGET_QUANTILE
from dpfedavg.core.check_in import CHECK_IN, POISSON, SAMPLINGS
from dpfedavg.core.dp import BOUNDS, get_bound
from dpfedavg.core.mechanism import PLACEMENTS, get_placement
from dpfedavg.errors import ConfigError
from dpfedavg.privacy.accountants import ACCOUNTANTS
from dpfedavg.privacy.calibration import MAX_NOISE_MULTIPLIER
from dpfedavg.privacy.noise_mechanisms import NOISE_MECHANISMS, get_noise_mechanism
from dpfedavg.privacy.secure_aggregation import SecAggSettings

__all__ = [
    "BACKENDS",
    "DEVICES",
    "OPTIONS",
    "TORCH_DTYPES",
    "ConfigError",
    "Option",
    "RunConfig",
    "non_negative",
    "parse_run_config",
    "positive",
]


@dataclass(frozen=True)
class Option:
    """One run_config key: its type, paper symbol, help, allowed values and default (see `option()`)."""

    key: str
    kind: type
    symbol: str
    help: str
    allowed: str = ""
    check: Callable[[Any], bool] | None = None
    choices: tuple[Any, ...] | None = None
    #: A string accepted instead of a number; it becomes ``None`` in the dataclass.
    sentinel: str | None = None
    #: Defines the trajectory: a resumed run may not change it (see `dpfedavg.io.checkpoint`).
    trajectory: bool = False
    #: The privacy guarantee depends on it: a resumed run may not change it, and ``config.json`` records it
    #: with the guarantee (see `dpfedavg.io.checkpoint.privacy_signature()`).
    privacy: bool = False
    #: The field's default (``None`` where the sentinel stands for it).
    field_default: Any = None

    @property
    def attr(self) -> str:
        """The dataclass field name (snake_case)."""
        return self.key.replace("-", "_")

    @property
    def default(self) -> Any:
        """The default as a run_config value (the sentinel for ``None``)."""
        value = self.field_default
        return self.sentinel if (value is None and self.sentinel is not None) else value


def option(
    default: Any,
    symbol: str,
    help: str,  # noqa: A002 - the word argparse uses
    allowed: str = "",
    check: Callable[[Any], bool] | None = None,
    *,
    choices: tuple[Any, ...] | None = None,
    sentinel: str | None = None,
    trajectory: bool = False,
    privacy: bool = False,
) -> Any:
    """A `RunConfig` field declaring its key: the default and everything `Option` holds."""
    spec = {
        "symbol": symbol,
        "help": help,
        "allowed": allowed,
        "check": check,
        "choices": choices,
        "sentinel": sentinel,
        "trajectory": trajectory,
        "privacy": privacy,
    }
    return field(default=default, metadata={"option": spec})


def positive(x: float) -> bool:
    """A finite number > 0."""
    return math.isfinite(x) and x > 0


def non_negative(x: float) -> bool:
    """A finite number >= 0."""
    return math.isfinite(x) and x >= 0


#: ``server-lr`` value meaning ``beta_k = eta_k`` (the paper's choice in §4.4 and §5).
SERVER_LR_FOLLOWS_LOCAL = "eta"
#: ``noise-multiplier`` value meaning "calibrate z from epsilon and delta".
NOISE_MULTIPLIER_AUTO = "auto"
#: ``bands`` / ``max-participations`` value meaning "derive it" (``floor(n / r)`` / ``ceil(K / b)``).
BANDED_AUTO = "auto"
#: ``participation`` schemes of banded-MF noise (`dpfedavg.core.participation.Participation`).
PARTICIPATION_SCHEMES: tuple[str, ...] = ("cyclic", "min-separation", "cyclic-poisson")
#: ``checkpoint-every`` value meaning every round with Flower, every 10 rounds in the batched engine.
CHECKPOINT_AUTO = "auto"
#: ``clip-count-stddev`` value meaning `dpfedavg.core.adaptive_clip.auto_count_stddev()` of the run's ``z``.
CLIP_COUNT_STDDEV_AUTO = "auto"
#: ``backend`` of the logistic-regression tasks.
BACKENDS: tuple[str, ...] = ("numpy", "torch")
#: ``device`` of the torch tasks (and ``cuda:N``).
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
#: ``torch-dtype`` of the torch tasks.
TORCH_DTYPES: tuple[str, ...] = ("float32", "float64")

#: The ranges the code can honour (issue 29): outside them a run would hang, exhaust memory or mean nothing.
#: K: per-round state (metrics.csv, the checkpoint's per-round statistics) grows with it; the accountants bound
#: their own memory (`dpfedavg.privacy.accountants.PLD_MIN_SIGMA`).
MAX_ROUNDS = 100_000
#: A target epsilon: calibration terminates in seconds over the whole range (measured on the benchmarks page).
EPSILON_RANGE = (0.01, 100.0)
#: delta: below 1e-12 the PLD's truncated tails (1e-15 per composition) are no longer negligible against it.
DELTA_RANGE = (1e-12, 0.1)
#: q = r/n: below it a client takes part in fewer than one round in 10^6 and calibration chases z -> 0.
MIN_SAMPLING_RATE = 1e-6
#: n: Poisson sampling draws n uniforms per round (80 MB at the limit).
MAX_CLIENTS = 10_000_000
#: adaptive-clip: the largest ``clip-range-factor`` F (C_k stays in [C_0 / F, C_0 F]).
MAX_CLIP_RANGE_FACTOR = 1e6

#: ``run-name``: one portable folder name (``fullmatch``: ``$`` would let a trailing newline through).
MAX_RUN_NAME = 128
_RUN_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_RUN_NAME - 1}}}")


def _noise_multiplier_ok(x: float) -> bool:
    """z = 0 (the explicit opt-out) or in (0, max]; ``-0.0`` is refused: it compares equal to 0, but its sign says a
    negative value was meant, and no value may turn the noise off unless it is spelled 0."""
    return non_negative(x) and math.copysign(1.0, x) > 0 and x <= MAX_NOISE_MULTIPLIER


def _device_ok(value: str) -> bool:
    return value in DEVICES or (value.startswith("cuda:") and value[5:].isdigit())


# fmt: off
@dataclass(frozen=True)
class RunConfig:
    """A validated run configuration (snake_case fields mirror the kebab-case keys).

    Build it from Python (``RunConfig(algorithm="norm", epsilon=5.0)``) or from Flower's flat
    ``run_config`` (`from_run_config()`); `replace()` changes fields. Every construction is
    validated: a bad value raises one `ConfigError` naming every bad key.
    """

    task: str = option("quadratic", "-", "objective and data: a registered task or a user's 'module:factory' / '/path/file.py:factory'", "a task name", lambda x: bool(x.strip()), trajectory=True)  # noqa: E501
    algorithm: str = option("norm", "-", "clip = DP-FedAvg (Alg. 1), norm = DP-NormFedAvg (Alg. 2), none = FedAvg without DP, adaptive-clip = DP-FedAvg with C_k following a quantile of the update norms (Andrew et al. 2021)", choices=tuple(BOUNDS), privacy=True)  # noqa: E501
    num_rounds: int = option(200, "K", "communication rounds (the paper's §4.4 uses 500)", f"an integer in [1, {MAX_ROUNDS}]", lambda x: 1 <= x <= MAX_ROUNDS)  # noqa: E501
    local_steps: int = option(20, "E", "local full-batch gradient steps per round", "an integer >= 1", lambda x: x >= 1, trajectory=True)  # noqa: E501
    local_lr: float = option(0.003, "eta_0", "initial local learning rate", "a float > 0", positive, trajectory=True)
    lr_decay: float = option(1.0, "gamma", "eta_k = eta_0 * gamma^k", "a float in (0, 1]", lambda x: positive(x) and x <= 1, trajectory=True)  # noqa: E501
    server_lr: float | None = option(None, "beta_k", 'global step; "eta" means beta_k = eta_k', f'a float > 0 or "{SERVER_LR_FOLLOWS_LOCAL}"', positive, sentinel=SERVER_LR_FOLLOWS_LOCAL, trajectory=True)  # noqa: E501
    server_momentum: float = option(0.0, "mu", "server momentum m_{k+1} = mu m_k + a_k; 0 is Alg. 1 exactly", "a float in [0, 1)", lambda x: non_negative(x) and x < 1, trajectory=True)  # noqa: E501
    num_clients: int = option(100, "n", "number of clients (= supernodes, or clients-per-node times them)", f"an integer in [1, {MAX_CLIENTS}]", lambda x: 1 <= x <= MAX_CLIENTS, privacy=True)  # noqa: E501
    clients_per_round: float = option(100.0, "r", "expected clients per round; q = r/n", f"a number with 0 < r <= num-clients and q = r/n >= {MIN_SAMPLING_RATE:g}", positive, privacy=True)  # noqa: E501
    clip: float = option(50.0, "C", "clipping threshold (clip; adaptive-clip: the initial C_0) / scaling factor (norm)", "a float > 0", positive, privacy=True)  # noqa: E501
    # privacy
    epsilon: float = option(5.0, "epsilon", "target epsilon: z is calibrated so the run spends at most this; 0 = no target, for a fixed noise-multiplier (or algorithm 'none')", f"a float >= 0: 0 (no target) or in [{EPSILON_RANGE[0]:g}, {EPSILON_RANGE[1]:g}]", lambda x: x == 0 or EPSILON_RANGE[0] <= x <= EPSILON_RANGE[1])  # noqa: E501
    delta: float = option(1e-6, "delta", "delta of the reported (epsilon, delta)", f"a float in [{DELTA_RANGE[0]:g}, {DELTA_RANGE[1]:g}]", lambda x: DELTA_RANGE[0] <= x <= DELTA_RANGE[1], privacy=True)  # noqa: E501
    noise_multiplier: float | None = option(None, "z", 'std of the summed noise / C (sigma = z C / r); "auto" = calibrated from epsilon and delta', f'"{NOISE_MULTIPLIER_AUTO}", 0 (explicitly no noise) or a float in (0, {MAX_NOISE_MULTIPLIER:g}]; a negative value, -0.0 too, is refused', _noise_multiplier_ok, sentinel=NOISE_MULTIPLIER_AUTO)  # noqa: E501
    accountant: str = option("pld", "-", "pld (privacy loss distributions, tight) or rdp (Renyi DP)", choices=tuple(ACCOUNTANTS), privacy=True)  # noqa: E501
    max_epsilon: float = option(0.0, "-", "privacy budget: stop before a round that would exceed it; 0 = no budget", "a float >= 0 (0 = no budget)", non_negative)  # noqa: E501
    noise_placement: str = option("client-calibrated", "-", "client-calibrated (each sampled client adds (zC)^2/|S_k|), client (Alg. 1 line 10: (zC)^2/r each; needs q = 1, zero-out adjacency) or server (central DP); the server tops up the noise of missing replies", choices=tuple(PLACEMENTS), privacy=True)  # noqa: E501
    noise_mechanism: str = option("independent", "-", "independent (Poisson sampling with q = r/n, independent Gaussian noise each round) or banded-mf (no sampling: a participation rule the server enforces and banded matrix-factorization noise x_k + (C^-1 Z)_k added by the server; needs noise-placement = 'server'; docs: privacy/banded-mf.md)", choices=tuple(NOISE_MECHANISMS), privacy=True)  # noqa: E501
    sampling: str = option(POISSON, "-", "who takes part in round k: poisson (the server samples each client with q = r/n, Alg. 1 line 3) or check-in (the server asks every available node; each node takes part with probability q from its own OS randomness and otherwise sends 0 + its noise share; flwr run only; docs: privacy/check-ins.md)", choices=SAMPLINGS, privacy=True)  # noqa: E501
    # banded matrix-factorization noise (noise-mechanism = banded-mf; Choquette-Choo et al. 2023)
    bands: int | None = option(None, "b", f'banded-mf: bands of the Toeplitz strategy C = the minimum separation of the participations of a client (cyclic: b groups); "{BANDED_AUTO}" = floor(n / r), at most K', f'an integer in [1, num-rounds] or "{BANDED_AUTO}"', lambda x: x >= 1, sentinel=BANDED_AUTO, privacy=True)  # noqa: E501
    participation: str = option("cyclic", "-", "banded-mf: who may take part in round k: cyclic (client i in group i mod b; round k asks group k mod b), min-separation (every connected client whose last participation is >= b rounds ago and that took part < k times), cyclic-poisson (group k mod b, each client with p = r b / n; amplified)", choices=PARTICIPATION_SCHEMES, privacy=True)  # noqa: E501
    max_participations: int | None = option(None, "k", f'banded-mf: participations per client at most; "{BANDED_AUTO}" = ceil(K / b) (cyclic schemes need that many)', f'an integer >= 1 or "{BANDED_AUTO}"', lambda x: x >= 1, sentinel=BANDED_AUTO, privacy=True)  # noqa: E501
    strategy_coefficients: str = option("sqrt-prefix", "c_j", "banded-mf: c_0 .. c_{b-1} of C: sqrt-prefix (binom(2j, j) / 4^j, the square root of the prefix-sum matrix cut to b bands), optimized (jax-privacy's optimized banded Toeplitz; pip install jax-privacy==2.0.0) or b comma-separated numbers", "'sqrt-prefix', 'optimized' or numbers 'c_0, ..., c_{b-1}' with c_0 != 0", lambda x: bool(x.strip()), privacy=True)  # noqa: E501
    # adaptive clipping (algorithm = adaptive-clip; Andrew, Thakkar, McMahan, Ramaswamy 2021)
    target_quantile: float = option(DEFAULT_TARGET_QUANTILE, "gamma", "adaptive-clip: C_k follows this quantile of the update norms", "a float in [0, 1]", lambda x: 0 <= x <= 1, trajectory=True)  # noqa: E501
    clip_lr: float = option(DEFAULT_CLIP_LR, "eta_C", "adaptive-clip: C_{k+1} = C_k exp(-eta_C (b_k - gamma)), b_k the privately counted fraction of unclipped updates", "a float >= 0", non_negative, trajectory=True)  # noqa: E501
    clip_count_stddev: float | None = option(None, "sigma_b", f'adaptive-clip: std of the noise on the count of unclipped updates; must exceed z/2 (the update then gets z_u = (z^-2 - (2 sigma_b)^-2)^(-1/2)); "{CLIP_COUNT_STDDEV_AUTO}" = max(r/20, the sigma_b with z_u = 1.1 z), valid for every z', f'a float > 0 or "{CLIP_COUNT_STDDEV_AUTO}"', positive, sentinel=CLIP_COUNT_STDDEV_AUTO, trajectory=True)  # noqa: E501
    clip_range_factor: float = option(1000.0, "F", "adaptive-clip: C_k stays in [C_0 / F, C_0 F] (C_0 = clip), so no released count can push it to 0 or infinity", f"a float in [1, {MAX_CLIP_RANGE_FACTOR:g}]", lambda x: 1 <= x <= MAX_CLIP_RANGE_FACTOR, trajectory=True)  # noqa: E501
    # run
    seed: int = option(0, "-", "seed of every random stream", "an integer >= 0", lambda x: x >= 0, trajectory=True)
    diagnostics: bool = option(False, "-", "clients also send the noise-free g so the server can log SNR_k (breaks privacy; research only)", privacy=True)  # noqa: E501
    output_dir: str = option("outputs", "-", "results root; relative paths are relative to the SuperLink's working directory", "a non-empty path", lambda x: bool(x.strip()))  # noqa: E501
    run_name: str = option("", "-", 'results subfolder; "" means <task>-<algorithm>-<timestamp>-<run id>', f"empty, or one folder name: 1 to {MAX_RUN_NAME} letters, digits, '.', '_', '-', starting with a letter or digit (no '/', space, newline or other character)", lambda x: x == "" or bool(_RUN_NAME.fullmatch(x)))  # noqa: E501
    node_wait_timeout: float = option(300.0, "-", "seconds to wait for all n supernodes to register before round 1", "a float > 0", positive)  # noqa: E501
    round_timeout: float = option(3600.0, "-", "seconds a round waits for replies", "a float > 0", positive)
    clients_per_node: int = option(1, "-", "simulation: clients each SuperNode hosts (virtual clients); the node with partition-id p computes clients p*m .. p*m+m-1, so num-supernodes = ceil(num-clients / m); 1 = one SuperNode per client (deployment)", "an integer >= 1", lambda x: x >= 1)  # noqa: E501
    save_trajectory: bool = option(False, "-", "also write trajectory.npy: w_k of every round (Figure 3)", trajectory=True)  # noqa: E501
    checkpoint_every: int | None = option(None, "-", f'write <run dir>/checkpoint.npz every this many rounds (and at the end); 0 = never; "{CHECKPOINT_AUTO}" = every round with Flower (each round durable before the next is sent: a crash loses at most the round in flight), every 10 in the batched engine', f'an integer >= 0 or "{CHECKPOINT_AUTO}"', lambda x: x >= 0, sentinel=CHECKPOINT_AUTO)  # noqa: E501
    resume: bool = option(False, "-", "continue the run in <output-dir>/<run-name> from its checkpoint (needs run-name)")  # noqa: E501
    secure_noise: bool = option(False, "-", "draw DP noise from OS-seeded generators nobody can replay (production); false = seeded, reproducible (research)", trajectory=True)  # noqa: E501
    # secure aggregation (SecAgg+, client-side noise)
    secure_aggregation: bool = option(False, "-", "aggregate through Flower's SecAgg+ so the server learns only the sum (needs a placement where the clients add the noise)", trajectory=True, privacy=True)  # noqa: E501
    secagg_quantization_bits: int = option(16, "-", "secure aggregation: Q = 2^bits grid levels per coordinate in [-c, c]; needs num-clients * 2^bits < 2^secagg-modulus-bits", "an integer in [1, 30]", lambda x: 1 <= x <= 30, trajectory=True, privacy=True)  # noqa: E501
    secagg_modulus_bits: int = option(32, "-", "secure aggregation: the protocol adds integers mod M = 2^bits (Flower allows at most 2^32)", "an integer in [2, 32]", lambda x: 2 <= x <= 32)  # noqa: E501
    secagg_clip_stds: float = option(10.0, "k", "secure aggregation: coordinates are clipped to c >= C + k s (s = a client's noise std); P(any clip) <= 2 exp(-k^2/2) per coordinate", "a float >= 0", non_negative, trajectory=True, privacy=True)  # noqa: E501
    secagg_num_shares: float = option(11.0, "-", "secure aggregation: SecAgg+ neighbours each client shares its keys with: an integer >= 3 (all clients when a round has fewer), or a fraction in (0, 1] of the round's clients (1.0 = every pair, classic SecAgg)", "an integer >= 3 or a fraction in (0, 1]", lambda x: (0 < x <= 1) or (x >= 3 and x == int(x)))  # noqa: E501
    secagg_reconstruction_threshold: float = option(0.67, "-", "secure aggregation: fraction of a client's shares needed to unmask; above 0.5 so the server cannot learn both a client's mask and its pairwise keys; a round whose survivors fall below it is skipped", "a fraction in (0.5, 1]", lambda x: 0.5 < x <= 1)  # noqa: E501
    secagg_timeout: float = option(0.0, "-", "secure aggregation: seconds each of the 4 SecAgg+ stages waits for replies; 0 = round-timeout", "a float >= 0", non_negative)  # noqa: E501
    canary_clients: int = option(0, "m", "audit the run (batched engine, flwr run): m canary directions, each inserted with probability 1/2 as a client whose update is C c_j (sampled with the same q = r/n and noised like any client; the federation has n + the inserted ones); the final log line, config.json and RunResult report Andrew et al.'s Gaussian-fit estimates and Steinke et al.'s one-run lower bound beside the accountant's epsilon (docs: privacy/auditing-a-run.md); 0 = off", f"an integer in [0, {MAX_CLIENTS}]", lambda x: 0 <= x <= MAX_CLIENTS, trajectory=True)  # noqa: E501
    eval_every: int = option(1, "-", "evaluate on the server every this many rounds (and in the last 5 rounds)", "an integer >= 1", lambda x: x >= 1)  # noqa: E501
    max_failed_fraction: float = option(0.5, "-", "flwr run: fail fast instead of training on noise: stop when more than this fraction of the sampled clients' replies were rejected or failed over the last 5 rounds (a round in which all were stops at once; the batched engine's in-process clients never send a reply it could reject)", "a fraction in (0, 1]", lambda x: 0 < x <= 1)  # noqa: E501
    # task-specific keys (ignored by tasks that do not use them)
    init: str = option("I1", "w_0", "quadratic: I1 (w0 = w* + z) or I2 (w0 = w* + z/5), z ~ U(0,1)^d", choices=("I1", "I2"), trajectory=True)  # noqa: E501
    dim: int = option(200, "d", "quadratic: model dimension", "an integer >= 1", lambda x: x >= 1, trajectory=True)
    data_dir: str = option("", "-", 'real-data tasks: folder with local dataset files (offline use); "" = download', 'a path or ""')  # noqa: E501
    cache_dir: str = option("", "-", 'real-data tasks: where prepared features are cached; "" = ~/.cache/dpfedavg', 'a path or ""')  # noqa: E501
    data_seed: int = option(-1, "-", "real-data tasks: seed of the shard split of the training data across the clients (the federation); -1 = seed", "an integer >= -1 (-1 = seed)", lambda x: x >= -1, trajectory=True)  # noqa: E501
    weight_decay: float = option(1e-4, "lambda", "real-data tasks: L2 regularization (PyTorch weight_decay); paper: 1e-4", "a float >= 0", non_negative, trajectory=True)  # noqa: E501
    feature_image_size: int = option(224, "-", "cifar tasks: images are resized to this before ResNet-18", "an integer >= 32", lambda x: x >= 32, trajectory=True)  # noqa: E501
    backend: str = option("numpy", "-", "logistic-regression tasks: numpy (exact closed form of the local steps) or torch (the same closed form in torch, CPU or GPU: see device, torch-dtype; torch.func steps with local-batch-size > 0)", choices=BACKENDS)  # noqa: E501
    device: str = option("auto", "-", 'torch tasks: "auto" (CUDA when torch sees a GPU, e.g. the one Ray gives a ClientApp with client-resources-num-gpus; else CPU), "cpu", "cuda" or "cuda:N"', '"auto", "cpu", "cuda" or "cuda:N"', _device_ok)  # noqa: E501
    torch_compile: bool = option(False, "-", "torch tasks, the fast path: each local step of a chunk of clients is one torch.compile call (chunks of one size: 64 clients on the CPU, a block padded to one of a few sizes on a GPU, so a run compiles once, in its first round; clients with unequal example counts compile once per block width), and the batched engine's device pipeline bounds, noises and sums in torch-dtype (float32: within 1e-6 of float64, the same noise draws); falls back to eager with one log line when the model cannot be compiled", trajectory=True)  # noqa: E501
    torch_dtype: str = option("float32", "-", "torch tasks: float32 (default) or float64 (the iterates are float64 either way)", choices=TORCH_DTYPES, trajectory=True)  # noqa: E501
    local_batch_size: int = option(0, "b", "torch tasks: examples per local step; 0 = full batch (the paper); b > 0: each of the E steps uses min(b, m_i) examples drawn from (seed, client, round)", "an integer >= 0 (0 = full batch)", lambda x: x >= 0, trajectory=True)  # noqa: E501
    # fmt: on

    def __post_init__(self) -> None:
        errors = []
        for opt in OPTIONS:
            value, err = _coerce(opt, getattr(self, opt.attr))
            if err:
                errors.append(err)
            else:
                object.__setattr__(self, opt.attr, value)
        if not errors:
            errors = self._cross_check()
        if errors:
            raise ConfigError("invalid run config: " + "; ".join(errors))

    # ----------------------------------------------------------------- derived
    @property
    def sampling_rate(self) -> float:
        """``q = r / n``: each client's per-round inclusion probability."""
        return self.clients_per_round / self.num_clients

    @property
    def num_nodes(self) -> int:
        """SuperNodes the federation has: ``ceil(num-clients / clients-per-node)``."""
        return -(-self.num_clients // self.clients_per_node)

    @property
    def clip_limits(self) -> tuple[float, float]:
        """``adaptive-clip``'s floor and ceiling of ``C_k``: ``(C_0 / F, C_0 F)``."""
        return self.clip / self.clip_range_factor, self.clip * self.clip_range_factor

    # -------------------------------------------------------------- run_config
    def to_run_config(self) -> dict[str, Any]:
        """The kebab-case dict this config came from (``None`` -> the key's sentinel, e.g. ``"eta"``)."""
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
            Fill keys that are absent with the defaults (Flower always passes every key from
            ``pyproject.toml``; Python users may pass a subset).

        Raises
        ------
        ConfigError
            Listing every unknown key (with a "did you mean"), every value of the wrong type or
            out of range, and every inconsistent combination.
        """
        errors = [_unknown_key(key) for key in run_config if key not in _BY_KEY]
        if not allow_missing:
            errors.extend(f"missing key '{key}'" for key in _BY_KEY if key not in run_config)
        values = {_BY_KEY[key].attr: value for key, value in run_config.items() if key in _BY_KEY}
        try:
            cfg = cls(**values)
        except ConfigError as err:
            errors.append(str(err).removeprefix("invalid run config: "))
        if errors:
            raise ConfigError("invalid run config: " + "; ".join(errors))
        return cfg

    def replace(self, **changes: Any) -> RunConfig:
        """A validated copy with some fields changed (snake_case names; a sentinel string or ``None`` for auto)."""
        _check_field_names(changes)
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------ combinations
    def _cross_check(self) -> list[str]:
        errors = []
        if self.epsilon > 0 and self.noise_multiplier is not None:
            errors.append(
                f"'epsilon' = {self.epsilon:g} and 'noise-multiplier' = {self.noise_multiplier:g} are both set: "
                "set epsilon (z is calibrated) or noise-multiplier (fixed z, reported epsilon) — "
                "for a fixed z pass epsilon=0"
            )
        if self.epsilon == 0 and self.noise_multiplier is None and get_bound(self.algorithm).private:
            errors.append(
                f"'epsilon' = 0 with 'noise-multiplier' = {NOISE_MULTIPLIER_AUTO!r} and 'algorithm' = "
                f"{self.algorithm!r}: there is no target to calibrate the noise for, so the run would train WITHOUT "
                "differential privacy; for privacy set epsilon (a target in "
                f"[{EPSILON_RANGE[0]:g}, {EPSILON_RANGE[1]:g}], z is calibrated) or a noise-multiplier > 0 (fixed z, "
                "reported epsilon); to train without DP say so: algorithm='none' or noise-multiplier=0"
            )
        if self.clients_per_round > self.num_clients:
            errors.append(
                f"'clients-per-round' = {self.clients_per_round:g} exceeds 'num-clients' = {self.num_clients}: "
                "expected 0 < r <= n (set clients-per-round together with num-clients; r = n is full participation)"
            )
            return errors  # the rules below read q = r / n
        if self.sampling_rate < MIN_SAMPLING_RATE:
            errors.append(
                f"'clients-per-round' = {self.clients_per_round:g} with 'num-clients' = {self.num_clients}: "
                f"q = r/n = {self.sampling_rate:.3g} is below {MIN_SAMPLING_RATE:g} (a client would take part in fewer "
                "than one round in a million, and calibrating z for it chases z to 0); allowed: clients-per-round >= "
                f"{MIN_SAMPLING_RATE * self.num_clients:g}"
            )
            return errors
        if self.clients_per_node > self.num_clients:
            errors.append(
                f"'clients-per-node' = {self.clients_per_node} exceeds 'num-clients' = {self.num_clients}: "
                "expected 1 <= clients-per-node <= num-clients (num-clients = one SuperNode for every client)"
            )
        placement = get_placement(self.noise_placement)
        participation = placement.participation_error(self.num_clients, self.clients_per_round)
        if participation:
            errors.append(f"'noise-placement' = {self.noise_placement!r} {participation}")
        mechanism_errors = get_noise_mechanism(self.noise_mechanism).config_errors(self)
        errors.extend(mechanism_errors)
        if self.sampling == CHECK_IN:
            errors.extend(self._check_in_errors())
        if self.resume and not self.run_name:
            errors.append(
                "'resume' = True needs 'run-name': the interrupted run's folder <output-dir>/<run-name> "
                "holds the checkpoint (the default name has a timestamp, so give runs you may resume a name)"
            )
        if self.canary_clients:
            errors.extend(self._canary_errors())
        if self.secure_aggregation and not mechanism_errors:
            errors.extend(
                SecAggSettings.from_config(self).config_errors(
                    placement=placement,
                    bound=get_bound(self.algorithm),
                    num_clients=self.num_clients,
                    clients_per_node=self.clients_per_node,
                    diagnostics=self.diagnostics,
                )
            )
        return errors

    def _check_in_errors(self) -> list[str]:
        """Where random check-ins (each node's own coin, `dpfedavg.core.check_in`) cannot stand in for the server's
        Poisson sampling, the reason."""
        needs = {
            "noise-mechanism": (self.noise_mechanism, "independent", "banded-MF's participation rule is the server's"),
            "noise-placement": (self.noise_placement, "client-calibrated", "a node that sits out sends 0 plus its "
                                "noise share, so the sum's noise does not depend on who took part"),
            "clients-per-node": (self.clients_per_node, 1, "one coin per node: virtual clients share a node"),
            "canary-clients": (self.canary_clients, 0, "canaries are sampled by the server"),
        }  # fmt: skip
        errors = [
            f"'sampling' = {CHECK_IN!r} with {key!r} = {value!r}: {why}; allowed: {key} = {allowed!r}, or sampling = "
            f"{POISSON!r}"
            for key, (value, allowed, why) in needs.items()
            if value != allowed
        ]
        if get_bound(self.algorithm).adaptive:
            errors.append(
                f"'sampling' = {CHECK_IN!r} with 'algorithm' = {self.algorithm!r}: a node that sits out would count as "
                f"an unclipped update in the private count; allowed: algorithm 'clip', 'norm' or 'none', or sampling = "
                f"{POISSON!r}"
            )
        return errors

    def _canary_errors(self) -> list[str]:
        """Where canary clients cannot give a meaningful audit, the reason."""
        m = self.canary_clients
        errors = []
        if self.secure_aggregation:
            errors.append(
                f"'canary-clients' = {m} with 'secure-aggregation' = True: the audit's canaries are clients the "
                "server computes, not SecAgg+ clients, and SecAgg+'s discrete noise on a modular sum is a different "
                "release (its guarantee is the encoding's, privacy/secure-aggregation.md); audit the same run "
                "without secure aggregation, or set canary-clients = 0"
            )
        if self.noise_mechanism != "independent":
            errors.append(
                f"'canary-clients' = {m} with 'noise-mechanism' = {self.noise_mechanism!r}: canaries join the "
                "federation by Poisson sampling with q = r/n, which banded-MF's participation rule replaces; allowed: "
                "noise-mechanism = 'independent', or canary-clients = 0"
            )
        if self.resume:
            errors.append(
                f"'canary-clients' = {m} with 'resume' = True: the all-iterates audit needs every round's release from "
                "round 1, which a resumed process did not see; run it whole, or set canary-clients = 0"
            )
        return errors


#: Every run_config key, in the order of the `RunConfig` fields.
OPTIONS: tuple[Option, ...] = tuple(
    Option(
        key=f.name.replace("_", "-"),
        kind={"int": int, "float": float, "str": str, "bool": bool}[str(f.type).split("|")[0].strip()],
        field_default=f.default,
        **f.metadata["option"],
    )
    for f in fields(RunConfig)
)
_BY_KEY: dict[str, Option] = {opt.key: opt for opt in OPTIONS}


def _unknown_key(key: str) -> str:
    hint = difflib.get_close_matches(key, list(_BY_KEY), n=1)
    return f"unknown key '{key}'" + (f" (did you mean '{hint[0]}'?)" if hint else "")


def _unknown_field(name: str) -> str:
    """``_unknown_key`` for a Python keyword argument: the suggestion in snake_case, as it would be typed."""
    hint = difflib.get_close_matches(name.replace("_", "-"), list(_BY_KEY), n=1)
    return f"unknown key {name!r}" + (f" (did you mean {hint[0].replace('-', '_')!r}?)" if hint else "")


def _check_field_names(names: Mapping[str, Any]) -> None:
    """One ConfigError naming every keyword that is not a field (with a "did you mean"), as the CLI does for keys."""
    unknown = [name for name in names if name.replace("_", "-") not in _BY_KEY or "-" in name]
    if unknown:
        raise ConfigError("invalid run config: " + "; ".join(_unknown_field(name) for name in unknown))


_dataclass_init = RunConfig.__init__


@functools.wraps(_dataclass_init)
def _checked_init(self: RunConfig, *args: Any, **kwargs: Any) -> None:
    # RunConfig(num_round=5) would be a bare TypeError from the generated __init__: name the key instead
    _check_field_names(kwargs)
    _dataclass_init(self, *args, **kwargs)


RunConfig.__init__ = _checked_init  # type: ignore[method-assign]


def _coerce(opt: Option, value: Any) -> tuple[Any, str | None]:
    """``(typed value, None)`` or ``(None, error text)``; the sentinel (or ``None``) of a sentinel key is ``None``."""
    if opt.sentinel is not None and (value is None or value == opt.sentinel):
        return None, None
    kind = opt.kind
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, str)
    if not ok:
        want = opt.allowed or ("true or false" if kind is bool else f"a {kind.__name__}")
        return None, f"'{opt.key}' = {value!r} ({type(value).__name__}): expected {want}"
    if opt.choices is not None and value not in opt.choices:
        allowed = ", ".join(repr(c) for c in opt.choices)
        hint = difflib.get_close_matches(str(value), [str(c) for c in opt.choices], n=1)
        more = f" (did you mean {hint[0]!r}?)" if hint else ""
        return None, f"'{opt.key}' = {value!r}: allowed values are {allowed}{more}"
    if opt.check is not None and not opt.check(value):
        return None, f"'{opt.key}' = {value!r}: expected {opt.allowed}"
    return value, None


_PAIR = re.compile(r"""\s*([A-Za-z0-9_.-]+)\s*=\s*("[^"]*"|'[^']*'|[^\s"']+)\s*""")


def parse_run_config(text: str) -> dict[str, Any]:
    """``"a=1 b='x' c=true"`` -> ``{"a": 1, "b": "x", "c": True}`` (each value parsed as TOML)."""
    out: dict[str, Any] = {}
    pos = 0
    while pos < len(text):
        if not text[pos:].strip():
            break
        match = _PAIR.match(text, pos)
        if match is None:
            raise ValueError(f"cannot parse the run config at {text[pos:]!r}: expected key=value (strings in quotes)")
        key, value = match.groups()
        try:
            out[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError as err:
            raise ValueError(
                f"run config {key}={value}: not a TOML value ({err}); quote strings: {key}='...'"
            ) from None
        pos = match.end()
    return out
