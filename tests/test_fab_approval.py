"""Code the server cannot swap: a SuperNode started with approved app hashes refuses every other FAB.

The unit tests check the app hash (`dpfedavg.deploy.app_hash`) against Flower's own ``flwr build``
and against FABs zipped differently, and the SuperNode hook (`dpfedavg.deploy.approval`) with a
stand-in for Flower's message loop. The deployment test (marked ``deployment``, like
tests/test_deployment.py) runs a real SuperLink and SuperNodes on loopback, started as the deploy
page's step 5 says, and ships them first a modified copy of this app, then the approved one.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from dpfedavg.deploy.__main__ import main
from dpfedavg.deploy.app_hash import AppHashError, app_hash, build_fab, fab_app_hash, folder_app_hash, parse_app_hash
from dpfedavg.deploy.approval import UnapprovedAppError, check_fab, install_approval

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EXAMPLE = ROOT / "examples" / "quickstart-numpy-dp"


@pytest.fixture
def app(tmp_path: Path) -> Path:
    """A copy of a small Flower app (the numpy DP example)."""
    return Path(shutil.copytree(EXAMPLE, tmp_path / "app", ignore=shutil.ignore_patterns("__pycache__")))


def _rezip(fab: bytes, *, compression: int, date: tuple[int, ...], reverse: bool = False) -> bytes:
    """The same files in another zip: other compression, timestamps and entry order."""
    source = zipfile.ZipFile(io.BytesIO(fab))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression) as target:
        for info in sorted(source.infolist(), key=lambda i: i.filename, reverse=reverse):
            copy = zipfile.ZipInfo(info.filename, date_time=date)
            target.writestr(copy, source.read(info), compress_type=compression)
    return out.getvalue()


# ---------------------------------------------------------------------- the app hash


def test_app_hash_of_a_folder_equals_that_of_the_fab_flwr_build_makes(app: Path, tmp_path: Path) -> None:
    # folders Flower's build always leaves out (not walked by app-hash), and one it keeps
    for name in (".venv/lib/python3.11/site-packages/evil.py", "numpyexample/__pycache__/x.py", "build/b.py"):
        (app / name).parent.mkdir(parents=True, exist_ok=True)
        (app / name).write_text("raise SystemExit\n")
    (app / "numpyexample" / "build").mkdir()
    (app / "numpyexample" / "build" / "kept.py").write_text("")
    folder = folder_app_hash(app)
    assert len(folder) == 64 and int(folder, 16) >= 0
    assert folder_app_hash(app) == folder  # same folder, same hash
    assert folder_app_hash(Path(shutil.copytree(app, tmp_path / "elsewhere"))) == folder  # path-independent
    env = dict(os.environ, FLWR_HOME=str(tmp_path / "flwr_home"), FLWR_TELEMETRY_ENABLED="0")
    built = subprocess.run([str(BIN / "flwr"), "build", "--app", str(app)], cwd=tmp_path, env=env, capture_output=True)
    assert built.returncode == 0, built.stdout + built.stderr
    (fab,) = tmp_path.glob("*.fab")
    assert app_hash(fab) == folder  # what `flwr build` (and so `flwr run`) sends has the folder's hash
    assert "numpyexample/build/kept.py" in zipfile.ZipFile(fab).namelist()
    # the hash is of the files, not of the zip's bytes: another zlib, timestamps or entry order change nothing
    other = _rezip(fab.read_bytes(), compression=zipfile.ZIP_STORED, date=(2001, 2, 3, 4, 5, 6), reverse=True)
    assert other != fab.read_bytes() and fab_app_hash(other) == folder


def test_a_one_byte_change_anywhere_changes_the_app_hash(app: Path) -> None:
    before = folder_app_hash(app)
    client_app = app / "numpyexample" / "client_app.py"
    text = client_app.read_bytes()
    client_app.write_bytes(text[:-1] + bytes([text[-1] ^ 1]))
    assert folder_app_hash(app) != before
    client_app.write_bytes(text)
    assert folder_app_hash(app) == before
    (app / "numpyexample" / "extra.py").write_text("")  # a new (empty) module
    assert folder_app_hash(app) != before
    (app / "numpyexample" / "extra.py").unlink()
    pyproject = app / "pyproject.toml"  # e.g. the dependencies, the components or the run config
    pyproject.write_text(pyproject.read_text().replace("num-server-rounds = 20", "num-server-rounds = 21"))
    assert folder_app_hash(app) != before


def test_app_hash_refuses_what_is_not_one_fab() -> None:
    with pytest.raises(AppHashError, match="not a FAB"):
        fab_app_hash(b"#!/bin/sh\n")
    twice = io.BytesIO()
    with zipfile.ZipFile(twice, "w") as archive, pytest.warns(UserWarning, match="Duplicate name"):
        archive.writestr("pyproject.toml", "a")
        archive.writestr("pyproject.toml", "b")
    with pytest.raises(AppHashError, match="'pyproject.toml' more than once"):
        fab_app_hash(twice.getvalue())
    with pytest.raises(AppHashError, match="no such app folder"):
        app_hash(Path("/nonexistent/app"))
    with pytest.raises(AppHashError, match="64 hex digits"):
        parse_app_hash("abc")
    with pytest.raises(AppHashError, match="64 hex digits"):
        parse_app_hash("a" * 64 + "\n")
    assert parse_app_hash("A" * 64) == "a" * 64


def test_app_hash_cli_prints_the_folders_hash(app: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["app-hash", str(app)]) == 0
    assert capsys.readouterr().out.strip() == folder_app_hash(app)
    assert main(["app-hash", str(app / "missing")]) == 2
    assert "no such app folder or .fab file" in capsys.readouterr().err


# ---------------------------------------------------------------------- the SuperNode hook


def test_check_fab_names_both_hashes(app: Path) -> None:
    from flwr.cli.build import build_fab_from_disk

    fab = build_fab_from_disk(app)
    good = fab_app_hash(fab)
    assert check_fab(fab, "f" * 64, [good]) == good
    with pytest.raises(UnapprovedAppError, match=f"app hash {good} is not approved.*approved: {'0' * 64}"):
        check_fab(fab, "f" * 64, ["0" * 64])
    with pytest.raises(UnapprovedAppError, match="not a FAB"):
        check_fab(b"junk", "f" * 64, [good])


def test_supernode_hook_answers_an_unapproved_fab_with_an_error_and_never_stores_it(
    app: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flower's message loop, stood in for: it fetches the run and its FAB, then stores the FAB.

    Refused: other files; the approved files under a FAB hash, app id or version that is not theirs (the
    ClientApp loads the folder those name); an installed folder of the approved name holding other files.
    """
    import hashlib

    from flwr.app import Message, RecordDict
    from flwr.cli.build import build_fab_from_disk
    from flwr.common.config import get_project_dir
    from flwr.common.constant import ErrorCode
    from flwr.supercore.fab import Fab
    from flwr.supernode import start_client_internal as sci

    from dpfedavg.flower.testing import ensure_task_identity

    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr_home"))
    fab_bytes = build_fab_from_disk(app)
    sha = hashlib.sha256(fab_bytes).hexdigest()
    stored: list[object] = []
    inserted: list[Message] = []
    ensure_task_identity()
    message = Message(RecordDict(), dst_node_id=5, message_type="train")
    run_id = message.metadata.run_id

    def flower_loop(state, object_store, node_config, receive, get_run, get_fab, pull_object, confirm, trusted):
        received, _ = receive()
        run = get_run(received.metadata.run_id)
        stored.append(get_fab(run.fab_hash, received.metadata.run_id))
        return received.metadata.run_id

    def fake_insert(reply, state, store):
        inserted.append(reply)

    monkeypatch.setattr(sci, "_pull_and_store_message", flower_loop)
    monkeypatch.setattr(sci, "_insert_message", fake_insert)
    install_approval([fab_app_hash(fab_bytes)])

    def deliver(content: bytes, *, claimed: str = sha, fab_id: str = "dpfedavg/numpyexample", version: str = "1.0.0"):
        run = SimpleNamespace(fab_hash=claimed, fab_id=fab_id, fab_version=version)
        inserted.clear()
        result = sci._pull_and_store_message(
            state="S", object_store="O", node_config={}, receive=lambda: (message, None),
            get_run=lambda r: run, get_fab=lambda h, r: Fab(h, content, {}),
            pull_object=None, confirm=None, trusted=None,
        )  # fmt: skip
        assert result == run_id
        if not inserted:
            return None
        (reply,) = inserted
        assert reply.has_error() and reply.metadata.reply_to_message_id == message.metadata.message_id
        assert reply.error.code == ErrorCode.INVALID_FAB
        return reply.error.reason

    assert deliver(fab_bytes) is None and len(stored) == 1  # the approved FAB goes on to Flower
    modified = _rezip(fab_bytes, compression=zipfile.ZIP_DEFLATED, date=(1980, 1, 1, 0, 0, 0))
    modified = modified.replace(b"pyproject.toml", b"pyproject.tomm")  # not the approved files
    assert "is not approved by this node's operator" in deliver(modified, claimed=hashlib.sha256(modified).hexdigest())
    assert "its bytes hash to" in deliver(fab_bytes, claimed="e" * 64)
    assert "the run names the app 'dpfedavg/other'" in deliver(fab_bytes, fab_id="dpfedavg/other")
    assert "version '0.9'" in deliver(fab_bytes, version="0.9")
    assert len(stored) == 1  # Flower never got (so never stored nor ran) any of them
    # the folder the ClientApp would install into and load from already holds other files
    from flwr.cli.install import install_from_fab

    folder = get_project_dir("dpfedavg/numpyexample", "1.0.0", sha)
    assert install_from_fab(fab_bytes, None, skip_prompt=True) == folder  # as Flower installs it
    cache = folder / "numpyexample" / "__pycache__"
    cache.mkdir()
    (cache / "client_app.cpython-311.pyc").write_bytes(b"planted")  # Python's cache: removed, rewritten from source
    assert deliver(fab_bytes) is None and len(stored) == 2  # the same files: fine
    assert not cache.exists()
    planted = {  # each is imported before (or instead of) the approved client_app.py
        "numpyexample/client_app.cpython-311-x86_64-linux-gnu.so": "files not in the FAB: ",
        "numpyexample/client_app.pyc": "files not in the FAB: ",
        "numpyexample/client_app.py": "changed: ",
    }
    for name, why in planted.items():
        original = (folder / name).read_bytes() if (folder / name).exists() else None
        (folder / name).write_bytes(b"import os\n")
        reason = deliver(fab_bytes)
        assert f"{folder} already holds another app" in reason and f"{why}{name}" in reason, reason
        if original is None:
            (folder / name).unlink()
        else:
            (folder / name).write_bytes(original)
    (folder / "numpyexample" / "link.py").symlink_to(folder / "pyproject.toml")
    assert "symbolic link numpyexample/link.py" in deliver(fab_bytes)
    (folder / "numpyexample" / "link.py").unlink()
    assert deliver(fab_bytes) is None and len(stored) == 3


def test_supernode_hook_fails_closed_on_an_unknown_flower(monkeypatch: pytest.MonkeyPatch) -> None:
    from flwr.supernode import start_client_internal as sci

    monkeypatch.setattr(sci, "_pull_and_store_message", lambda state, object_store, receive: None)
    with pytest.raises(RuntimeError, match="refusing to start a SuperNode that would run unapproved apps"):
        install_approval(["a" * 64])
    with pytest.raises(ValueError, match="no approved app hash"):
        install_approval([])


def test_supernode_cli_refuses_bad_options_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    flower = ["--superlink", "127.0.0.1:1", "--insecure"]
    assert main(["supernode", "--approved-app-hash", "xyz", *flower]) == 2
    assert "approved app hash 'xyz' is not an app hash" in capsys.readouterr().err
    assert main(["supernode", "--approved-app-hash", "a" * 64, "--allow-runtime-dependency-installation"]) == 2
    assert "--allow-runtime-dependency-installation is not allowed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["supernode", *flower])  # no approved hash: argparse names --approved-app-hash
    assert "--approved-app-hash" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["app-hash", ".", "--insecure"])  # only `supernode` passes options on to Flower


# ---------------------------------------------------------------------- on loopback

CLIENT_MARKER = """

# --- added by the SuperLink's operator: records every process that imports this module ---
import os as _os, sys as _sys
with open(_os.path.join({marker!r}, str(_os.getpid())), "w") as _f:
    _f.write(" ".join(_sys.argv))
"""


@pytest.mark.deployment
@pytest.mark.slow
def test_supernode_started_as_documented_refuses_a_modified_fab(tmp_path: Path) -> None:
    """A SuperLink ships a modified copy of this app to SuperNodes that approved this app: no node runs it.

    The modified ClientApp module records every process that imports it; no ClientApp process does, the node
    logs the mismatch (both hashes), and its error reply reaches the ServerApp, which gets no reply computed by
    the modified code. That the approved app still runs on SuperNodes started this way is checked by
    tests/test_readme_deploy.py, which starts them with the deploy page's step 5.
    """
    from dpfedavg.deploy.loopback import LoopbackFederation

    fab = build_fab(ROOT)  # this repository's app, as `flwr run .` ships it
    approved = fab_app_hash(fab)
    modified, markers = tmp_path / "modified", tmp_path / "markers"
    zipfile.ZipFile(io.BytesIO(fab)).extractall(modified)
    markers.mkdir()
    client_app = modified / "dpfedavg" / "flower" / "client_app.py"
    client_app.write_text(client_app.read_text() + CLIENT_MARKER.format(marker=str(markers)))
    bad = folder_app_hash(modified)
    n, out = 2, tmp_path / "out"
    values = (
        f"num-clients={n} clients-per-round={float(n)} num-rounds=1 dim=10 round-timeout=120.0 "
        f"node-wait-timeout=90.0 output-dir='{out}' run-name='modified'"
    )
    with LoopbackFederation(tmp_path / "fed", n, approved_app_hashes=[approved]) as fed:
        result = fed.run(values, timeout=300, app=modified)
    assert fed.leftover_pids() == []
    assert result.returncode == 0, result.stdout[-3000:]

    # no ClientApp process imported the modified code
    assert [p.read_text() for p in markers.iterdir() if "clientapp" in p.read_text()] == []
    logs = [(tmp_path / "fed" / f"supernode-{i}.log").read_text() for i in range(n)]
    assert not any("Start `flwr-clientapp` process" in log for log in logs), logs
    # the node that was asked named the mismatch, and its error reply reached the ServerApp
    mismatch = f"its app hash {bad} is not approved by this node's operator (approved: {approved})"
    assert any(mismatch in log for log in logs), [log[-2000:] for log in logs]
    assert mismatch in result.stdout, result.stdout[-3000:]
    rows = list(csv.DictReader((out / "modified" / "metrics.csv").open()))
    assert all(r["num_received"] in ("", "0") for r in rows), rows  # no round used a reply


@pytest.mark.parametrize(
    "option", ["--allow-runtime", "--allow-runtime-dep", "--allow-runtime-dependency-installation"]
)
def test_an_abbreviated_refused_option_is_refused_by_the_launcher(
    option: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """argparse takes any unique prefix of an option: ``--allow-runtime`` is Flower's
    ``--allow-runtime-dependency-installation``, and must be refused like it, before a SuperNode starts."""
    from dpfedavg.deploy import approval

    def started(approved: object) -> None:
        raise RuntimeError("the SuperNode was started")

    monkeypatch.setattr(approval, "install_approval", started)
    assert main(["supernode", "--approved-app-hash", "a" * 64, option, "--insecure"]) == 2
    assert "--allow-runtime-dependency-installation is not allowed" in capsys.readouterr().err
