"""Fail fast instead of training on noise: stop a run whose clients' replies are (almost) all unusable.

A round in which no sampled client's update could be summed still releases the server's top-up noise
(`dpfedavg.core.mechanism`: the sum always carries ``N(0, (zC)^2 I)``) and is still accounted,
so a run whose every reply is rejected, because the ClientApp does not speak dpfedavg's format, for
instance, moves the model by noise alone and reports an epsilon as if it had trained.
`ReplyHealth` watches the rounds' counts and stops such a run:

* at once, in a round in which **every** sampled client's reply was rejected or failed (at least one
  client sampled; clients that did not reply at all are dropouts and do not count);
* after ``window`` rounds, when over the last ``window`` rounds more than ``max_failed_fraction`` of
  the sampled clients' replies were rejected or failed.

The error names the commonest reason and its fix, and what was spent: the rounds that ran stay
accounted (their releases happened). Flower-free; the one round loop (`dpfedavg.server.loop.run_rounds()`,
every engine) and the strategy in a user's own app (`dpfedavg.flower.app_strategy.DPFedAvg`) use it.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from dpfedavg.io.metrics import RoundStats

__all__ = ["FIXES", "ReplyHealth", "TrainingStopped", "fix_for", "stopped"]


class TrainingStopped(RuntimeError):
    """The run stopped because its clients' replies were unusable; the message says why, the fix and the epsilon.

    Attributes
    ----------
    server_round:
        The last round that ran (it is accounted).
    epsilon, delta:
        The privacy spent by the rounds that ran.
    result:
        What the strategy had when it stopped (a Flower ``Result`` for the Flower strategies), or ``None``.
    """

    def __init__(self, message: str, server_round: int, epsilon: float, delta: float) -> None:
        super().__init__(message)
        self.server_round, self.epsilon, self.delta = server_round, epsilon, delta
        self.result: object | None = None


#: The fix for replies without dpfedavg's update: the ClientApp is not wrapped with dp_mod.
_WRAP_WITH_DP_MOD = (
    "is the ClientApp's train wrapped with dp_mod? `from dpfedavg import dp_mod`, then `app = ClientApp(mods=[dp_mod])`"
)

#: ``(text found in the reason, the fix)``, first match wins.
FIXES: tuple[tuple[str, str], ...] = (
    (
        "lacks 'update'",
        _WRAP_WITH_DP_MOD,
    ),
    (
        "lacks the array 'update'",
        _WRAP_WITH_DP_MOD,
    ),
    (
        "expected 1 ('update')",
        _WRAP_WITH_DP_MOD,
    ),
    (
        "refused by this node's policy",
        "the SuperNodes' privacy policy (their --node-config) refuses this run's settings: change the run config to "
        "meet the rule the reason names, or ask the nodes' operators",
    ),
    (
        "refused by the run config",
        "the server's instructions disagree with the run config the clients see: start the ServerApp and the "
        "SuperNodes with the same run config (and dpfedavg version)",
    ),
    (
        "lacks 'arrays'",
        _WRAP_WITH_DP_MOD,
    ),
    (
        "do not have the model's keys",
        "the ClientApp's train must return the model it received, with the same keys and shapes "
        "(e.g. ArrayRecord(model.state_dict()))",
    ),
    (
        "has shape",
        "the ClientApp's train must return the model it received, with the same keys and shapes "
        "(e.g. ArrayRecord(model.state_dict()))",
    ),
    ("diverged", "local training diverged (NaN/Inf): lower the ClientApp's learning rate"),
    (
        "train config lacks",
        "the ClientApp has dp_mod but the ServerApp's strategy is not dpfedavg's DPFedAvg",
    ),
    ("No train function registered", "register the ClientApp's train function with @app.train()"),
)


def stopped(who: str, verdict: str, server_round: int, epsilon: float, delta: float, dp: bool) -> TrainingStopped:
    """The error of a run `ReplyHealth` stopped: why, the fix, and what the rounds that ran spent."""
    spent = f"epsilon = {epsilon:.4g} at delta = {delta:g} spent" if dp else "no differential privacy"
    message = f"{who} stopped: {verdict}. Rounds 1-{server_round} ran and are accounted: {spent}."
    return TrainingStopped(message, server_round, epsilon, delta)


def fix_for(reason: str) -> str:
    """The fix for a rejection or failure reason (`FIXES`), or where to look."""
    for needle, fix in FIXES:
        if needle in reason:
            return fix
    return "see the ClientApps' logs for the error"


def _shape_of(reason: str) -> str:
    """A reason with its node and client ids blanked, so that the same cause counts once per client."""
    return re.sub(r"\b(node|client) \d+", r"\1 #", reason)


@dataclass
class ReplyHealth:
    """Stops a run whose replies are unusable (see the module docstring).

    Parameters
    ----------
    max_failed_fraction:
        Over the last ``window`` rounds, the largest tolerated fraction of sampled clients whose reply was
        rejected or failed (1.0: only the every-reply rule).
    window:
        Rounds the fraction is taken over (the rule starts once that many rounds ran).
    """

    max_failed_fraction: float = 0.5
    window: int = 5

    def __post_init__(self) -> None:
        if not 0 < self.max_failed_fraction <= 1:
            raise ValueError(f"max_failed_fraction = {self.max_failed_fraction!r}: expected a fraction in (0, 1]")
        if self.window < 1:
            raise ValueError(f"window = {self.window!r}: expected an integer >= 1")

    def verdict(self, server_round: int, history: Mapping[int, RoundStats]) -> str | None:
        """Why the run must stop after ``server_round`` (its first sentence), or ``None`` to go on.

        ``history``: the closed rounds' statistics (their rejections' and failures' reasons included).
        """
        stats = history[server_round]
        bad = stats.num_failed + stats.num_rejected
        if stats.num_sampled > 0 and bad >= stats.num_sampled:
            why = f"round {server_round}: every sampled client's reply was unusable"
            return self._describe(why, [server_round], history)
        rounds = [k for k in range(server_round - self.window + 1, server_round + 1) if k in history]
        if len(rounds) < self.window:
            return None
        sampled = sum(history[k].num_sampled for k in rounds)
        bad = sum(history[k].num_failed + history[k].num_rejected for k in rounds)
        if sampled > 0 and bad / sampled > self.max_failed_fraction:
            why = (
                f"rounds {rounds[0]}-{rounds[-1]}: {bad} of {sampled} sampled clients' replies were unusable, "
                f"more than max-failed-fraction = {self.max_failed_fraction:g}"
            )
            return self._describe(why, rounds, history)
        return None

    @staticmethod
    def _describe(why: str, rounds: list[int], history: Mapping[int, RoundStats]) -> str:
        rejected = sum(history[k].num_rejected for k in rounds)
        failed = sum(history[k].num_failed for k in rounds)
        sampled = sum(history[k].num_sampled for k in rounds)
        reasons = [r for k in rounds for r in (*history[k].rejected_reasons, *history[k].failed_reasons)]
        text = f"{why} ({rejected} rejected, {failed} failed of {sampled} sampled)"
        if not reasons:
            return text + "; no reason was reported: see the ClientApps' logs"
        counts = Counter(_shape_of(r) for r in reasons)
        shape, count = counts.most_common(1)[0]
        example = next(r for r in reasons if _shape_of(r) == shape)
        return f"{text}; commonest reason ({count} of {len(reasons)}): {example[:300]}; fix: {fix_for(example)}"
