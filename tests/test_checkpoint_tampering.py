"""An edited checkpoint cannot lower epsilon or slip bad state into a resumed run (issue 29, part 3).

A run is interrupted after round 6 (checkpoint after round 5), its ``checkpoint.npz`` is edited as an attacker
(or a bit flip) would, and the resume must either refuse with one `CheckpointError` naming the field,
or, where the edit is harmless, report exactly the epsilon that the rounds it ran cost (recomputed here
with a fresh accountant: every round's (q, z) is public).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from dpfedavg import epsilon_for
from dpfedavg.config import RunConfig
from dpfedavg.engines.batched import run_batched
from dpfedavg.io.checkpoint import CHECKPOINT_FILE, CheckpointError
from dpfedavg.privacy.setup import PrivacySetup

BASE = {
    "task": "quadratic",
    "dim": 12,
    "num-clients": 10,
    "clients-per-round": 4.0,
    "num-rounds": 10,
    "server-momentum": 0.5,
    "epsilon": 4.0,
    "delta": 1e-5,
    "algorithm": "clip",
    "clip": 2.0,
    "seed": 7,
    "checkpoint-every": 5,
    "run-name": "run",
}


class _Crash(BaseException):
    """The server process dying after round 6 (not an Exception: nothing may catch it)."""


def _interrupted(tmp: Path, **overrides) -> RunConfig:
    cfg = RunConfig.from_run_config({**BASE, "output-dir": str(tmp), **overrides})

    def crash(server_round: int, w: np.ndarray) -> None:
        if server_round == 6:
            raise _Crash

    with pytest.raises(_Crash):
        run_batched(cfg, on_round=crash)
    return cfg.replace(resume=True)


def _edit(run_dir: Path, edit: Callable[[dict, dict], None]) -> None:
    """Rewrite the checkpoint with ``edit(meta, arrays)`` applied (as someone with write access would)."""
    path = run_dir / CHECKPOINT_FILE
    with np.load(path, allow_pickle=False) as data:
        arrays = {name: data[name].copy() for name in data.files}
    meta = json.loads(str(arrays.pop("meta")))
    edit(meta, arrays)
    with path.open("wb") as fh:
        np.savez(fh, meta=np.array(json.dumps(meta)), **arrays)


def _set(path: str, value) -> Callable[[dict, dict], None]:
    """An edit of the JSON metadata at a dotted ``path`` (``None`` deletes the key)."""

    def edit(meta: dict, arrays: dict) -> None:
        *parents, leaf = path.split(".")
        node = meta
        for key in parents:
            node = node[key]
        if value is None:
            del node[leaf]
        else:
            node[leaf] = value(node[leaf]) if callable(value) else value

    return edit


def _history(edit_events: Callable[[list], list]) -> Callable[[dict, dict], None]:
    def edit(meta: dict, arrays: dict) -> None:
        acc = meta["server"]["accountant"]
        acc["history"] = edit_events(acc["history"])

    return edit


def _refused(cfg: RunConfig, *fragments: str) -> None:
    before = (Path(cfg.output_dir) / cfg.run_name / "metrics.csv").read_text()
    with pytest.raises(CheckpointError) as info:
        run_batched(cfg)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    assert (Path(cfg.output_dir) / cfg.run_name / "metrics.csv").read_text() == before  # nothing was written


# ----------------------------------------------------------- lower epsilon
@pytest.mark.parametrize(
    ("name", "edit"),
    [
        ("emptied-accountant-history", _history(lambda h: [])),
        ("z-times-100", _history(lambda h: [[q, 100 * z] for q, z in h])),
        ("z-set-to-none", _history(lambda h: [[q, None] for q, _ in h])),
        ("q-halved", _history(lambda h: [[q / 2, z] for q, z in h])),
        ("one-event-dropped", _history(lambda h: h[1:])),
        ("round-set-back-to-1", _set("round", 1)),
        ("accountant-renamed", _set("server.accountant.accountant", "rdp")),
        ("delta-raised", _set("server.accountant.delta", 1e-3)),
        ("releases-below-the-round", _set("releases", 2)),
    ],
)
def test_edited_checkpoint_that_would_lower_epsilon_is_refused(tmp_path: Path, name: str, edit) -> None:
    cfg = _interrupted(tmp_path)
    _edit(tmp_path / "run", edit)
    _refused(cfg, "checkpoint")


def test_emptied_history_under_a_budget_cannot_buy_more_rounds(tmp_path: Path) -> None:
    """max-epsilon: an emptied history let a resume run 6 more rounds while reporting less (issue 29)."""
    cfg = _interrupted(
        tmp_path, **{"epsilon": 0.0, "noise-multiplier": 2.0, "max-epsilon": 3.0}
    )  # stops before round 10
    _edit(tmp_path / "run", _history(lambda h: []))
    _refused(cfg, "server.accountant")


def test_resumed_epsilon_is_what_the_rounds_cost(tmp_path: Path) -> None:
    """An untouched checkpoint resumes; the final epsilon equals a fresh accountant's for 10 rounds of (q, z)."""
    cfg = _interrupted(tmp_path)
    result = run_batched(cfg)
    plan = PrivacySetup.resolve(cfg).plan
    assert result.epsilon == pytest.approx(epsilon_for(plan.noise_multiplier, plan.q, 10, plan.delta, "pld"), rel=1e-12)


# ---------------------------------------------------------------- bad state
@pytest.mark.parametrize(
    ("array", "field"),
    [("w", "w"), ("server.momentum", "momentum"), ("server.random_iterate", "random_iterate")],
)
def test_non_finite_state_is_refused(tmp_path: Path, array: str, field: str) -> None:
    cfg = _interrupted(tmp_path)

    def poison(meta: dict, arrays: dict) -> None:
        arrays[array] = arrays[array].copy()
        arrays[array][3] = np.nan

    _edit(tmp_path / "run", poison)
    _refused(cfg, field)


def test_round_count_that_disagrees_with_metrics_csv_is_refused(tmp_path: Path) -> None:
    """The checkpoint says 5 rounds ran; metrics.csv holds rows for rounds 0..3 only."""
    cfg = _interrupted(tmp_path)
    metrics = tmp_path / "run" / "metrics.csv"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:5]))  # header + rounds 0..3
    _refused(cfg, "metrics.csv", "round")


@pytest.mark.parametrize(
    ("name", "edit", "field"),
    [
        ("round-is-a-string", _set("round", "five"), "round"),
        ("round-is-missing", _set("round", None), "round"),
        ("round-is-negative", _set("round", -3), "round"),
        ("history-is-a-list", _set("server.history", [1, 2]), "server.history"),
        (
            "history-row-has-an-unknown-column",
            _set("server.history.3", lambda row: {**row, "bogus": 1}),
            "server.history",
        ),
        ("accountant-is-a-number", _set("server.accountant", 5), "server.accountant"),
        ("accountant-history-has-strings", _history(lambda h: [["a", "b"]] * len(h)), "server.accountant"),
        ("random-round-out-of-range", _set("server.random_round", 99), "random_round"),
        ("random-round-is-a-float", _set("server.random_round", 1.5), "random_round"),
        ("evaluated-is-a-list", _set("evaluated", [0.5]), "evaluated"),
        ("elapsed-is-a-string", _set("elapsed_s", "long"), "elapsed_s"),
        ("run-config-is-missing", _set("run_config", None), "run_config"),
        ("privacy-is-a-string", _set("privacy", "private"), "privacy"),
        ("server-is-missing", _set("server", None), "server"),
    ],
)
def test_malformed_checkpoint_field_is_one_checkpoint_error_naming_it(
    tmp_path: Path, name: str, edit, field: str
) -> None:
    cfg = _interrupted(tmp_path)
    _edit(tmp_path / "run", edit)
    _refused(cfg, field)


def test_adaptive_clip_state_outside_its_floor_and_ceiling_is_refused(tmp_path: Path) -> None:
    cfg = _interrupted(tmp_path, algorithm="adaptive-clip", **{"clip-count-stddev": 2.0})
    for bad in (0.0, -1.0, 1e9, "nan"):
        _edit(tmp_path / "run", _set("server.adaptive_clip", bad))
        _refused(cfg, "adaptive_clip")


def test_wrong_shaped_arrays_are_refused(tmp_path: Path) -> None:
    cfg = _interrupted(tmp_path, **{"save-trajectory": True})

    def reshape(meta: dict, arrays: dict) -> None:
        arrays["trajectory"] = arrays["trajectory"][:2]

    _edit(tmp_path / "run", reshape)
    _refused(cfg, "trajectory")


# ----------------------------------------------------------- banded-MF noise: its state
BANDED = {"noise-mechanism": "banded-mf", "noise-placement": "server", "clients-per-round": 2.0}
_TRACKER, _STREAM = "server.mechanism/tracker/", "server.mechanism/stream/"


def _arrays(**changes: Callable[[np.ndarray], np.ndarray]) -> Callable[[dict, dict], None]:
    def edit(meta: dict, arrays: dict) -> None:
        for name, change in changes.items():
            arrays[name] = change(arrays[name].copy())

    return edit


def _participation_edit(old: Callable[[dict], None], new: Callable[[dict], None]) -> Callable[[dict, dict], None]:
    """One attack on the participation history, in whichever form the checkpoint stores it: per-client arrays
    (``tracker/count``, ``tracker/last_round``: the form before the cohorts were recorded) or the rounds' cohorts."""

    def edit(meta: dict, arrays: dict) -> None:
        (old if _TRACKER + "count" in arrays else new)(arrays)

    return edit


def _emptied_old(arrays: dict) -> None:
    arrays[_TRACKER + "last_round"] = np.full_like(arrays[_TRACKER + "last_round"], -1)
    arrays[_TRACKER + "count"] = np.zeros_like(arrays[_TRACKER + "count"])


def _emptied_new(arrays: dict) -> None:
    arrays[_TRACKER + "cohort_ids"] = arrays[_TRACKER + "cohort_ids"][:0]
    arrays[_TRACKER + "cohort_sizes"] = np.zeros_like(arrays[_TRACKER + "cohort_sizes"])


def _forget_first_old(arrays: dict) -> None:  # the first client asked in round 0
    last, count = arrays[_TRACKER + "last_round"].copy(), arrays[_TRACKER + "count"].copy()
    i = int(np.flatnonzero(last >= 0)[0]) if count.sum() else 0
    last[i], count[i] = -1, 0
    arrays[_TRACKER + "last_round"], arrays[_TRACKER + "count"] = last, count


def _forget_first_new(arrays: dict) -> None:
    sizes = arrays[_TRACKER + "cohort_sizes"].copy()
    sizes[np.flatnonzero(sizes)[0]] -= 1
    arrays[_TRACKER + "cohort_ids"], arrays[_TRACKER + "cohort_sizes"] = arrays[_TRACKER + "cohort_ids"][1:], sizes


def _counts(arrays: dict, num_clients: int) -> np.ndarray:
    if _TRACKER + "count" in arrays:
        return arrays[_TRACKER + "count"].copy()
    return np.bincount(arrays[_TRACKER + "cohort_ids"], minlength=num_clients)


def _count_moved_old(arrays: dict) -> None:
    """One participation of a client that took part twice moved to one that took part once and can fit two: the
    first may then take part once more than the rule allows (max-participations + 1 times, or again sooner)."""
    count, last = arrays[_TRACKER + "count"].copy(), arrays[_TRACKER + "last_round"]
    a = int(np.flatnonzero(count >= 2)[0])
    b = int(np.flatnonzero((count == 1) & (last >= _BANDS_OF_MOVED))[0])
    count[a], count[b] = count[a] - 1, count[b] + 1
    arrays[_TRACKER + "count"] = count


def _count_moved_new(arrays: dict) -> None:
    """The same counts written beside the cohorts (the checkpoint has no field for them)."""
    count = _counts(arrays, _MOVED["num-clients"])
    a, b = int(np.flatnonzero(count >= 2)[0]), int(np.flatnonzero(count == 1)[-1])
    count[a], count[b] = count[a] - 1, count[b] + 1
    arrays[_TRACKER + "count"] = count


def _extra_participation_new(arrays: dict) -> None:
    """A participation the rule forbids added to the last cohort: a client asked in the round before (b = 2)."""
    ids, sizes = arrays[_TRACKER + "cohort_ids"], arrays[_TRACKER + "cohort_sizes"].copy()
    a = int(ids[-sizes[-1] - 1])  # the last client of the round before the last
    sizes[-1] += 1
    arrays[_TRACKER + "cohort_ids"], arrays[_TRACKER + "cohort_sizes"] = np.append(ids, a), sizes


#: A cyclic-poisson run (b = 2, p = 0.5) in which, by round 6, some clients took part twice and some once.
_MOVED = {"num-clients": 8, "clients-per-round": 2.0, "bands": 2, "checkpoint-every": 1}
_BANDS_OF_MOVED = 2


@pytest.mark.parametrize("participation", ["min-separation", "cyclic"])
@pytest.mark.parametrize(
    ("name", "edit", "fragment"),
    [
        # nobody took part yet: the last b - 1 rounds' clients could be asked again at once (a sensitivity the
        # accounting does not cover, at the same reported epsilon)
        ("participation-emptied", _participation_edit(_emptied_old, _emptied_new), "participation history"),
        # the first client asked in round 0 forgotten: the smallest edit that frees a client
        ("one-client-forgotten", _participation_edit(_forget_first_old, _forget_first_new), "participation history"),
        ("noise-buffer-nan", _arrays(**{_STREAM + "history": lambda a: np.full_like(a, np.nan)}), "noise buffer"),
        ("noise-buffer-x1e6", _arrays(**{_STREAM + "history": lambda a: a * 1e6}), "noise buffer"),
        ("noise-buffer-1e300", _arrays(**{_STREAM + "history": lambda a: np.full_like(a, 1e300)}), "noise buffer"),
    ],
)
def test_edited_banded_mf_state_is_refused(tmp_path: Path, participation: str, name: str, edit, fragment: str) -> None:
    cfg = _interrupted(tmp_path, participation=participation, **BANDED)
    _edit(tmp_path / "run", edit)
    _refused(cfg, "checkpoint", fragment)


@pytest.mark.parametrize(
    ("name", "edit"),
    [
        ("count-moved", _participation_edit(_count_moved_old, _count_moved_new)),
        ("extra-participation-in-a-cohort", _participation_edit(lambda arrays: None, _extra_participation_new)),
    ],
)
def test_moved_participation_count_is_refused(tmp_path: Path, name: str, edit) -> None:
    """A count moved from one client to another (that client then takes part k + 1 times): the counts follow
    from the recorded cohorts, which must obey the rule when replayed; a stored count is refused."""
    cfg = _interrupted(tmp_path, participation="cyclic-poisson", **{**BANDED, **_MOVED})
    _edit(tmp_path / "run", edit)
    _refused(cfg, "checkpoint", "participation history")


def test_untouched_banded_mf_checkpoint_resumes(tmp_path: Path) -> None:
    cfg = _interrupted(tmp_path, participation="min-separation", **BANDED)
    assert run_batched(cfg).history[-1]["round"] == 10


def test_banded_mf_run_stopped_by_its_budget_resumes_and_stops_again(tmp_path: Path) -> None:
    """The round the budget refused is not recorded in the participation history, so the final checkpoint is
    consistent: a resume is accepted, runs nothing more and reports the same epsilon (as an independent run)."""
    budget = {**BANDED, "num-clients": 12, "clients-per-round": 3.0, "num-rounds": 40, "epsilon": 0.0,
              "noise-multiplier": 3.0, "max-epsilon": 4.0}  # fmt: skip
    cfg = RunConfig.from_run_config({**BASE, **budget, "output-dir": str(tmp_path)})
    first = run_batched(cfg)
    assert 1 < len(first.history) - 1 < 40  # stopped by the budget
    again = run_batched(cfg.replace(resume=True))
    assert len(again.history) == len(first.history) and again.epsilon == first.epsilon <= 4.0
