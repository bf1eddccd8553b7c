"""The errors a user's input or environment can cause, in a module that imports nothing (every layer raises them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

__all__ = ["ConfigError", "ResultsError", "lookup"]

T = TypeVar("T")


class ConfigError(ValueError):
    """A run configuration is invalid. The message names each key, value and what is allowed."""


class ResultsError(OSError):
    """A run's results could not be written (a full disk, say): the run stops, and the message says what is
    on disk and how to resume (`dpfedavg.io.atomic` leaves every file complete)."""


def lookup(registry: Mapping[str, T], value: str, *, key: str, what: str) -> T:
    """``registry[value]``, or one `ConfigError` naming the key, the value and the allowed values.

    Every registry (bounds, noise placements, noise laws, noise mechanisms, accountants) is read through its
    module's one lookup function, which calls this; no other code indexes a registry
    (``tests/test_registries.py`` checks).
    """
    try:
        return registry[value]
    except (KeyError, TypeError):
        allowed = ", ".join(map(repr, registry))
        raise ConfigError(f"unknown {what} {value!r} ('{key}' = {value!r}); allowed: {allowed}") from None
