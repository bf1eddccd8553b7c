"""The sweeps' adaptive-clip rows: how ``sigma_b`` is chosen, and the C_k-beside-the-metric plot.

Andrew et al. 2021's default ``sigma_b = r/20`` needs ``z < r/10``; the paper's settings have far more
noise (synthetic: z = 21.9 at r = 100; digits: z = 2.7 at r = 20), where ``r/20`` is not allowed
(``sigma_b > z/2``). The sweeps therefore give the count the noise that costs the update
:data:`COUNT_NOISE_INFLATION` more noise (``z_u = 1.1 z``), or ``r/20`` when that is larger.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpfedavg.core.adaptive_clip import count_stddev_for_inflation, default_count_stddev
from dpfedavg.core.dp import BOUNDS

__all__ = ["ADAPTIVE", "COUNT_NOISE_INFLATION", "adaptive_values", "clip_curves", "sweep_count_stddev"]

#: The algorithm of the sweeps' adaptive rows: the registry's adaptive bound.
ADAPTIVE = next(name for name, bound in BOUNDS.items() if bound.adaptive)
#: The sweeps' noise split: the update's noise multiplier is z_u = 1.1 z.
COUNT_NOISE_INFLATION = 1.1


def sweep_count_stddev(noise_multiplier: float, clients_per_round: float) -> float:
    """The sweeps' ``sigma_b``: ``max(r/20, the sigma_b with z_u = 1.1 z)``."""
    sigma_b = default_count_stddev(clients_per_round)
    if noise_multiplier > 0:
        sigma_b = max(sigma_b, count_stddev_for_inflation(noise_multiplier, COUNT_NOISE_INFLATION))
    return float(sigma_b)


def adaptive_values(values: dict[str, Any]) -> dict[str, Any]:
    """A sweep cell's run_config turned into its adaptive-clip twin (``clip`` becomes ``C_0``).

    ``clip-count-stddev = max(r/20, sigma_b(z_u = 1.1 z))``, ``z`` calibrated for the cell's
    ``(epsilon, delta)`` as the run will (the calibration is cached).
    """
    from dpfedavg.config import RunConfig
    from dpfedavg.privacy.calibration import calibrate_noise_multiplier

    cfg = RunConfig.from_run_config({**values, "algorithm": ADAPTIVE})
    if cfg.epsilon > 0:
        z = calibrate_noise_multiplier(cfg.epsilon, cfg.delta, cfg.sampling_rate, cfg.num_rounds, cfg.accountant)
    else:
        z = cfg.noise_multiplier or 0.0
    return {**values, "algorithm": ADAPTIVE, "clip-count-stddev": sweep_count_stddev(z, cfg.clients_per_round)}


def clip_curves(run_dirs: Sequence[tuple[Any, Path]]) -> dict[Any, np.ndarray]:
    """key -> the mean over its runs of ``metrics.csv``'s ``clip`` column (C_k), rounds 1..K."""
    by: dict[Any, list[np.ndarray]] = defaultdict(list)
    for key, run_dir in run_dirs:
        with (run_dir / "metrics.csv").open() as fh:
            rows = [r for r in csv.DictReader(fh) if r["round"] != "0"]
        by[key].append(np.array([float(r["clip"]) for r in rows]))
    return {key: np.mean(np.stack(curves), axis=0) for key, curves in by.items()}
