"""Run one configuration with the batched engine from a shell: ``python -m dpfedavg --run-config "..."``.

``--run-config`` takes the same ``key=value`` pairs as ``flwr run --run-config`` (TOML values:
strings in single quotes), over the defaults of ``pyproject.toml``; it may be given several
times. Prints the run directory (``metrics.csv``, ``config.json``, ``model.npz``). A task from the
current folder works as ``task='mytask:make_task'`` (the folder is on ``sys.path`` under ``-m``).
Imports no Flower (the batched engine does not need it).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Parse ``--run-config``, validate it (one ConfigError, exit 2), run it with the batched engine."""
    from dpfedavg.config import ConfigError, RunConfig, parse_run_config
    from dpfedavg.errors import ResultsError
    from dpfedavg.tasks.errors import DataUnavailableError

    parser = argparse.ArgumentParser(prog="python -m dpfedavg", description=__doc__.splitlines()[0])
    parser.add_argument("--run-config", action="append", default=[], help="key=value pairs, as for flwr run")
    parser.add_argument("--progress", action="store_true", help="show a progress bar over the rounds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        overrides: dict[str, Any] = {}
        for text in args.run_config:
            overrides.update(parse_run_config(text))
        cfg = RunConfig.from_run_config(overrides)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from dpfedavg.engines.batched import run_batched

    try:
        run_dir = run_batched(cfg, progress=args.progress).directory
    except (ConfigError, DataUnavailableError) as err:  # found when the task is built (its data, device or size)
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ResultsError as err:  # a full disk: every file is complete, the message says how to resume
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(run_dir)
    return 0



if __name__ == "__main__":
    sys.exit(main())
