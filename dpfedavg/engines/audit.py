"""Finishing a canary-audited run: the empirical epsilons beside the accountant's, in ``config.json``, the last
log line, ``RunResult.audit``, ``audit.png`` and ``audit.npz`` (``dpfedavg.privacy.canary``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dpfedavg.core.types import Vector
from dpfedavg.io.audit_plot import write_audit_plot, write_audit_scores
from dpfedavg.privacy.canary import CanaryAudit, CanaryScores, CanarySet

if TYPE_CHECKING:
    from dpfedavg.server.round import RoundRecord
    from dpfedavg.io.results import RunResult
    from dpfedavg.server.session import RunSession

__all__ = ["AuditedSession", "canary_scores", "finish_audited", "log_interim_audit"]

logger = logging.getLogger(__name__)


def canary_scores(session: RunSession, canaries: CanarySet, w0: Vector) -> CanaryScores:
    """The run's running canary scores, their all-iterates likelihood ratio at the run's ``q`` and the noise
    multiplier of the updates (``z``; with ``adaptive-clip`` the update's ``z_u``, the count's share taken out)."""
    server = session.server
    z = server.adaptive.update_noise_multiplier if server.adaptive is not None else server.plan.noise_multiplier
    return CanaryScores(canaries, w0, sampling_rate=session.cfg.sampling_rate, noise_multiplier=z)


def finish_audited(
    session: RunSession, scores: CanaryScores, w_final: Vector, stopped_before_round: int | None, **finish: Any
) -> RunResult:
    """Audit the run from its canaries' scores, then ``RunSession.finish`` with the audit recorded.

    ``config.json`` ``final.audit`` holds the estimates, the accountant's epsilon and how the canaries changed the
    federation (``n``, the inserted canaries, ``n'``, ``q`` and the expected cohort ``r' = q n'``). ``finish``: more
    keywords of ``RunSession.finish`` (the Flower engine's ``failed``).
    """
    server, cfg = session.server, session.cfg
    federation = server.setup.federation
    audit = CanaryAudit.of(scores, delta=server.plan.delta)
    epsilon = server.epsilon
    session.audit = {
        **audit.summary(),
        "epsilon_accountant": epsilon,
        "num_clients": federation.num_clients,
        "federation_clients": federation.sampled_clients,
        "q": cfg.sampling_rate,
        "expected_cohort": federation.sampled_cohort,
        "rounds_observed": scores.rounds,
    }
    result = session.finish(w_final, stopped_before_round=stopped_before_round, **finish)
    try:
        write_audit_scores(result.directory, audit)
        write_audit_plot(result.directory, audit, epsilon)
    except Exception as err:  # noqa: BLE001 - a plot must never fail a finished run
        logger.warning("audit.png / audit.npz not written (%s: %s)", type(err).__name__, err)
    return result


def log_interim_audit(session: RunSession, scores: CanaryScores, server_round: int) -> None:
    """Every ``checkpoint-every`` rounds (before the last), one log line with the audit of the rounds so far.

    Cheap (the canaries' scores are kept round by round; the estimates are a few root findings); the accountant's
    epsilon is not recomputed here (the batched engine computes it at the end).
    """
    every = session.checkpoint_every
    if not every or server_round % every or server_round >= session.cfg.num_rounds:
        return
    audit = CanaryAudit.of(scores, delta=session.server.plan.delta)
    from dpfedavg.privacy.guarantee import audit_text

    logger.info("Round %d: canary audit so far: %s", server_round, audit_text(audit.summary()))


class AuditedSession:
    """A run's recording with the canary audit around it (every engine's: `dpfedavg.engines.batched.recording()`).

    Each closed round's model is scored (`CanaryScores.observe`), the session records the round, the interim
    audit is logged every ``checkpoint-every`` rounds (`log_interim_audit()`), and `finish()` audits the run
    before the session finishes it (`finish_audited()`).
    """

    def __init__(self, session: RunSession, canaries: CanarySet, w0: Vector) -> None:
        self.session = session
        self.scores = canary_scores(session, canaries, w0)

    def end_round(self, record: RoundRecord) -> dict[str, float]:
        self.scores.observe(record.w)
        metrics = self.session.end_round(record)
        log_interim_audit(self.session, self.scores, record.round)
        return metrics

    def finish(self, w_final: Vector, stopped_before_round: int | None = None, **finish: Any) -> RunResult:
        return finish_audited(self.session, self.scores, w_final, stopped_before_round, **finish)
