"""No result is lost or half-written (issue 29, part 5).

A reused ``run-name`` without ``resume`` is refused before anything is written (a default, timestamped name
gets a free ``-2``, ``-3`` suffix instead); a full disk stops the run with one error line, leaves every
file it had complete and readable, and the run resumes from its last checkpoint to the result an
uninterrupted run gives. One test fills a real (small) tmpfs in a private mount namespace; the others
inject ENOSPC.
"""

from __future__ import annotations

import csv
import errno
import json
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from dpfedavg.config import ConfigError, RunConfig
from dpfedavg.engines.batched import run_batched
from dpfedavg.io.checkpoint import load_checkpoint

BASE = {
    "task": "quadratic",
    "dim": 30,
    "num-clients": 10,
    "clients-per-round": 4.0,
    "num-rounds": 12,
    "epsilon": 4.0,
    "delta": 1e-5,
    "algorithm": "norm",
    "clip": 2.0,
    "seed": 11,
    "checkpoint-every": 3,
    "run-name": "exp",
}


def _cfg(tmp: Path, **overrides) -> RunConfig:
    return RunConfig.from_run_config({**BASE, "output-dir": str(tmp), **overrides})


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def _complete_rows(path: Path) -> list[list[str]]:
    """metrics.csv's rows, asserting that every line is a complete row of the header's width."""
    text = path.read_text()
    assert text.endswith("\n"), "metrics.csv ends in the middle of a row"
    rows = list(csv.reader(text.splitlines()))
    assert all(len(row) == len(rows[0]) for row in rows), "metrics.csv has a row of the wrong width"
    assert [int(row[0]) for row in rows[1:]] == list(range(len(rows) - 1)), "metrics.csv's rounds are not 0, 1, ..."
    return rows


def _model(directory: Path) -> np.ndarray:
    return np.load(directory / "model.npz")["w_final"]


def _final(directory: Path) -> dict | None:
    return json.loads((directory / "config.json").read_text()).get("final")


# ------------------------------------------------------------------ run-name
def test_reused_run_name_without_resume_is_refused_and_nothing_is_touched(tmp_path: Path) -> None:
    first = run_batched(_cfg(tmp_path)).directory
    before = _snapshot(first)
    with pytest.raises(ConfigError) as info:
        run_batched(_cfg(tmp_path, seed=12))
    for fragment in ("'run-name' = 'exp'", "resume", str(first)):
        assert fragment in str(info.value), str(info.value)
    assert _snapshot(first) == before


def test_default_run_names_never_collide(tmp_path: Path, monkeypatch) -> None:
    """Two runs named <task>-<algorithm>-<UTC second>-<run id> in the same second: the second gets '-2'."""
    import dpfedavg.server.session as session

    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ANN001, ANN206 - datetime's signature
            return datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)

    monkeypatch.setattr(session, "datetime", Frozen)
    a = run_batched(_cfg(tmp_path, **{"run-name": "", "checkpoint-every": 0})).directory
    b = run_batched(_cfg(tmp_path, **{"run-name": "", "checkpoint-every": 0, "seed": 12})).directory
    assert a != b and b.name == a.name + "-2"
    assert _final(a) is not None and _final(b) is not None
    assert not np.array_equal(_model(a), _model(b))


def test_sweep_rerun_keeps_an_incomplete_cell(tmp_path: Path) -> None:
    """A cell that did not finish is set aside (<key>.incomplete-1), not overwritten, when the sweep reruns it."""
    from dpfedavg.experiments.sweep import make_cell, run_cells

    cell = make_cell(tmp_path, "cell", {k: v for k, v in BASE.items() if k != "run-name"})
    cell.directory.mkdir(parents=True)
    (cell.directory / "metrics.csv").write_text("round\n0\n")
    run_cells([cell], progress=False)
    assert _final(cell.directory) is not None
    kept = tmp_path / "runs" / "cell.incomplete-1"
    assert (kept / "metrics.csv").read_text() == "round\n0\n"


# ----------------------------------------------------------------- full disk
def _disk_full_after_first_checkpoint(monkeypatch, budget: int = 400) -> None:
    """Every file write through dpfedavg.io.atomic fails with ENOSPC once ``budget`` bytes were written after the
    first checkpoint (a disk that fills then), the last one partially, as a filling disk does."""
    import os

    from dpfedavg.io import atomic

    state = {"checkpointed": False, "left": budget}
    real_write = os.write

    def write(fd: int, data) -> int:  # noqa: ANN001 - os.write's signature
        if ".checkpoint.npz." in os.readlink(f"/proc/self/fd/{fd}"):
            if not state["checkpointed"]:
                state["checkpointed"] = True
                return real_write(fd, data)
        elif not state["checkpointed"]:
            return real_write(fd, data)
        if state["left"] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        chunk = bytes(data)[: state["left"]]
        state["left"] -= len(chunk)
        return real_write(fd, chunk)

    monkeypatch.setattr(atomic.os, "write", write)


def test_full_disk_mid_run_stops_with_complete_files_and_resumes_exactly(tmp_path: Path, monkeypatch) -> None:
    from dpfedavg.errors import ResultsError

    reference = run_batched(_cfg(tmp_path / "ref")).directory
    cfg = _cfg(tmp_path / "cut")
    with monkeypatch.context() as patch:
        _disk_full_after_first_checkpoint(patch)
        with pytest.raises(ResultsError) as info:
            run_batched(cfg)
    assert "No space left on device" in str(info.value) and "resume" in str(info.value)
    run_dir = tmp_path / "cut" / "exp"
    rows = _complete_rows(run_dir / "metrics.csv")
    last_checkpoint = load_checkpoint(run_dir).round
    assert 0 < last_checkpoint <= len(rows) - 2 < BASE["num-rounds"]
    assert not list(run_dir.glob(".*.tmp"))  # no temporary file left
    resumed = run_batched(cfg.replace(resume=True)).directory
    np.testing.assert_array_equal(_model(resumed), _model(reference))
    assert _final(resumed)["epsilon"] == _final(reference)["epsilon"]
    strip = [row[:-1] for row in _complete_rows(resumed / "metrics.csv")]  # elapsed_s differs
    assert strip == [row[:-1] for row in _complete_rows(reference / "metrics.csv")]


def test_failed_final_write_leaves_a_run_that_resume_finishes(tmp_path: Path, monkeypatch) -> None:
    """model.npz written, config.json's "final" not (issue 29): the run is unfinished, and resume finishes it."""
    from dpfedavg.errors import ResultsError
    from dpfedavg.io import results

    reference = run_batched(_cfg(tmp_path / "ref")).directory
    cfg = _cfg(tmp_path / "cut")
    real = results.write_config_json

    def fail_final(path, payload) -> None:  # noqa: ANN001
        if "final" in payload:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, payload)

    with monkeypatch.context() as patch:
        patch.setattr(results, "write_config_json", fail_final)
        with pytest.raises(ResultsError):
            run_batched(cfg)
    assert _final(tmp_path / "cut" / "exp") is None
    resumed = run_batched(cfg.replace(resume=True)).directory
    assert _final(resumed)["rounds_completed"] == BASE["num-rounds"]
    np.testing.assert_array_equal(_model(resumed), _model(reference))


def _can_mount_tmpfs(where: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs '{where}'"],
        capture_output=True, check=False, timeout=30,
    )  # fmt: skip
    return probe.returncode == 0


_FILL_AND_RESUME = """
set -u
mount -t tmpfs -o size=64k tmpfs "$MNT"
"$PY" -m dpfedavg --run-config "$RC" --run-config "output-dir='$MNT'" >"$OUT/out1" 2>"$OUT/err1"
echo $? >"$OUT/rc1"
mkdir -p "$OUT/after-full" && cp -a "$MNT/." "$OUT/after-full/"
mount -o remount,size=16m "$MNT"
"$PY" -m dpfedavg --run-config "$RC" --run-config "output-dir='$MNT' resume=true" >"$OUT/out2" 2>"$OUT/err2"
echo $? >"$OUT/rc2"
mkdir -p "$OUT/final" && cp -a "$MNT/." "$OUT/final/"
"""


@pytest.mark.timeout(300)
def test_full_disk_on_a_small_tmpfs_leaves_a_readable_resumable_run(tmp_path: Path) -> None:
    """A 64 KiB tmpfs fills during a 200-round run; after a remount to 16 MiB, resume=true finishes it."""
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    if not _can_mount_tmpfs(mnt):
        pytest.skip("cannot mount a tmpfs in a private mount namespace here (unshare -rm)")
    values = {**BASE, "num-rounds": 200, "checkpoint-every": 5}
    rc = " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else repr(v)}" for k, v in values.items())
    rc = rc.replace("True", "true").replace("False", "false")
    env = {
        "PATH": "/usr/bin:/bin",
        "MNT": str(mnt),
        "OUT": str(out),
        "PY": sys.executable,
        "RC": rc,
        "HOME": str(tmp_path),
    }
    subprocess.run(["unshare", "-rm", "bash", "-c", _FILL_AND_RESUME], env=env, check=True, timeout=280)
    rc1, err1 = int((out / "rc1").read_text()), (out / "err1").read_text()
    assert rc1 != 0, "the run did not fill the 64 KiB disk"
    assert "Traceback" not in err1, err1[-2000:]
    last = [line for line in err1.splitlines() if line.strip()][-1]
    assert last.startswith("error:") and "No space left on device" in last, err1[-2000:]
    run_dir = out / "after-full" / "exp"
    rows = _complete_rows(run_dir / "metrics.csv")
    assert load_checkpoint(run_dir).round <= len(rows) - 1
    assert _final(run_dir) is None
    assert int((out / "rc2").read_text()) == 0, (out / "err2").read_text()[-2000:]
    final_dir = out / "final" / "exp"
    assert _final(final_dir)["rounds_completed"] == 200
    reference = run_batched(RunConfig.from_run_config({**values, "output-dir": str(tmp_path / "ref")})).directory
    # another process (BLAS threads may differ): equal to rounding; bit-identity is tested in one process above
    np.testing.assert_allclose(_model(final_dir), _model(reference), rtol=1e-12, atol=1e-12)
