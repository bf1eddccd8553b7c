"""The keyword settings of `dpfedavg.DPFedAvg` on a user's own Flower app, checked before ``n`` and ``K`` are known.

Which run_config keys apply to a user's app (`APP_KEYS`, `STRATEGY_KEYS`) and why the others do not, the
settings from keywords or from the ``dpfedavg.*`` keys of ``context.run_config`` (`AppSettings`), and the
`dpfedavg.config.RunConfig` they make once ``start()`` knows the SuperNodes and the rounds. No Flower here: the
strategy (`dpfedavg.flower.app_strategy`) reads these.
"""

from __future__ import annotations

import difflib
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from dpfedavg.config import OPTIONS, RunConfig
from dpfedavg.errors import ConfigError

__all__ = ["APP_KEYS", "STRATEGY_KEYS", "AppSettings"]

logger = logging.getLogger(__name__)

#: The run_config keys that apply to a user's own app (kebab-case; keyword arguments are their snake_case).
APP_KEYS: tuple[str, ...] = (
    "algorithm",
    "clip",
    "epsilon",
    "delta",
    "clients-per-round",
    "num-clients",
    "num-rounds",
    "noise-multiplier",
    "accountant",
    "max-epsilon",
    "noise-placement",
    "target-quantile",
    "clip-lr",
    "clip-count-stddev",
    "clip-range-factor",
    "server-lr",
    "server-momentum",
    "seed",
    "secure-noise",
    "diagnostics",
    "node-wait-timeout",
    "round-timeout",
    "secure-aggregation",
    "secagg-quantization-bits",
    "secagg-modulus-bits",
    "secagg-clip-stds",
    "secagg-num-shares",
    "secagg-reconstruction-threshold",
    "secagg-timeout",
)
#: Keys of this strategy only: Flower's name for the sampling rate, and the fail-fast threshold.
STRATEGY_KEYS: dict[str, str] = {
    "fraction-train": "each SuperNode is sampled independently with this probability q (Poisson); r = q n",
    "max-failed-fraction": "stop when more than this fraction of the sampled clients' replies were unusable "
    "over the last 5 rounds (a round where all were unusable stops at once)",
}
_ELSEWHERE = {
    "your ClientApp's train function does the local training": (
        "local-steps",
        "local-lr",
        "lr-decay",
        "local-batch-size",
        "weight-decay",
    ),
    "your app has its own model and data": (
        "task",
        "init",
        "dim",
        "data-dir",
        "cache-dir",
        "data-seed",
        "feature-image-size",
        "backend",
        "device",
        "torch-dtype",
        "torch-compile",
    ),
    "your ServerApp keeps its outputs and evaluation (evaluate_fn)": (
        "output-dir",
        "run-name",
        "checkpoint-every",
        "resume",
        "save-trajectory",
        "eval-every",
    ),
    "each SuperNode is one client here (virtual clients need dpfedavg's own apps)": ("clients-per-node",),
    "random check-ins need dpfedavg's own apps (their ClientApp draws each node's coin)": ("sampling",),
    "canary clients (the run's own privacy audit) need dpfedavg's own apps (their task holds no canary)": (
        "canary-clients",
    ),
    "banded matrix-factorization noise needs dpfedavg's own apps (their server enforces its participation rule)": (
        "noise-mechanism",
        "bands",
        "participation",
        "max-participations",
        "strategy-coefficients",
    ),
}
_NOT_HERE = {key: why for why, keys in _ELSEWHERE.items() for key in keys}
_VALID = (*APP_KEYS, *STRATEGY_KEYS)
#: Defaults that differ from dpfedavg's own apps: the update is already in the weights' units.
_APP_DEFAULTS: dict[str, Any] = {"server-lr": 1.0}
#: Flower's default number of rounds (``Strategy.start``).
_FLOWER_ROUNDS = 3
assert set(_VALID) | set(_NOT_HERE) == {opt.key for opt in OPTIONS} | set(STRATEGY_KEYS)  # every key placed


class AppSettings:
    """The validated keyword settings of your app's `DPFedAvg` (kebab-case keys), before ``n`` and ``K`` are known.

    Parameters
    ----------
    options:
        Keys (kebab-case) -> values, from keyword arguments or from the ``dpfedavg.*`` run_config keys.
    spell:
        How the user wrote a key (``clip_lr`` for a keyword, ``dpfedavg.clip-lr`` for a run_config key), for
        the error messages.

    Raises
    ------
    ConfigError
        Unknown keys (with the closest valid one), keys that do not apply to a user's app (with the reason),
        a missing ``clip`` or sampling rate, values of the wrong type or range: all of them in one error.
    """

    def __init__(self, options: Mapping[str, Any], spell: Callable[[str], str] = lambda key: key) -> None:
        errors = []
        for key in options:
            if key in _NOT_HERE:
                errors.append(f"{spell(key)!r} does not apply to DPFedAvg in your own app: {_NOT_HERE[key]}")
            elif key not in _VALID:
                hint = difflib.get_close_matches(key, _VALID, n=1)
                errors.append(f"unknown key {spell(key)!r}" + (f" (did you mean {spell(hint[0])!r}?)" if hint else ""))
        if "clip" not in options:
            errors.append(
                f"{spell('clip')!r} is required: C bounds each client's update w_k - w_new in the model's units"
            )
        if ("clients-per-round" in options) == ("fraction-train" in options):
            errors.append(
                f"give exactly one of {spell('clients-per-round')!r} (r, the expected cohort) and "
                f"{spell('fraction-train')!r} (q = r/n, each SuperNode's sampling probability)"
            )
        fraction = options.get("fraction-train")
        if "fraction-train" in options and not (
            isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 < fraction <= 1
        ):
            errors.append(f"{spell('fraction-train')!r} = {fraction!r}: expected a fraction in (0, 1]")
        failed = options.get("max-failed-fraction", 0.5)
        if not (isinstance(failed, (int, float)) and not isinstance(failed, bool) and 0 < failed <= 1):
            errors.append(f"{spell('max-failed-fraction')!r} = {failed!r}: expected a fraction in (0, 1]")
        if options.get("server-lr") == "eta":
            errors.append(
                f"{spell('server-lr')!r} = 'eta': the update w_k - w_new is already in the weights' units; "
                "expected a float > 0 (1.0 = FedAvg's step)"
            )
        if errors:
            raise ConfigError("invalid DPFedAvg settings: " + "; ".join(errors))
        self.options = dict(options)
        self.fraction_train: float | None = float(fraction) if fraction is not None else None
        self.max_failed_fraction = float(failed)
        self.num_clients: int | None = options.get("num-clients")
        self.num_rounds: int | None = options.get("num-rounds")
        # the values themselves, checked by the run config with placeholders for what start() will know
        self.config(self.num_clients or self.placeholder_clients(), self.num_rounds or _FLOWER_ROUNDS)

    def placeholder_clients(self) -> int:
        """A stand-in ``n`` for checking the values before `start()` knows the SuperNodes (from ``r``, or 1000)."""
        r = self.options.get("clients-per-round")
        if isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0:
            return max(1, math.ceil(r))
        return 1000

    def config(self, num_clients: int, num_rounds: int) -> RunConfig:
        """The run configuration for ``n`` SuperNodes and ``K`` rounds (``ConfigError`` if it does not hold)."""
        values = {**_APP_DEFAULTS, **{k: v for k, v in self.options.items() if k in APP_KEYS}}
        values["num-clients"], values["num-rounds"] = num_clients, num_rounds
        if self.fraction_train is not None:
            values["clients-per-round"] = self.fraction_train * num_clients
        return RunConfig.from_run_config(values)

    @classmethod
    def from_run_config(
        cls, run_config: Mapping[str, Any], prefix: str = "dpfedavg", overrides: Mapping[str, Any] | None = None
    ) -> AppSettings:
        """The settings from the ``<prefix>.<key>`` entries of ``run_config`` (and keyword ``overrides``).

        Only keys under the prefix are read. A key under the prefix that is not dpfedavg's, or a table whose
        name is a near miss of the prefix, is an error naming the closest valid key; a top-level key named like
        one of dpfedavg's is logged (it is not read).
        """
        options: dict[str, Any] = {}
        errors, stray = [], []
        for key, value in run_config.items():
            head, dot, rest = key.partition(".")
            if dot and head == prefix:
                options[rest] = value
            elif dot and difflib.get_close_matches(head, [prefix], n=1, cutoff=0.75):
                errors.append(f"run config key {key!r}: did you mean '{prefix}.{rest}'?")
            elif not dot and key in _VALID:
                stray.append(key)
        options.update({k.replace("_", "-"): v for k, v in (overrides or {}).items()})
        try:
            settings = AppSettings(options, lambda key: f"{prefix}.{key}")
        except ConfigError as err:
            errors.append(str(err).removeprefix("invalid DPFedAvg settings: "))
        if errors:
            raise ConfigError(
                "invalid DPFedAvg settings: " + "; ".join(errors) + f" (dpfedavg reads the [tool.flwr.app.config."
                f"{prefix}] table of pyproject.toml, i.e. the run config keys '{prefix}.<key>')"
            )
        if stray:
            logger.warning(
                "run config keys %s are not read by dpfedavg: its keys live in the [tool.flwr.app.config.%s] table "
                "(run config keys '%s.<key>'); the app's own keys are left alone",
                ", ".join(repr(k) for k in stray),
                prefix,
                prefix,
            )
        return settings

    def rounds(self, num_rounds: int | None) -> int:
        """``K``: ``start()``'s ``num_rounds``, the settings' ``num-rounds`` (they must agree), or Flower's 3."""
        given = self.num_rounds
        if num_rounds is not None and given is not None and num_rounds != given:
            raise ConfigError(
                f"invalid DPFedAvg settings: start(num_rounds={num_rounds}) differs from num-rounds = {given} given "
                "to the strategy: give the number of rounds once (start's num_rounds is enough)"
            )
        rounds = num_rounds if num_rounds is not None else given if given is not None else _FLOWER_ROUNDS
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ConfigError(f"invalid DPFedAvg settings: num_rounds = {rounds!r}: expected an integer >= 1")
        return rounds
