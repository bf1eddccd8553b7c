"""The sweeps' adaptive-clip rows: a cell's adaptive twin, and the C_k-beside-the-metric plot.

The adaptive rows use ``clip-count-stddev = "auto"``
(`dpfedavg.core.adaptive_clip.auto_count_stddev()`): Andrew et al. 2021's ``sigma_b = r/20``
needs ``z < r/10``, and the paper's settings have far more noise (synthetic: z = 21.9 at r = 100;
digits: z = 2.7 at r = 20), so the count gets the noise that costs the update 10% more
(``z_u = 1.1 z``), or ``r/20`` when that is larger.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpfedavg.config import CLIP_COUNT_STDDEV_AUTO
from dpfedavg.core.dp import BOUNDS

__all__ = ["ADAPTIVE", "adaptive_values", "clip_curves"]

#: The algorithm of the sweeps' adaptive rows: the registry's adaptive bound.
ADAPTIVE = next(name for name, bound in BOUNDS.items() if bound.adaptive)


def adaptive_values(values: dict[str, Any]) -> dict[str, Any]:
    """A sweep cell's run_config turned into its adaptive-clip twin (``clip`` becomes ``C_0``, ``sigma_b`` auto)."""
    return {**values, "algorithm": ADAPTIVE, "clip-count-stddev": CLIP_COUNT_STDDEV_AUTO}


def clip_curves(run_dirs: Sequence[tuple[Any, Path]]) -> dict[Any, np.ndarray]:
    """key -> the mean over its runs of ``metrics.csv``'s ``clip`` column (C_k), rounds 1..K."""
    by: dict[Any, list[np.ndarray]] = defaultdict(list)
    for key, run_dir in run_dirs:
        with (run_dir / "metrics.csv").open() as fh:
            rows = [r for r in csv.DictReader(fh) if r["round"] != "0"]
        by[key].append(np.array([float(r["clip"]) for r in rows]))
    return {key: np.mean(np.stack(curves), axis=0) for key, curves in by.items()}
