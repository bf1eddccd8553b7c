"""The run_config key declaration (:class:`Option`) and :class:`ConfigError`, shared by the config and the tasks.

A module of its own, importing nothing from ``dpfedavg``, so that a task module can declare its
own keys (an ``OPTIONS`` tuple beside the task, collected by :func:`dpfedavg.tasks.task_options`)
while :mod:`dpfedavg.config` asks the task registry for them without an import cycle.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ConfigError", "Option", "non_negative", "positive"]


class ConfigError(ValueError):
    """A run configuration is invalid. The message names each key, value and what is allowed."""


@dataclass(frozen=True)
class Option:
    """One run_config key: its type, paper symbol and allowed values; its default is the ``RunConfig`` field's."""

    key: str
    kind: type
    symbol: str
    help: str
    allowed: str = ""
    check: Callable[[Any], bool] | None = None
    choices: tuple[Any, ...] | None = None
    #: A string accepted instead of a number; it becomes ``None`` in the dataclass.
    sentinel: str | None = None
    #: Defines the trajectory: a resumed run may not change it (see :mod:`dpfedavg.io.checkpoint`).
    trajectory: bool = False
    #: The privacy guarantee depends on it: a resumed run may not change it, and ``config.json`` records it
    #: with the guarantee (see :func:`dpfedavg.io.checkpoint.privacy_signature`).
    privacy: bool = False

    @property
    def attr(self) -> str:
        """The dataclass field name (snake_case)."""
        return self.key.replace("-", "_")

    @property
    def default(self) -> Any:
        """The default as a run_config value (the sentinel for ``None``), from the ``RunConfig`` field."""
        from dpfedavg.config import _FIELD_DEFAULTS  # the defaults are declared once, on RunConfig

        value = _FIELD_DEFAULTS[self.attr]
        return self.sentinel if (value is None and self.sentinel is not None) else value


def positive(x: float) -> bool:
    """A finite number > 0."""
    return math.isfinite(x) and x > 0


def non_negative(x: float) -> bool:
    """A finite number >= 0."""
    return math.isfinite(x) and x >= 0
