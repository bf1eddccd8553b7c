"""``audit.png`` and ``audit.npz``: a canary-audited run's scores (``canary-clients > 0``).

The plot shows, for each of the three scores (the all-iterates likelihood ratio, the final model's cosine, the largest
one-round cosine), the histograms of the inserted canaries' and the null canaries' scores with the Gaussians fitted
to them, and the epsilons: the accountant's, Andrew et al.'s estimate, Steinke et al.'s one-run lower bound
(``dpfedavg.privacy.canary``).
"""

from __future__ import annotations

import io
import logging
import math
from pathlib import Path

import numpy as np

from dpfedavg.io.atomic import atomic_write_bytes
from dpfedavg.privacy.canary import CanaryAudit, GaussianFit

__all__ = ["write_audit_plot", "write_audit_scores"]

logger = logging.getLogger(__name__)


def write_audit_scores(directory: Path, audit: CanaryAudit) -> Path:
    """``audit.npz``: ``final``, ``all_iterates``, ``max_cosine`` (each canary's scores) and ``inserted`` (bool), for
    re-analysis."""
    buf = io.BytesIO()
    np.savez(
        buf,
        final=audit.final_scores,
        all_iterates=audit.all_iterates_scores,
        max_cosine=audit.max_cosine_scores,
        inserted=audit.inserted_mask,
    )
    path = Path(directory) / "audit.npz"
    atomic_write_bytes(path, buf.getvalue())
    return path


def write_audit_plot(directory: Path, audit: CanaryAudit, accountant_epsilon: float) -> Path | None:
    """``audit.png`` in ``directory``; ``None`` (and a log line) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("audit.png not written: matplotlib is not installed (pip install matplotlib)")
        return None
    mask = audit.inserted_mask
    panels = [
        (
            "all iterates: log-likelihood ratio",
            "sum_k log(1 - q + q exp(mu z_jk - mu^2/2))",
            audit.all_iterates_scores,
            audit.epsilon_all_iterates,
            audit.all_iterates_band,
        ),
        ("final model", "cos(c_j, w_0 - w_K)", audit.final_scores, audit.epsilon_final, audit.final_band),
        (
            "largest one-round cosine",
            "max_k cos(c_j, w_{k-1} - w_k)",
            audit.max_cosine_scores,
            audit.epsilon_max_cosine,
            audit.max_cosine_band,
        ),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8), constrained_layout=True)
    for ax, (title, xlabel, scores, estimate, band) in zip(axes, panels, strict=True):
        finite = scores[np.isfinite(scores)]
        bins = np.linspace(finite.min(), finite.max(), 30) if finite.size and np.ptp(finite) > 0 else 10
        for label, part, color in (
            ("null (not inserted)", scores[~mask], "tab:gray"),
            ("canary", scores[mask], "tab:red"),
        ):
            part = part[np.isfinite(part)]
            if part.size == 0:
                continue
            ax.hist(part, bins=bins, density=True, alpha=0.45, color=color, label=f"{label}: {part.size}")
            if part.size >= 2:
                fit = GaussianFit.of(part)
                if fit.std > 0:
                    x = np.linspace(fit.mean - 4 * fit.std, fit.mean + 4 * fit.std, 200)
                    pdf = np.exp(-0.5 * ((x - fit.mean) / fit.std) ** 2) / (fit.std * math.sqrt(2 * math.pi))
                    ax.plot(x, pdf, color=color)
        est = "n/a" if math.isnan(estimate) else f"{estimate:.3g}"
        if not math.isnan(estimate) and not any(math.isnan(x) for x in band):
            est += f" [{band[0]:.3g}, {band[1]:.3g}] at {audit.confidence:.0%}"
        ax.set_title(f"{title}\nestimated epsilon {est}", fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"accountant epsilon {accountant_epsilon:.3g} (delta = {audit.delta:g}); one-run lower bound "
        f"{audit.epsilon_lower_bound:.3g} at {audit.confidence:.0%} confidence",
        fontsize=10,
    )
    path = Path(directory) / "audit.png"
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path
