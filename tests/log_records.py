"""The records the ``dpfedavg`` loggers emit, whatever Flower did to the logging tree (a test helper)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def package_records(level: int = logging.WARNING) -> Iterator[list[logging.LogRecord]]:
    """The ``dpfedavg`` records at ``level`` and up, from a handler on that logger itself.

    ``caplog`` misses them once a Flower app has run in the process (``setup_app_process`` stops their propagation to
    the root logger). The level is set with ``setLevel`` (an earlier test in the same worker may have left ``dpfedavg``
    at WARNING, and a plain ``.level =`` keeps the children's cached level), and the package's loggers are enabled and
    propagate for the block; everything is restored after it.
    """
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = records.append  # type: ignore[method-assign]
    package_logger = logging.getLogger("dpfedavg")
    children = [
        logger
        for name, logger in logging.Logger.manager.loggerDict.items()
        if name.startswith("dpfedavg.") and isinstance(logger, logging.Logger)
    ]
    saved = [(logger, logger.disabled, logger.propagate) for logger in [package_logger, *children]]
    for logger in children:
        logger.disabled, logger.propagate = False, True
    package_logger.disabled = False
    package_logger.addHandler(handler)
    previous = package_logger.level
    if previous == logging.NOTSET or previous > level:
        package_logger.setLevel(level)  # setLevel, not .level =: it clears the loggers' isEnabledFor caches
    try:
        yield records
    finally:
        package_logger.removeHandler(handler)
        package_logger.setLevel(previous)
        for logger, disabled, propagate in saved:
            logger.disabled, logger.propagate = disabled, propagate
