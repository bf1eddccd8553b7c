"""Optimized banded Toeplitz strategy coefficients from jax-privacy (an optional extra).

``jax_privacy.matrix_factorization.toeplitz.optimize_banded_toeplitz(n, bands, reduction_fn)`` minimizes
the error of the prefix-sum workload times the single-participation sensitivity over b-banded Toeplitz
strategies (McKenna 2024, "Scaling up the amplified banded matrix factorization mechanism for
differentially private ML"; Choquette-Choo et al. 2023, §4). Its coefficients have unit L2 norm; any finite
ones with ``c_0 != 0`` are valid for `dpfedavg.core.banded_mf`, whose sensitivity assumes no normalization.

jax-privacy (with jax, about 400 MB on top of the ``test`` extra) is imported only when these coefficients
are asked for; without it, `optimized_coefficients()` raises one `ImportError` saying how to
install it. Results are cached in memory by ``(K, b, workload)``.
"""

from __future__ import annotations

import logging
from functools import lru_cache

from dpfedavg.core.banded_mf import check_bands, check_coefficients

__all__ = ["JAX_PRIVACY_VERSION", "WORKLOADS", "optimized_coefficients"]

logger = logging.getLogger(__name__)

#: The jax-privacy release these calls were written against.
JAX_PRIVACY_VERSION = "2.0.0"
#: ``workload`` -> the reduction of the per-round squared errors of the prefix sums that is minimized.
WORKLOADS = ("prefix-mean", "prefix-max")


def optimized_coefficients(num_rounds: int, bands: int, workload: str = "prefix-mean") -> tuple[float, ...]:
    """``c_0 .. c_{b-1}`` of the b-banded Toeplitz strategy optimized by jax-privacy for ``K`` rounds.

    Parameters
    ----------
    num_rounds:
        ``K``, the size of the workload.
    bands:
        ``b`` (``1 <= b <= K``).
    workload:
        ``"prefix-mean"``: the mean over rounds of the prefix sums' squared error (jax-privacy's default);
        ``"prefix-max"``: the largest (the last round's, for Toeplitz strategies).

    Raises
    ------
    ImportError
        jax-privacy is not installed.
    ValueError
        A bad ``K``, ``b`` or ``workload``, or coefficients the optimizer returned that are not finite.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"workload = {workload!r}: allowed {', '.join(map(repr, WORKLOADS))}")
    if isinstance(num_rounds, bool) or not isinstance(num_rounds, int) or num_rounds < 1:
        raise ValueError(f"num-rounds = {num_rounds!r}: must be an integer >= 1")
    check_bands(bands, num_rounds)
    return _optimize(num_rounds, bands, workload)


@lru_cache(maxsize=32)
def _optimize(num_rounds: int, bands: int, workload: str) -> tuple[float, ...]:
    try:
        import jax.numpy as jnp
        from jax_privacy.matrix_factorization import toeplitz
    except ImportError as exc:  # one clear message, whatever part is missing
        raise ImportError(
            f"optimized banded strategy coefficients need jax-privacy: pip install jax-privacy=={JAX_PRIVACY_VERSION} "
            f"(or use the default coefficients, dpfedavg.core.banded_mf.sqrt_prefix_coefficients): {exc}"
        ) from exc
    reduction = jnp.mean if workload == "prefix-mean" else jnp.max
    coefs = toeplitz.optimize_banded_toeplitz(n=num_rounds, bands=bands, reduction_fn=reduction)
    result = check_coefficients([float(c) for c in coefs], num_rounds)
    logger.info("jax-privacy banded Toeplitz coefficients for K=%d, b=%d, %s: %s", num_rounds, bands, workload, result)
    return result
