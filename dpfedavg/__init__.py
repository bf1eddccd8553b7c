"""dpfedavg: DP-FedAvg (clipping) and DP-NormFedAvg (normalization) with user-level differential privacy, on Flower.

Das, Hashemi, Sanghavi, Dhillon, "On the Convergence of Differentially Private Federated Learning on
Non-Lipschitz Objectives, and with Normalized Client Updates". The public API:

* `RunConfig` (every key, validated) and `ConfigError`;
* `run()` (train with the batched engine) and its `RunResult` (``result.load_into(module)`` puts the
  model into your ``nn.Module``); ``load_run(path)`` loads a finished run's folder back;
* `Task` (what a task provides), `TorchTask` and `ArrayClients` (any ``torch.nn.Module``
  with your data);
* `DPFedAvg` (the Flower strategy: dpfedavg's own apps, or keywords only in *your* ServerApp) with
  `dp_mod()` (the mod for *your* ClientApp's train; under SecAgg+ inside `checked_secaggplus_mod()`, Flower's
  ``secaggplus_mod`` behind the node's checks) and `TrainingStopped` (unusable replies stopped
  the run), and `InProcessGrid` (a Flower Grid in this process, to test a strategy in isolation);
* `calibrate_noise_multiplier()` and `epsilon_for()` (the accountant, for planning).

Names other than `RunConfig` and `ConfigError` are imported on first use, so ``import dpfedavg``
loads neither Flower nor torch.
"""

from __future__ import annotations

import importlib
from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

from dpfedavg.config import ConfigError, RunConfig

try:  # the version lives in one place, pyproject.toml ([project] version, which Flower's app format needs there)
    __version__ = _metadata.version("dpfedavg")
except _metadata.PackageNotFoundError:  # imported from a source folder that was never installed
    __version__ = "0+unknown"

#: Public name -> the module that defines it (imported on first access).
_LAZY: dict[str, str] = {
    "run": "dpfedavg.api",
    "load_run": "dpfedavg.api",
    "RunResult": "dpfedavg.io.results",
    "Task": "dpfedavg.tasks.base",
    "TorchTask": "dpfedavg.tasks.torch_task",
    "ArrayClients": "dpfedavg.tasks.torch_task",
    "DPFedAvg": "dpfedavg.flower.app_strategy",
    "dp_mod": "dpfedavg.flower.mod",
    "checked_secaggplus_mod": "dpfedavg.flower.mod",
    "TrainingStopped": "dpfedavg.server.health",
    "InProcessGrid": "dpfedavg.flower.testing",
    "calibrate_noise_multiplier": "dpfedavg.privacy.calibration",
    "epsilon_for": "dpfedavg.privacy.calibration",
}

__all__ = [
    "ArrayClients",
    "ConfigError",
    "DPFedAvg",
    "InProcessGrid",
    "RunConfig",
    "RunResult",
    "Task",
    "TorchTask",
    "TrainingStopped",
    "__version__",
    "calibrate_noise_multiplier",
    "checked_secaggplus_mod",
    "dp_mod",
    "epsilon_for",
    "load_run",
    "run",
]

if TYPE_CHECKING:
    from dpfedavg.api import load_run, run
    from dpfedavg.flower.app_strategy import DPFedAvg
    from dpfedavg.flower.mod import checked_secaggplus_mod, dp_mod
    from dpfedavg.flower.testing import InProcessGrid
    from dpfedavg.privacy.calibration import calibrate_noise_multiplier, epsilon_for
    from dpfedavg.server.health import TrainingStopped
    from dpfedavg.io.results import RunResult
    from dpfedavg.tasks.base import Task
    from dpfedavg.tasks.torch_task import ArrayClients, TorchTask


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dpfedavg' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
