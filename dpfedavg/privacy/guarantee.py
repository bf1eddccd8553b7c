"""What a run's ``(epsilon, delta)`` protects, against whom, and what it does not cover: the text of the policy.

The run records it in ``config.json`` (``privacy``), logs it at start-up and repeats its level in the
final line. Three levels (`guarantee()`): ``dp`` (noise, ``secure-noise = true``, no
diagnostics), ``seeded`` (research mode: whoever knows the seed can regenerate the noise and the
sampling) and ``none`` (no noise, or diagnostics that send clean updates).
"""

from __future__ import annotations

from typing import Any

from dpfedavg.core.adaptive_clip import update_noise_multiplier
from dpfedavg.core.mechanism import NoisePlacement
from dpfedavg.privacy.plan import PrivacyPlan

__all__ = [
    "NON_PRIVATE_TRAIN_COLUMNS",
    "audit_clause",
    "audit_text",
    "describe_adaptive_clipping",
    "describe_privacy",
    "guarantee",
    "released_metric_names",
]

#: Per-round columns computed from un-noised client data (only in seeded mode; see `guarantee()`).
NON_PRIVATE_TRAIN_COLUMNS = ("frac_clipped", "mean_update_norm", "snr")


def released_metric_names(
    metric_names: tuple[str, ...], training_data_metrics: tuple[str, ...], secure_noise: bool
) -> tuple[str, ...]:
    """The task's metrics a run computes: with ``secure-noise`` those from the clients' data are withheld."""
    private = set(training_data_metrics)
    return tuple(m for m in metric_names if not (secure_noise and m in private))


def guarantee(plan: PrivacyPlan, *, diagnostics: bool, secure_noise: bool, seed: int) -> dict[str, str]:
    """What the reported (epsilon, delta) protects, and against whom (``config.json``, start-up log, summary).

    ``level`` is ``"dp"`` only with noise, ``secure-noise = true`` and no ``diagnostics``; ``"seeded"`` means
    the guarantee holds only against someone who does not know ``seed``; ``"none"`` means no guarantee.
    """
    unit = plan.neighbouring.value
    if not plan.dp:
        return {"level": "none", "text": "NONE: the run adds no noise (epsilon is infinite)"}
    if diagnostics:
        return {
            "level": "none",
            "text": "NONE: diagnostics = true sends every client's clean update to the server (research only)",
        }
    if not secure_noise:
        return {
            "level": "seeded",
            "text": (
                f"NONE against anyone who knows seed = {seed} (recorded here): the noise, the sampled clients "
                "and the random iterate can be regenerated from it (seeded research mode). The reported epsilon "
                f"holds only against an observer who does not know the seed; unit: {unit}. "
                "Use secure-noise = true for real users."
            ),
        }
    return {
        "level": "dp",
        "text": (
            f"(epsilon, delta)-DP for one client's whole dataset ({unit}) for everything this run releases "
            "(the models, the random iterate, the test-set metrics); see the privacy page of the documentation "
            "for what each party sees"
        ),
    }


def describe_privacy(
    plan: PrivacyPlan,
    placement: NoisePlacement,
    *,
    diagnostics: bool,
    secure_noise: bool,
    seed: int,
    sigma: float,
    sensitivity: float,
    adaptive_clipping: dict[str, Any] | None = None,
    secure_aggregation: dict[str, Any] | None = None,
    noise_mechanism: str = "independent",
    mechanism_record: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The privacy set-up for ``config.json``.

    ``mechanism_record``: the noise mechanism's numbers under their own key (``banded_mf``: everything needed to
    recompute epsilon without the code).

    ``sigma`` is the std of the noise in each coordinate of the first round's average ``a_k``
    (``z C / r``; with ``adaptive-clip`` ``z C_aug / r = z_u C_0 / r``, changing with ``C_k``) and
    ``sensitivity`` the bound of one client's update (``C``, or ``C_0``).
    """
    return {
        "guarantee": guarantee(plan, diagnostics=diagnostics, secure_noise=secure_noise, seed=seed),
        "dp": plan.dp,
        "noise_multiplier": plan.noise_multiplier,
        "noise_multiplier_calibrated": plan.calibrated,
        "target_epsilon": plan.target_epsilon,
        "delta": plan.delta,
        "q": plan.q,
        "sigma": sigma,
        "accountant": plan.accountant,
        "noise_placement": placement.name,
        "max_epsilon": plan.max_epsilon,
        "nominal_epsilon": plan.nominal_epsilon,
        "privacy_unit": f"one client's whole dataset; neighbours: {placement.adjacency.value}",
        "noise": placement.description,
        "non_private_outputs": (
            "none: per-client norms are not sent and training-data metrics are not computed"
            if secure_noise
            else "metrics.csv columns " + ", ".join(NON_PRIVATE_TRAIN_COLUMNS) + " and the training-data metrics "
            "of the task are computed from un-noised client data (seeded research mode; not covered)"
        ),
        "counts_not_covered": (
            "metrics.csv's num_sampled / num_received / num_failed / num_dropped / num_rejected / skipped "
            "(the server's view of participation; publish the model and epsilon, not metrics.csv)"
            + ("; each sampled client also learns |S_k|" if placement.clients_learn_cohort_size else "")
        ),
        "sensitivity_of_sum": sensitivity,
        "adaptive_clipping": adaptive_clipping,
        "secure_aggregation": secure_aggregation,
        "noise_mechanism": noise_mechanism,
        **(mechanism_record or {}),
    }


def describe_adaptive_clipping(
    plan: PrivacyPlan, *, initial_clip: float, target_quantile: float, clip_lr: float, count_stddev: float
) -> dict[str, Any]:
    """``adaptive-clip``'s noise split (Andrew et al. 2021, Theorem 1) and what each round releases."""
    return {
        "reference": "Andrew, Thakkar, McMahan, Ramaswamy 2021, Differentially private learning with adaptive clipping",
        "initial_clip": initial_clip,
        "target_quantile": target_quantile,
        "clip_lr": clip_lr,
        "count_stddev": count_stddev,
        "update_noise_multiplier": update_noise_multiplier(plan.noise_multiplier, count_stddev) if plan.dp else 0.0,
        "released": (
            "per round: the update sum with N(0, (z_u C_k)^2 I) and T_k = sum_i (1[||u_i|| <= C_k] - 1/2) + "
            "N(0, sigma_b^2); b_k = 1/2 + T_k / r (metrics.csv frac_unclipped), C_{k+1} = C_k exp(-eta_C (b_k - "
            "gamma)); together one Gaussian mechanism with noise multiplier z (sensitivity C_k and 1/2)"
        ),
        "sensitivity_of_sum": "C_k (metrics.csv clip), changing every round",
    }


def audit_text(audit: dict[str, Any]) -> str:
    """The canary audit's numbers in words: each estimate with its band, then the one-run lower bound."""

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3g}"

    def estimate(key: str) -> str:
        band = audit.get(f"{key}_band") or [None, None]
        inside = "" if None in band else f" [{fmt(band[0])}, {fmt(band[1])}]"
        return f"{fmt(audit.get(key))}{inside}"

    return (
        f"estimated epsilon {estimate('epsilon_all_iterates')} (all iterates), {estimate('epsilon_final')} (final "
        f"model), {estimate('epsilon_max_cosine')} (largest one-round cosine), one-run lower bound "
        f"{fmt(audit['epsilon_lower_bound'])} at {audit['confidence']:.0%} confidence"
    )


def audit_clause(audit: dict[str, Any] | None) -> str:
    """The canary audit's part of the last log line ("" without canaries)."""
    if audit is None:
        return ""
    return f"; canary audit ({audit['inserted']} of {audit['canaries']} canaries inserted): {audit_text(audit)}"
