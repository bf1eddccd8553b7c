"""Errors of the tasks' data loading, in a module of their own so that loaders and extractors share them."""

from __future__ import annotations

__all__ = ["DataUnavailableError"]


class DataUnavailableError(RuntimeError):
    """A dataset (or the feature extractor's weights) could not be found or downloaded."""
