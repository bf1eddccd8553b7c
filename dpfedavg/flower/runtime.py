"""Process set-up for the Flower apps: logging through Flower, single-threaded BLAS.

Library modules log with ``logging.getLogger(__name__)``; `setup_app_process()`
routes those records through Flower's console handler, so they are printed
(and streamed by ``flwr run --stream``) next to Flower's own lines.

It also limits BLAS to one thread. In a Flower simulation the ServerApp
runs in a thread of the process that starts Ray at the same moment; a
multi-threaded OpenBLAS call there (e.g. the quadratic task's ``lstsq``) was
seen to hang forever in about one start in five on the 2-core machine. The
per-client math is small (parallelism comes from the Ray actors), so one BLAS
thread per process costs nothing measurable.
"""

from __future__ import annotations

import logging

from dpfedavg.core.threads import mark_single_threaded, single_threaded

__all__ = ["route_logs_through_flower", "setup_app_process"]


def route_logs_through_flower(level: int | None = None) -> logging.Logger:
    """Idempotent: attach Flower's console handler to ``dpfedavg`` (its records are printed and streamed).

    All that a user's own ServerApp or ClientApp needs (``DPFedAvg`` and ``dp_mod`` call it); unlike
    `setup_app_process()` it leaves the process's BLAS threads alone, and a level the user set on the
    ``dpfedavg`` logger (``level=None``: INFO only if none was set).
    """
    from flwr.supercore.logger import console_handler

    pkg_logger = logging.getLogger("dpfedavg")
    if level is not None or pkg_logger.level == logging.NOTSET:
        pkg_logger.setLevel(logging.INFO if level is None else level)
    if console_handler not in pkg_logger.handlers:
        pkg_logger.addHandler(console_handler)
    pkg_logger.propagate = False
    return pkg_logger


def setup_app_process(level: int = logging.INFO) -> logging.Logger:
    """Idempotent: attach Flower's console handler to ``dpfedavg`` and use 1 BLAS thread."""
    pkg_logger = route_logs_through_flower(level)
    if not single_threaded():
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=1, user_api="blas")
        mark_single_threaded()  # the torch tasks use one CPU thread too (dpfedavg.tasks.torch_task)
    return pkg_logger
