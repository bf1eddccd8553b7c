"""Shared type aliases for the core math."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np
import numpy.typing as npt

#: A flat parameter vector ``w in R^d`` (the model is always handled flattened).
Vector = npt.NDArray[np.floating]

#: ``grad_fn(w) -> grad f_i(w)``: a client's full-batch gradient.
GradFn = Callable[[Vector], Vector]

#: ``clip`` = DP-FedAvg (Alg. 1), ``norm`` = DP-NormFedAvg (Alg. 2), ``none`` = FedAvg, no DP.
Algorithm = Literal["clip", "norm", "none"]

ALGORITHMS: tuple[str, ...] = ("clip", "norm", "none")
