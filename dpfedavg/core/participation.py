"""Participation rules for banded matrix-factorization noise: who may take part in round ``k``.

The banded mechanism's guarantee (`dpfedavg.core.banded_mf.minsep_sensitivity()`) needs only a rule
the server can enforce: a client takes part at most once every ``b`` rounds and at most ``k`` times in
all (Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization", §3: b-min-sep participation).
Which clients show up, and when, does not matter. Three schemes (`Participation`):

``cyclic``
    The ``n`` clients are split into ``b`` fixed groups, client ``i`` in group ``i mod b``; round ``k``
    asks group ``k mod b``. Every client is ``b`` rounds apart from itself, at most ``ceil(K / b)`` times.
``min-separation``
    Any client whose last participation was at least ``b`` rounds ago and that has taken part fewer than
    ``k`` times is eligible; the server takes the eligible clients that are connected (participation decided
    by the clients' availability, not by a secret coin, as in Kairouz et al. 2021, "Practical and private
    (deep) learning without sampling or shuffling"). No amplification is claimed.
``cyclic-poisson``
    Round ``k``'s group as in ``cyclic``, then each of its clients independently with probability ``p``
    (Choquette-Choo et al. 2023, §5, Algorithm 2: cyclic Poisson sampling). A client's group depends on its
    id only, so adding or removing one client moves no other (the add/remove-compatible partition; jax-privacy
    calls it ``PartitionType.INDEPENDENT``).

A `ParticipationTracker` is the server's gate: it selects a round's cohort by the scheme, refuses
any cohort that breaks the rule, and carries the rounds' cohorts in its ``state_dict``: the per-client
counts and last rounds are derived from them (replayed through the gate on load), never stored.
`check_schedule()` checks a whole recorded schedule, independently of how it was produced.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from dpfedavg.core.mechanism import Neighbouring
from dpfedavg.core.server import poisson_sample

__all__ = [
    "Participation",
    "ParticipationError",
    "ParticipationRule",
    "ParticipationTracker",
    "check_schedule",
]

logger = logging.getLogger(__name__)


class Participation(StrEnum):
    """The ``participation`` key's values."""

    CYCLIC = "cyclic"
    MIN_SEPARATION = "min-separation"
    CYCLIC_POISSON = "cyclic-poisson"


class ParticipationError(ValueError):
    """A cohort or schedule breaks the (k, b)-participation rule the guarantee rests on."""


def _int_at_least(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least:
        raise ValueError(f"{name} = {value!r}: must be an integer >= {least}")
    return int(value)


@dataclass(frozen=True)
class ParticipationRule:
    """The (k, b)-participation rule of a run and the scheme that realizes it.

    Attributes
    ----------
    scheme:
        `Participation` (or its string value).
    num_clients:
        ``n``.
    bands:
        ``b``: the minimum separation between two participations of a client (the bands of ``C``).
    num_rounds:
        ``K``.
    max_participations:
        ``k``; ``None`` means ``ceil(K / b)``, the most a separation of ``b`` allows. ``cyclic`` and
        ``cyclic-poisson`` ask group 0 ``ceil(K / b)`` times, so they refuse a smaller ``k``.
    sampling_probability:
        ``p``, ``cyclic-poisson`` only (1 otherwise).
    min_group_size:
        The fewest clients a cyclic group may hold (2 with secure aggregation, which cannot sum fewer).
    max_cohort:
        ``min-separation`` only: ask at most this many eligible clients per round, those that waited longest
        first. A cap couples clients (a client's presence can take the slot another would have had), so a
        capped run is private under zero-out adjacency only (`adjacency`).
    """

    scheme: Participation
    num_clients: int
    bands: int
    num_rounds: int
    max_participations: int | None = None
    sampling_probability: float = 1.0
    min_group_size: int = 1
    max_cohort: int | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "scheme", Participation(self.scheme))
        except ValueError:
            allowed = ", ".join(repr(p.value) for p in Participation)
            raise ValueError(f"participation = {self.scheme!r}: allowed {allowed}") from None
        n = _int_at_least("num-clients", self.num_clients, 1)
        b = _int_at_least("bands", self.bands, 1)
        rounds = _int_at_least("num-rounds", self.num_rounds, 1)
        if b > rounds:
            raise ValueError(f"bands = {b} exceeds num-rounds = {rounds}: allowed 1 <= bands <= num-rounds")
        most = -(-rounds // b)
        if self.max_participations is not None:
            k = _int_at_least("max-participations", self.max_participations, 1)
            if self.scheme is not Participation.MIN_SEPARATION and k < most:
                raise ValueError(
                    f"max-participations = {k} with participation = {self.scheme.value!r}: group 0 is asked "
                    f"ceil(num-rounds / bands) = {most} times; allowed: >= {most} (or 'min-separation' to cap "
                    f"participations)"
                )
        p = self.sampling_probability
        if not (isinstance(p, int | float) and 0.0 < p <= 1.0):
            raise ValueError(f"sampling-probability = {p!r}: allowed 0 < p <= 1")
        if self.scheme is not Participation.CYCLIC_POISSON and p != 1.0:
            raise ValueError(
                f"sampling-probability = {p!r} with participation = {self.scheme.value!r}: only "
                f"'cyclic-poisson' samples (allowed: 1)"
            )
        least = _int_at_least("min_group_size", self.min_group_size, 1)
        if self.max_cohort is not None:
            _int_at_least("max-cohort", self.max_cohort, max(1, least))
            if self.scheme is not Participation.MIN_SEPARATION:
                raise ValueError(
                    f"max-cohort = {self.max_cohort!r} with participation = {self.scheme.value!r}: only "
                    f"'min-separation' caps its cohorts (allowed: none)"
                )
        if self.scheme is not Participation.MIN_SEPARATION and n // b < least:
            raise ValueError(
                f"num-clients = {n} in bands = {b} cyclic groups leaves {n // b} client(s) in the smallest group; "
                f"this run needs at least {least} per group: allowed bands <= {max(1, n // least)}"
            )

    # ---------------------------------------------------------------------------------------- derived
    @property
    def participations(self) -> int:
        """``k`` in force: ``min(max_participations, ceil(K / b))``."""
        most = -(-self.num_rounds // self.bands)
        return most if self.max_participations is None else min(self.max_participations, most)

    @property
    def adjacency(self) -> Neighbouring:
        """The neighbouring relation under which the rule's sensitivity is the whole story.

        Add/remove one client (the project's unit) when whether a client is asked never depends on whether another
        is present: cyclic groups by id, Poisson coins per client, every eligible connected client. Zero-out (the
        client is present in both federations, sending ``g = 0`` in one) when a ``max_cohort`` cap lets one
        client's presence move another's participations.
        """
        return Neighbouring.ZERO_OUT if self.max_cohort is not None else Neighbouring.ADD_REMOVE

    @property
    def amplified(self) -> bool:
        """Whether the accounting may use amplification by sampling (``cyclic-poisson`` with ``p < 1``)."""
        return self.scheme is Participation.CYCLIC_POISSON and self.sampling_probability < 1.0

    def group_of(self, client_id: int) -> int:
        """Client ``i``'s cyclic group, ``i mod b`` (a function of its id alone)."""
        return int(client_id) % self.bands

    def group(self, round_index: int) -> np.ndarray:
        """The sorted ids of round ``k``'s group, ``{i : i mod b = k mod b}`` (cyclic schemes)."""
        return np.arange(round_index % self.bands, self.num_clients, self.bands)

    def expected_cohort(self, round_index: int = 0) -> float:
        """The expected number of clients asked in round ``k`` by the cyclic schemes (``p |group|``)."""
        return self.sampling_probability * len(self.group(round_index))

    def check_cohort_size(self, clients_per_round: float) -> None:
        """Refuse an expected cohort ``r`` the rule cannot sustain: at most ``n / b`` clients per round.

        Each client takes part at most once in any ``b`` consecutive rounds, so ``b`` rounds hold at most
        ``n`` participations.
        """
        if clients_per_round * self.bands > self.num_clients * (1 + 1e-12):
            raise ValueError(
                f"clients-per-round = {clients_per_round:g} with bands = {self.bands}: a client takes part at "
                f"most once every {self.bands} rounds, so at most num-clients / bands = "
                f"{self.num_clients / self.bands:g} clients per round; allowed bands <= "
                f"{max(1, math.floor(self.num_clients / clients_per_round))}"
            )


# --------------------------------------------------------------------------------------------- the server's gate
class ParticipationTracker:
    """The server's record of who took part when, and the gate that enforces the rule before anyone is asked.

    A participation is recorded when a client is *asked* (selected), whether or not its update reaches the
    sum: conservative, and the only thing the server knows for sure before the round (dropouts only remove
    contributions, which never increases the sensitivity).
    """

    NEVER = -1  #: ``last_round`` of a client that never took part
    #: The keys of ``state_dict``.
    STATE_KEYS = ("position", "cohort_ids", "cohort_sizes", "rule")

    def __init__(self, rule: ParticipationRule) -> None:
        self.rule = rule
        self.position = 0  #: the next round to select
        #: Each admitted round's cohort (sorted ids), the record everything else follows from.
        self.cohorts: list[np.ndarray] = []
        #: Derived from ``cohorts``: each client's last round (``NEVER``) and number of participations.
        self.last_round = np.full(rule.num_clients, self.NEVER, dtype=np.int64)
        self.count = np.zeros(rule.num_clients, dtype=np.int64)

    # ------------------------------------------------------------------------------------------- queries
    def eligible(self, round_index: int) -> np.ndarray:
        """Sorted ids that may take part in round ``k`` under the rule (cyclic schemes: only round ``k``'s group)."""
        b, k = self.rule.bands, self.rule.participations
        ok = ((self.last_round == self.NEVER) | (round_index - self.last_round >= b)) & (self.count < k)
        if self.rule.scheme is not Participation.MIN_SEPARATION:
            in_group = np.zeros(self.rule.num_clients, dtype=bool)
            in_group[self.rule.group(round_index)] = True
            ok &= in_group
        return np.flatnonzero(ok)

    # ----------------------------------------------------------------------------------------- selection
    def select(
        self,
        round_index: int,
        rng: np.random.Generator | None = None,
        available: Iterable[int] | None = None,
    ) -> np.ndarray:
        """Round ``k``'s cohort by the scheme, recorded: `choose()`, then `admit()`."""
        chosen = self.choose(round_index, rng, available)
        self.admit(round_index, chosen)
        return chosen

    def choose(
        self,
        round_index: int,
        rng: np.random.Generator | None = None,
        available: Iterable[int] | None = None,
    ) -> np.ndarray:
        """Round ``k``'s cohort by the scheme, not yet recorded; nobody outside the rule is ever returned.

        The server records it with `admit()` once the round is sure to run (not, say, when the privacy
        budget stops the run before it).

        Parameters
        ----------
        round_index:
            ``k`` (0-based); rounds are selected in order, each once.
        rng:
            ``cyclic-poisson``: the round's sampling generator (``(seed, Stream.SAMPLING, k)``), one uniform per
            client of the group, exactly as `dpfedavg.core.server.poisson_sample()` draws.
            ``min-separation`` with a ``max_cohort``: breaks ties between equally rested clients (ids otherwise).
        available:
            The connected clients (a deployment); ``None`` means everyone. The cyclic schemes ask the available
            part of the group; ``cyclic-poisson`` samples the whole group first, so who is connected does not
            change the coin flips.
        """
        eligible = self.eligible(round_index)
        scheme = self.rule.scheme
        if scheme is Participation.CYCLIC_POISSON:
            if rng is None:
                raise ValueError("cyclic-poisson selection needs the round's sampling generator")
            group = self.rule.group(round_index)
            chosen = group[poisson_sample(len(group), self.rule.sampling_probability, rng)]
            chosen = np.intersect1d(chosen, eligible)
        else:
            chosen = eligible
        if available is not None:
            chosen = np.intersect1d(chosen, np.asarray(list(available), dtype=np.int64))
        cap = self.rule.max_cohort
        if cap is not None and chosen.size > cap:
            chosen = self._longest_waiting(chosen, cap, rng)
        return chosen

    def _longest_waiting(self, ids: np.ndarray, how_many: int, rng: np.random.Generator | None) -> np.ndarray:
        order = rng.permutation(ids.size) if rng is not None else np.arange(ids.size)
        ids = ids[order]
        waited = np.where(self.last_round[ids] == self.NEVER, np.iinfo(np.int64).min, self.last_round[ids])
        keep = ids[np.argsort(waited, kind="stable")[:how_many]]
        return np.sort(keep)

    def admit(self, round_index: int, cohort: Iterable[int]) -> None:
        """Record round ``k``'s cohort, refusing it whole if any client breaks the rule.

        Raises
        ------
        ParticipationError
            A round out of order, an unknown or repeated id, a client asked again fewer than ``b`` rounds after
            its last participation, beyond ``k`` participations, or outside round ``k``'s cyclic group.
        """
        if round_index != self.position:
            raise ParticipationError(
                f"participation tracker is at round {self.position}, asked to admit round {round_index}"
            )
        ids = np.asarray(sorted(int(i) for i in cohort), dtype=np.int64)
        if ids.size and (ids[0] < 0 or ids[-1] >= self.rule.num_clients):
            raise ParticipationError(f"round {round_index}: client ids must lie in [0, {self.rule.num_clients})")
        if ids.size != np.unique(ids).size:
            raise ParticipationError(f"round {round_index}: a client appears twice in the cohort")
        bad = np.setdiff1d(ids, self.eligible(round_index))
        if bad.size:
            i = int(bad[0])
            raise ParticipationError(
                f"round {round_index}: client {i} may not take part ({self._why(i, round_index)}); "
                f"{bad.size} client(s) outside the rule, cohort refused"
            )
        self.last_round[ids] = round_index
        self.count[ids] += 1
        self.cohorts.append(ids)
        self.position += 1

    def _why(self, client: int, round_index: int) -> str:
        last, count = int(self.last_round[client]), int(self.count[client])
        if count >= self.rule.participations:
            return f"already {count} participations, max-participations = {self.rule.participations}"
        if last != self.NEVER and round_index - last < self.rule.bands:
            return f"last took part in round {last}, fewer than bands = {self.rule.bands} rounds ago"
        return (
            f"its group is {self.rule.group_of(client)}, round {round_index} asks group {round_index % self.rule.bands}"
        )

    # ------------------------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The rounds' cohorts (ids round after round, and each round's size), the position, and the rule (a JSON
        string) to check on load. The per-client counts are not stored: they follow from the cohorts.

        Flat: numpy arrays, ints and strings only, so ``np.savez`` stores it as it is.
        """
        ids = np.concatenate(self.cohorts) if self.cohorts else np.zeros(0, dtype=np.int64)
        return {
            "position": self.position,
            "cohort_ids": ids.astype(np.int64),
            "cohort_sizes": np.asarray([c.size for c in self.cohorts], dtype=np.int64),
            "rule": self._rule_json(),
        }

    def _rule_json(self) -> str:
        r = self.rule
        return json.dumps(
            [r.scheme.value, r.num_clients, r.bands, r.num_rounds, r.participations, r.sampling_probability]
            + [r.max_cohort]
        )

    def load_state_dict(self, state: dict[str, Any], cohort_sizes: Sequence[int] | None = None) -> None:
        """Continue from ``state``; refuse one recorded under another rule or one the rule could not have produced.

        The recorded cohorts are replayed through the gate (``admit``), round after round: the per-client
        counts and last rounds are what the replay gives, so no count can be moved from one client to another
        without editing a cohort, and an edited cohort must itself obey the rule (at most ``k`` participations,
        ``b`` rounds apart, the client's cyclic group). ``cohort_sizes``: the number of clients asked in each round
        so far (``metrics.csv``'s ``num_sampled``), when known; the cohorts must have exactly those sizes.

        Raises
        ------
        ValueError
            Another rule, other fields (a stored count), wrong shapes, or cohorts that break the rule or disagree
            with ``cohort_sizes``: an edited history could let a client take part more often than the guarantee
            allows.
        """
        if set(state) != set(self.STATE_KEYS):
            raise ValueError(
                f"the checkpoint's participation history has the fields {sorted(state)}, expected "
                f"{sorted(self.STATE_KEYS)} (the rounds' cohorts; per-client counts follow from them)"
            )
        mine, saved = self._rule_json(), str(state["rule"])
        if saved != mine:
            raise ValueError(
                f"the checkpoint's participation rule [scheme, n, b, K, k, p, cap] is {saved}, this run's is {mine}: "
                f"resume with the same rule"
            )
        ids, sizes = np.asarray(state["cohort_ids"]), np.asarray(state["cohort_sizes"])
        position = int(state["position"])
        problem = None
        if ids.ndim != 1 or sizes.ndim != 1 or not all(np.issubdtype(a.dtype, np.integer) for a in (ids, sizes)):
            problem = f"cohorts of shapes {ids.shape}, {sizes.shape} and dtypes {ids.dtype}, {sizes.dtype}"
        elif position < 0 or sizes.shape != (position,) or np.any(sizes < 0) or int(sizes.sum()) != ids.size:
            problem = (
                f"{sizes.size} cohort sizes adding up to {int(sizes.sum())} for {ids.size} ids at round {position}"
            )
        elif cohort_sizes is not None and [int(v) for v in sizes] != [int(v) for v in cohort_sizes]:
            problem = f"cohort sizes {sizes.tolist()[:8]}..., but the rounds asked {list(cohort_sizes)[:8]}..."
        if problem is not None:
            raise ValueError(f"the checkpoint's participation history is malformed: {problem}")
        replay = ParticipationTracker(self.rule)
        try:
            for k, cohort in enumerate(np.split(ids.astype(np.int64), np.cumsum(sizes)[:-1]) if position else []):
                replay.admit(k, cohort)
        except ParticipationError as err:
            raise ValueError(
                f"the checkpoint's participation history is not one the rule produces: {err} (an edited history "
                "could let a client take part more often than the accounted sensitivity)"
            ) from None
        self.cohorts, self.position = replay.cohorts, replay.position
        self.last_round, self.count = replay.last_round, replay.count

    def history_errors(
        self, last_round: np.ndarray, count: np.ndarray, position: int, cohort_sizes: Sequence[int] | None = None
    ) -> list[str]:
        """Why ``(last_round, count)`` after ``position`` rounds could not have come from this rule (empty: it could).

        Checked: counts in ``[0, k]``; last rounds before ``position``, in the client's cyclic group, and at least
        ``(count - 1) b`` (``count`` participations ``b`` apart); with ``cohort_sizes``, the counts add up to the
        rounds' cohorts, no round has more last participations than clients asked, and in the last ``b - 1``
        rounds exactly as many (a client asked there cannot have been asked again since). What a history cannot
        show (which of two clients took part) is not checked.
        """
        r, never, problems = self.rule, self.NEVER, []
        if position < 0:
            return [f"position {position} < 0"]
        if cohort_sizes is not None and len(cohort_sizes) != position:
            problems.append(f"it is at round {position} but the run has completed {len(cohort_sizes)} rounds")
        took_part = last_round != never

        def first(mask: np.ndarray, what: str) -> None:
            if mask.any():
                i = int(np.flatnonzero(mask)[0])
                problems.append(
                    f"client {i} has count {int(count[i])}, last round {int(last_round[i])}: {what} "
                    f"({int(mask.sum())} client(s))"
                )

        first((count < 0) | (count > r.participations), f"count outside [0, max-participations = {r.participations}]")
        first((last_round < never) | (last_round >= position), f"last round not in {never} (never) .. {position - 1}")
        first(took_part != (count > 0), "a client took part iff its count is > 0")
        first(took_part & (last_round < (count - 1) * r.bands), f"{r.bands} rounds apart cannot fit that many")
        if r.scheme is not Participation.MIN_SEPARATION:
            ids = np.arange(r.num_clients)
            first(took_part & (last_round % r.bands != ids % r.bands), "a round outside the client's cyclic group")
        if cohort_sizes is not None and len(cohort_sizes) == position and not problems:
            sizes = np.asarray(cohort_sizes, dtype=np.int64)
            if int(count.sum()) != int(sizes.sum()):
                problems.append(f"counts add up to {int(count.sum())}, the rounds asked {int(sizes.sum())} clients")
            last = np.bincount(last_round[took_part], minlength=position)[:position] if position else np.zeros(0)
            recent = np.arange(position) >= position - r.bands + 1
            bad = np.flatnonzero((last > sizes) | (recent & (last != sizes)))
            if bad.size:
                k = int(bad[0])
                problems.append(f"round {k} asked {int(sizes[k])} clients, {int(last[k])} have it as last round")
        return problems


# ------------------------------------------------------------------------------------------- schedule check
def check_schedule(
    schedule: Sequence[Iterable[int]], bands: int, max_participations: int | None = None
) -> dict[int, list[int]]:
    """Check a whole run's schedule (round ``k`` -> the ids asked) against (k, b)-participation.

    Independent of `ParticipationTracker`: it only reads the rounds each client appears in. Returns
    ``client -> its rounds`` (sorted).

    Raises
    ------
    ParticipationError
        A client whose two participations are fewer than ``bands`` rounds apart, or that takes part more than
        ``max_participations`` times (the message names the client and the rounds).
    """
    if isinstance(bands, bool) or not isinstance(bands, int | np.integer) or bands < 1:
        raise ValueError(f"bands = {bands!r}: must be an integer >= 1")
    rounds_of: dict[int, list[int]] = {}
    for k, cohort in enumerate(schedule):
        for client in cohort:
            rounds_of.setdefault(int(client), []).append(k)
    for client, rounds in sorted(rounds_of.items()):
        if len(set(rounds)) != len(rounds):
            raise ParticipationError(f"client {client} appears twice in round {rounds[0]}")
        for a, b in zip(rounds, rounds[1:], strict=False):
            if b - a < bands:
                raise ParticipationError(
                    f"client {client} takes part in rounds {a} and {b}, {b - a} apart: the rule needs at least "
                    f"bands = {bands}"
                )
        if max_participations is not None and len(rounds) > max_participations:
            raise ParticipationError(
                f"client {client} takes part {len(rounds)} times (rounds {rounds}): max-participations = "
                f"{max_participations}"
            )
    return rounds_of
