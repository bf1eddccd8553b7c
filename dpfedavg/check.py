"""Check a run's configuration before anything starts: ``python -m dpfedavg.check [APP] --run-config "..."``.

It takes the arguments of the ``flwr run`` line it checks (``--stream`` is accepted and ignored), so a line is
checked by changing its first words: ``flwr run . --stream --federation-config "..." --run-config "..."`` becomes
``python -m dpfedavg.check . --federation-config "..." --run-config "..."``. In well under a second, without
Flower, Ray or the task's data, it validates

* the run config: the defaults of ``APP/pyproject.toml``'s ``[tool.flwr.app.config]`` (dpfedavg's own when no APP
  is given), then each ``--run-config`` (``key=value`` pairs, or one ``.toml`` file, as for ``flwr run``): every
  key, its type, its range and the combinations (`dpfedavg.config.RunConfig.from_run_config()`), and that ``task``
  names a task (`dpfedavg.tasks.resolve_task()`; a user's ``module:factory`` is imported, nothing more);
* the federation: ``num-supernodes`` (from ``--federation-config`` or ``--num-supernodes``) against
  ``ceil(num-clients / clients-per-node)``, and ``client-resources-num-cpus`` a whole number (Flower's Ray backend
  takes no fraction of a CPU);
* with ``--plan``, the privacy plan too: ``z`` calibrated for the target, the budget checked (this takes a second
  or more: the accountant runs);
* with ``--build-task``, the task too: built as the server builds it (`dpfedavg.tasks.build_task()`: the data are
  loaded and a torch model runs one forward pass, `dpfedavg.tasks.torch_task.TorchTask.check_model()`), which
  takes as long as that does.

A mistake prints one line, ``error: ...``, naming every bad key, its value and what is allowed, and exits 2; a
good configuration prints one line that summarizes it and exits 0.
"""

from __future__ import annotations

import argparse
import math
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dpfedavg.config import parse_run_config
from dpfedavg.errors import ConfigError
from dpfedavg.tasks.errors import DataUnavailableError

__all__ = ["check", "check_federation", "main", "read_app_config", "read_config_args"]

#: The exit status of a configuration that does not validate (as ``python -m dpfedavg``'s).
EXIT_INVALID = 2


def read_app_config(app: str | Path) -> dict[str, Any]:
    """The ``[tool.flwr.app.config]`` table of ``app``'s ``pyproject.toml`` (``app``: a folder or the file).

    Raises
    ------
    ConfigError
        No such file, TOML that does not parse, or no ``[tool.flwr.app.config]`` table.
    """
    path = Path(app).expanduser()
    path = path / "pyproject.toml" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"app {str(app)!r}: no {path} (expected a Flower app's folder, as for flwr run)")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"app {str(app)!r}: {path} is not valid TOML: {err}") from None
    table = data.get("tool", {}).get("flwr", {}).get("app", {}).get("config")
    if not isinstance(table, dict):
        raise ConfigError(f"app {str(app)!r}: {path} has no [tool.flwr.app.config] table")
    return table


def read_config_args(texts: list[str]) -> dict[str, Any]:
    """``--run-config`` / ``--federation-config`` values as ``flwr run`` reads them: ``key=value`` pairs (TOML
    values), or one ``.toml`` file whose tables become dotted keys."""
    if len(texts) == 1 and texts[0].endswith(".toml"):
        path = Path(texts[0]).expanduser()
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise ConfigError(f"config file {texts[0]!r}: {err}") from None
        return _flatten(data)
    out: dict[str, Any] = {}
    for text in texts:
        if text.endswith(".toml"):
            raise ConfigError(f"{text!r}: a .toml file cannot be passed alongside key=value pairs (as for flwr run)")
        out.update(parse_run_config(text))
    return out


def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        out.update(_flatten(value, f"{name}.") if isinstance(value, Mapping) else {name: value})
    return out


def check_federation(federation: Mapping[str, Any], num_nodes: int, num_clients: int, clients_per_node: int) -> None:
    """The simulated federation ``flwr run`` would start can host the run: one `ConfigError` naming each problem.

    ``num-supernodes`` must be ``num_nodes = ceil(num-clients / clients-per-node)`` (the ServerApp otherwise stops
    once the SuperNodes have started); ``client-resources-num-cpus`` a whole number >= 1 (Flower's Ray backend
    stops with "'float' object cannot be interpreted as an integer"); ``client-resources-num-gpus`` a number >= 0.
    Other keys are Flower's, left to it.
    """
    errors = []
    nodes = federation.get("num-supernodes")
    if nodes is not None:
        if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
            errors.append(f"'num-supernodes' = {nodes!r}: expected an integer >= 1")
        elif nodes != num_nodes:
            how = (
                "one SuperNode per client (num-clients)"
                if clients_per_node == 1
                else f"ceil(num-clients / clients-per-node) = ceil({num_clients} / {clients_per_node}) SuperNodes"
            )
            errors.append(
                f"'num-supernodes' = {nodes} but 'num-clients' = {num_clients} with 'clients-per-node' = "
                f"{clients_per_node} needs {how}: allowed: num-supernodes={num_nodes}"
            )
    cpus = federation.get("client-resources-num-cpus")
    if cpus is not None and (not isinstance(cpus, int) or isinstance(cpus, bool) or cpus < 1):
        errors.append(
            f"'client-resources-num-cpus' = {cpus!r}: expected a whole number >= 1 (Flower's Ray backend takes no "
            "fraction of a CPU and fails with \"'float' object cannot be interpreted as an integer\"); for more "
            "clients per CPU use clients-per-node in the run config"
        )
    gpus = federation.get("client-resources-num-gpus")
    ok_gpus = isinstance(gpus, (int, float)) and not isinstance(gpus, bool) and math.isfinite(gpus) and gpus >= 0
    if gpus is not None and not ok_gpus:
        errors.append(f"'client-resources-num-gpus' = {gpus!r}: expected a number >= 0 (a fraction shares a GPU)")
    if errors:
        raise ConfigError("invalid federation config: " + "; ".join(errors))


def check(
    run_config: Mapping[str, Any],
    *,
    app_config: Mapping[str, Any] | None = None,
    federation: Mapping[str, Any] | None = None,
    plan: bool = False,
    build: bool = False,
) -> str:
    """Validate a run as ``flwr run`` would start it; returns a one-line summary, raises one `ConfigError`.

    ``app_config``: the app's ``[tool.flwr.app.config]`` (`read_app_config()`), overridden by ``run_config``;
    ``federation``: the ``--federation-config`` keys; ``plan``: also calibrate ``z`` and check the budget;
    ``build``: also build the task (its data, a torch model's first forward pass).
    """
    from dpfedavg.config import RunConfig
    from dpfedavg.tasks import resolve_task

    cfg = RunConfig.from_run_config({**(app_config or {}), **run_config})
    resolve_task(cfg.task)
    if federation:
        check_federation(federation, cfg.num_nodes, cfg.num_clients, cfg.clients_per_node)
    summary = (
        f"ok: task {cfg.task!r}, algorithm {cfg.algorithm!r}, {cfg.num_clients} clients on {cfg.num_nodes} "
        f"SuperNodes, r = {cfg.clients_per_round:g} per round, K = {cfg.num_rounds} rounds"
    )
    if build:
        from dpfedavg.tasks import build_task

        summary += f", task built (dim {build_task(cfg).dim})"
    if plan:
        from dpfedavg.server.run import plan_for

        found = plan_for(cfg)
        epsilon = f"({found.nominal_epsilon:.4g}, {found.delta:g})"
        summary += f", z = {found.noise_multiplier:.4g}, (epsilon, delta) = {epsilon}"
    elif cfg.epsilon > 0:
        summary += f", target (epsilon, delta) = ({cfg.epsilon:g}, {cfg.delta:g})"
    return summary


def main(argv: list[str] | None = None) -> int:
    """Parse the flwr-run-like arguments, `check()` them, print one line; 0 if valid, 2 if not."""
    parser = argparse.ArgumentParser(prog="python -m dpfedavg.check", description=__doc__.splitlines()[0])
    parser.add_argument("app", nargs="?", default=None, help="the app folder whose pyproject.toml gives the defaults")
    parser.add_argument("--run-config", action="append", default=[], help="key=value pairs, as for flwr run")
    parser.add_argument("--federation-config", action="append", default=[], help="as for flwr run")
    parser.add_argument("--num-supernodes", type=int, default=None, help="the federation's size (num-supernodes)")
    parser.add_argument("--plan", action="store_true", help="also calibrate the noise and check the budget (slower)")
    parser.add_argument("--build-task", action="store_true", help="also build the task: its data, the model's check")
    parser.add_argument("--stream", action="store_true", help="accepted and ignored, as on the flwr run line")
    args = parser.parse_args(argv)
    try:
        overrides = read_config_args(args.run_config)
        federation = read_config_args(args.federation_config)
        if args.num_supernodes is not None:
            federation["num-supernodes"] = args.num_supernodes
        app_config = read_app_config(args.app) if args.app is not None else None
        print(check(overrides, app_config=app_config, federation=federation, plan=args.plan, build=args.build_task))
    except (ConfigError, ValueError, DataUnavailableError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INVALID
    return 0


if __name__ == "__main__":
    sys.exit(main())
