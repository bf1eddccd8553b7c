"""Did a run finish? ``python -m dpfedavg.deploy status RUN_DIR``: exit 0 only with a ``final`` record.

Flower's own signs are not enough (issue 47): ``flwr run --stream`` exits 0 when the ServerApp is killed, crashes or
a resume is refused, and ``flwr ls`` lists a refused resume as ``finished:completed``. The run's ``config.json``
gets its ``final`` entry only after the model, the trajectory and the metrics are written
(`dpfedavg.server.session`), so a run finished if and only if it has one (docs/reference/outputs.md).

Exit status: 0 finished (``final`` present, every planned round done or the budget stopped it before one);
1 not finished (no ``config.json``, no ``final``, a run stopped because its replies were unusable, a
``config.json`` that does not parse), each with one line saying why and what to do; 2 bad arguments.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunStatus", "run_status"]


@dataclass(frozen=True)
class RunStatus:
    """What ``config.json`` says: ``finished`` and one line saying so, or why not."""

    finished: bool
    line: str


def _last_round(run_dir: Path) -> int | None:
    """The last complete round row of ``metrics.csv`` (``None``: no rows)."""
    try:
        with (run_dir / "metrics.csv").open(newline="") as f:
            rows = [row for row in csv.DictReader(f) if row.get("round")]
    except (OSError, csv.Error):
        return None
    rounds = []
    for row in rows:
        try:
            rounds.append(int(float(row["round"])))
        except ValueError:
            continue
    return max(rounds) if rounds else None


def run_status(run_dir: Path) -> RunStatus:
    """The status of the run whose results folder is ``run_dir`` (``FileNotFoundError`` if it is not a folder)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"RUN_DIR {run_dir}: no such folder (the server's outputs/<run-name>)")
    config = run_dir / "config.json"
    try:
        description = json.loads(config.read_text())
    except FileNotFoundError:
        return RunStatus(False, f"{run_dir} NOT FINISHED: no config.json: the ServerApp never started this run "
                                "(a pending run: is the SuperLink's SuperExec up? see 'deploy check')")  # fmt: skip
    except (OSError, ValueError) as err:
        return RunStatus(False, f"{run_dir} NOT FINISHED: {config} cannot be read ({err})")
    if not isinstance(description, dict):
        return RunStatus(False, f"{run_dir} NOT FINISHED: {config} is not a run's config.json")
    run_config = description.get("run_config") if isinstance(description.get("run_config"), dict) else {}
    planned = run_config.get("num_rounds", run_config.get("num-rounds"))
    final = description.get("final")
    if not isinstance(final, dict):
        last = _last_round(run_dir)
        progress = "no round recorded" if last is None else f"the last round in metrics.csv is {last}"
        if planned is not None:
            progress += f" of {planned}"
        checkpoint = (run_dir / "checkpoint.npz").exists()
        how = (
            "it may still be running (flwr ls); if its ServerApp died, start it again with resume=true "
            "(docs/how-to/resume.md)" if checkpoint
            else "it may still be running (flwr ls); it has no checkpoint.npz to resume from"
        )  # fmt: skip
        return RunStatus(False, f"{run_dir} NOT FINISHED: config.json has no 'final' record ({progress}); {how}")
    if final.get("stopped_because"):
        return RunStatus(False, f"{run_dir} FAILED after {final.get('rounds_completed')} rounds: "
                                f"{final['stopped_because']}")  # fmt: skip
    epsilon, delta = final.get("epsilon"), final.get("delta")
    budget = final.get("stopped_by_budget_before_round")
    stopped = f"; the budget stopped it before round {budget}" if budget else ""
    last = _last_round(run_dir)
    rounds = f"after round {last}" + (f" of {planned}" if planned is not None else "") if last is not None else ""
    return RunStatus(
        True,
        f"{run_dir} finished {rounds}: (epsilon, delta) = ({epsilon:.4g}, {delta:g}), guarantee "
        f"{final.get('guarantee')}{stopped}" if isinstance(epsilon, int | float) and isinstance(delta, int | float)
        else f"{run_dir} finished {rounds}: guarantee {final.get('guarantee')}{stopped}",
    )
