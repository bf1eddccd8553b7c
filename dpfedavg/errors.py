"""The errors a user's input can cause, in a module that imports nothing, so that every layer can raise them."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A run configuration is invalid. The message names each key, value and what is allowed."""
