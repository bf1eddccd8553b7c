"""Route the library's ``logging`` through Flower's console handler.

Library modules log with ``logging.getLogger(__name__)``. The Flower apps call
:func:`use_flower_console` once so those records are printed (and streamed by
``flwr run --stream``) in Flower's format, next to Flower's own lines.
"""

from __future__ import annotations

import logging

__all__ = ["use_flower_console"]


def use_flower_console(level: int = logging.INFO) -> logging.Logger:
    """Attach Flower's console handler to the ``dpfedavg`` logger (idempotent)."""
    from flwr.supercore.logger import console_handler

    pkg_logger = logging.getLogger("dpfedavg")
    pkg_logger.setLevel(level)
    if console_handler not in pkg_logger.handlers:
        pkg_logger.addHandler(console_handler)
    pkg_logger.propagate = False
    return pkg_logger
