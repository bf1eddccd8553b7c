"""The Flower engine for scripts: one configured run through `flwr run` on a private local SuperLink."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dpfedavg.config import RunConfig
from dpfedavg.deploy.status import run_status
from dpfedavg.engines.local_superlink import LocalSuperLink

__all__ = [
    "SIMULATION_NODES",
    "federation_config",
    "recommended_clients_per_node",
    "run_config_overrides",
    "run_flower",
]

#: The number of simulated SuperNodes the recommended setup aims at: enough messages per round to keep
#: every Ray actor busy, few enough that Flower's in-memory delivery (whose cost grows with nodes x
#: messages, see the benchmarks page) stays a small part of the round.
SIMULATION_NODES = 20


def recommended_clients_per_node(num_clients: int, nodes: int = SIMULATION_NODES) -> int:
    """``clients-per-node`` for a simulation of ``num_clients``: ``ceil(n / nodes)`` (1 up to ``nodes`` clients)."""
    return max(1, -(-num_clients // nodes))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "'" + value.replace("'", "") + "'"
    return repr(value)


def run_config_overrides(cfg: RunConfig) -> str:
    """``cfg`` as the value of ``flwr run --run-config`` (every key, TOML syntax)."""
    return " ".join(f"{key}={_toml_value(value)}" for key, value in cfg.to_run_config().items())


def federation_config(cfg: RunConfig, num_cpus: int = 1) -> str:
    """The ``--federation-config`` of ``cfg``'s simulation: ``ceil(n / clients-per-node)`` SuperNodes."""
    return f"num-supernodes={cfg.num_nodes} client-resources-num-cpus={int(num_cpus)}"


def run_flower(cfg: RunConfig, superlink: LocalSuperLink, *, num_cpus: int = 1, timeout: float = 3600.0) -> Path:
    """Run ``cfg`` with ``flwr run`` (``ceil(n / clients-per-node)`` simulated SuperNodes), return its run directory.

    ``cfg.run_name`` must be set so that the results can be found.

    Raises
    ------
    RuntimeError
        If the run did not finish (no ``final`` record in its ``config.json``: `flwr run` exits 0 even then);
        the first line says why (`dpfedavg.deploy.status.run_status()`), then the end of its log.
    """
    if not cfg.run_name:
        raise ValueError("run_flower needs cfg.run_name to find the run's results")
    run_dir = Path(cfg.output_dir).expanduser().resolve() / cfg.run_name
    result = superlink.flwr_run(
        run_config_overrides(cfg), federation_config(cfg, num_cpus), timeout=timeout, run_dir=run_dir
    )
    config = run_dir / "config.json"
    if not config.exists() or "final" not in json.loads(config.read_text()):
        # `flwr run --stream` exits 0 whatever happened to the run: the `final` record says that it finished
        why = run_status(run_dir).line if run_dir.is_dir() else f"{run_dir} NOT FINISHED: the run made no folder"
        raise RuntimeError(
            f"the run did not finish (flwr run exited {result.returncode}): {why}\n"
            f"the end of flwr run's output:\n{result.stdout[-3000:]}"
        )
    return run_dir
