"""Run one configuration with the batched engine from a shell: ``python -m dpfedavg.run --run-config "..."``.

``--run-config`` takes the same ``key=value`` pairs as ``flwr run --run-config`` (TOML values:
strings in single quotes), over the defaults of ``pyproject.toml``; it may be given several
times. Prints the run directory (``metrics.csv``, ``config.json``, ``model.npz``). A task from the
current folder works as ``task='mytask:make_task'`` (the folder is on ``sys.path`` under ``-m``).
Imports no Flower (the batched engine does not need it).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import tomllib
import types
from typing import Any

__all__ = ["main", "parse_run_config"]

_PAIR = re.compile(r"""\s*([A-Za-z0-9_.-]+)\s*=\s*("[^"]*"|'[^']*'|[^\s"']+)\s*""")


def parse_run_config(text: str) -> dict[str, Any]:
    """``"a=1 b='x' c=true"`` -> ``{"a": 1, "b": "x", "c": True}`` (each value parsed as TOML)."""
    out: dict[str, Any] = {}
    pos = 0
    while pos < len(text):
        if not text[pos:].strip():
            break
        match = _PAIR.match(text, pos)
        if match is None:
            raise ValueError(f"cannot parse the run config at {text[pos:]!r}: expected key=value (strings in quotes)")
        key, value = match.groups()
        try:
            out[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError as err:
            raise ValueError(
                f"run config {key}={value}: not a TOML value ({err}); quote strings: {key}='...'"
            ) from None
        pos = match.end()
    return out


def main(argv: list[str] | None = None) -> int:
    """Parse ``--run-config``, validate it (one ConfigError, exit 2), run it with the batched engine."""
    from dpfedavg.config import ConfigError, RunConfig
    from dpfedavg.errors import ResultsError
    from dpfedavg.tasks.errors import DataUnavailableError

    parser = argparse.ArgumentParser(prog="python -m dpfedavg.run", description=__doc__.splitlines()[0])
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


class _RunModule(types.ModuleType):
    """This module, callable as ``dpfedavg.run(...)``: importing it binds ``dpfedavg.run`` to the module (Python
    binds a submodule in its package), which would hide the Python API's ``run`` function of the same name."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from dpfedavg.api import run

        return run(*args, **kwargs)


sys.modules[__name__].__class__ = _RunModule

if __name__ == "__main__":
    sys.exit(main())
