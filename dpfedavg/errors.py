"""The errors a user's input or environment can cause, in a module that imports nothing (every layer raises them)."""

from __future__ import annotations

__all__ = ["ConfigError", "ResultsError"]


class ConfigError(ValueError):
    """A run configuration is invalid. The message names each key, value and what is allowed."""


class ResultsError(OSError):
    """A run's results could not be written (a full disk, say): the run stops, and the message says what is
    on disk and how to resume (`dpfedavg.io.atomic` leaves every file complete)."""
