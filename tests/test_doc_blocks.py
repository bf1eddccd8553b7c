"""Every fenced shell and Python block of the documentation runs, or says in its fence why not.

Blocks are found with Sybil's Markdown lexer (``tests/doc_blocks.py``), one test per block, named
``page:line``. Per fence (see docs/development/testing.md):

* plain `` ```bash `` / `` ```python ``: run as written. Bash with ``bash -e`` in a temporary
  folder per page (``run_sim.py`` linked into it, the test environment's ``bin`` first on
  ``PATH``); Python in one namespace per page, in that folder; a block starting with ``>>>`` is a
  doctest.
* ``.run-by test="..."``: the named test exists (it runs the block with the set-up it needs).
* ``.no-test reason="..."``: a reason is given, and what can be checked without running is: every
  ``flwr run`` carries its ``--federation-config`` (unless it names a SuperLink connection), with
  ``num-supernodes`` = ceil(num-clients / clients-per-node), and a run config that validates and
  whose privacy plan holds; every ``python -m dpfedavg`` run config validates; every
  ``python -m dpfedavg.check`` line passes (its app ``.`` is the clone); every
  ``run_sim.py`` line parses; ``runs="N"`` is the sweep's number of runs (computed, not run), and
  the page says ``N runs``.

The README's first block (the project's two commands) gets the static checks; ``tests/test_docs.py``
checks its form.
"""

from __future__ import annotations

import doctest
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import ROOT, Block, all_blocks, commands

from dpfedavg.experiments.sweep import RunOptions

BIN = Path(sys.executable).parent
BLOCKS = [b for b in all_blocks() if b.is_shell or b.is_python]


def _id(block: Block) -> str:
    return f"{block.where}[{block.kind}]"


#: One worker runs a page's blocks, in order, in one folder (a block may use what an earlier one made).
pytestmark = pytest.mark.xdist_group("doc-blocks")


@pytest.fixture(scope="module")
def page_dirs(tmp_path_factory):
    """One working folder (and one Python namespace) per page, shared by its blocks in order."""
    dirs: dict[str, tuple[Path, dict]] = {}

    def get(page: str) -> tuple[Path, dict]:
        if page not in dirs:
            folder = tmp_path_factory.mktemp(page.replace("/", "_").removesuffix(".md"))
            (folder / "run_sim.py").symlink_to(ROOT / "run_sim.py")
            dirs[page] = (folder, {"__name__": "__main__"})
        return dirs[page]

    return get


def _run_bash(block: Block, cwd: Path) -> None:
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", MPLBACKEND="Agg")
    proc = subprocess.run(
        ["bash", "-e", "-c", block.source], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        pytest.fail(
            f"{block.where}: the block failed (exit {proc.returncode}):\n{block.source}\n"
            f"--- output ---\n{(proc.stdout + proc.stderr)[-4000:]}"
        )


def _run_python(block: Block, cwd: Path, namespace: dict, monkeypatch) -> None:
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    if block.source.lstrip().startswith(">>>"):
        test = doctest.DocTestParser().get_doctest(block.source, namespace, block.where, block.page, block.line)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        out: list[str] = []
        runner.run(test, out=out.append, clear_globs=False)
        if runner.failures:
            pytest.fail(f"{block.where}: the doctest failed:\n{''.join(out)}")
        return
    exec(compile(block.source, block.where, "exec"), namespace)


# ------------------------------------------------------------------ static checks of blocks that are not run
def _load_run_sim():
    spec = importlib.util.spec_from_file_location("run_sim_under_test", ROOT / "run_sim.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Counted(Exception):
    def __init__(self, runs: int) -> None:
        self.runs = runs


_RUN_ONLY = tuple(RunOptions.__annotations__)  # how cells run, not what they are


def _run_sim_line(argv: list[str], monkeypatch, tmp_path: Path) -> int | None:
    """Parse a run_sim.py command line with run_sim's own parser; for a synthetic/table1/mechanisms sweep, the
    number of runs it would start (computed by the experiments' cell builders, nothing trained)."""
    from dpfedavg.experiments import mechanisms, synthetic, table1

    module = _load_run_sim()

    def synthetic_stub(out, **kwargs):
        raise _Counted(len(synthetic.synthetic_cells(out, **{k: v for k, v in kwargs.items() if k not in _RUN_ONLY})))

    def table1_stub(out, dataset, **kwargs):
        grid = {k: v for k, v in kwargs.items() if k not in _RUN_ONLY}
        raise _Counted(len(table1.table1_cells(out, dataset, **grid)))

    def mechanisms_stub(out, **kwargs):
        raise _Counted(len(mechanisms.mechanism_cells(out, **{k: v for k, v in kwargs.items() if k not in _RUN_ONLY})))

    monkeypatch.setattr(mechanisms, "run_mechanisms", mechanisms_stub)
    monkeypatch.setattr(synthetic, "run_synthetic", synthetic_stub)
    monkeypatch.setattr(table1, "run_table1", table1_stub)
    monkeypatch.setattr(module, "_cmd_private_tuning", lambda args: None)
    for name in ("_cmd_scale", "_cmd_audit", "_cmd_privacy"):
        monkeypatch.setattr(module, name, lambda args: None)
    argv = [a if not a.startswith("/path/to") else str(tmp_path) for a in argv]
    if "--ray-address" in argv:  # a cluster's address cannot be checked without the cluster
        i = argv.index("--ray-address")
        argv = argv[:i] + argv[i + 2 :]
    if "--out" not in argv and argv and argv[0] in ("synthetic", "table1"):
        argv = [*argv, "--out", str(tmp_path / "out")]
    else:
        argv = [str(tmp_path / "out") if prev == "--out" else a for prev, a in zip(["", *argv[:-1]], argv, strict=True)]
    try:
        module.main(argv)
    except _Counted as counted:
        return counted.runs
    except SystemExit as exit_:
        raise AssertionError(f"run_sim.py {' '.join(argv)}: rejected by its parser (exit {exit_.code})") from None
    return None


def _validate_run_config(text: str, where: str):
    from flwr.common.config import parse_config_args

    from dpfedavg.config import ConfigError, RunConfig
    from dpfedavg.server.run import plan_for
    from dpfedavg.tasks import resolve_task

    overrides = parse_config_args([text])
    try:
        cfg = RunConfig.from_run_config(overrides)
        if ":" not in cfg.task:  # a registered task (a user's module:factory lives on the reader's machine)
            resolve_task(cfg.task)
        plan_for(cfg)
    except ConfigError as err:
        raise AssertionError(f"{where}: --run-config {text!r} is invalid: {err}") from None
    return cfg


def _option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _check_flwr_run(argv: list[str], where: str) -> None:
    positional = [a for a in argv[2:] if not a.startswith("-")]
    run_config = _option(argv, "--run-config")
    federation = _option(argv, "--federation-config")
    positional = [a for a in positional if a not in (run_config, federation)]
    cfg = _validate_run_config(run_config or "", where)
    if len(positional) > 1:  # `flwr run . remote`: a deployment's SuperLink connection, no simulated federation
        return
    assert federation, f"{where}: `flwr run` without --federation-config: {' '.join(argv)}"
    from flwr.common.config import parse_config_args

    nodes = parse_config_args([federation]).get("num-supernodes")
    expected = math.ceil(cfg.num_clients / cfg.clients_per_node)
    assert nodes == expected, (
        f"{where}: num-supernodes={nodes} but num-clients={cfg.num_clients} with clients-per-node="
        f"{cfg.clients_per_node} needs {expected}: {' '.join(argv)}"
    )


def _check_check_line(argv: list[str], where: str, monkeypatch, capsys) -> None:
    """A ``python -m dpfedavg.check`` line passes its own check: the app ``.`` / ``"$DPFEDAVG"`` is this clone; a
    user's ``module:factory`` task, which lives on the reader's machine, is not imported."""
    import dpfedavg.tasks
    from dpfedavg.check import main

    args = [str(ROOT) if a in (".", "$DPFEDAVG") else a for a in argv[3:]]
    real = dpfedavg.tasks.resolve_task
    monkeypatch.setattr(dpfedavg.tasks, "resolve_task", lambda spec: None if ":" in spec else real(spec))
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 0, f"{where}: {' '.join(argv)}: {err}"


def _check_statically(block: Block, monkeypatch, tmp_path: Path, capsys) -> None:
    counts = []
    for argv in commands(block):
        if argv[:2] == ["flwr", "run"]:
            _check_flwr_run(argv, block.where)
        elif argv[:3] == ["python", "-m", "dpfedavg.check"]:
            _check_check_line(argv, block.where, monkeypatch, capsys)
        elif argv[:3] == ["python", "-m", "dpfedavg"]:
            _validate_run_config(_option(argv, "--run-config") or "", block.where)
        elif argv[:2] == ["python", "run_sim.py"]:
            runs = _run_sim_line(argv[2:], monkeypatch, tmp_path)
            if runs is not None:
                counts.append(runs)
    if "runs" in block.attrs:
        stated = int(block.attrs["runs"])
        assert counts and all(c == stated for c in counts), f"{block.where}: runs={stated}, the sweeps have {counts}"
        assert f"{stated} runs" in block.path.read_text(), f"{block.page} should say '{stated} runs'"


@pytest.mark.parametrize("block", BLOCKS, ids=_id)
def test_doc_block(block: Block, page_dirs, monkeypatch, tmp_path, capsys) -> None:
    is_readme_contract = block.page == "README.md" and block is next(b for b in BLOCKS if b.page == "README.md")
    if block.kind == "run-by":
        test = block.attrs.get("test", "")
        file, _, name = test.partition("::")
        assert file and (ROOT / file).is_file(), f"{block.where}: run-by test={test!r}: no such test file"
        assert not name or f"def {name}(" in (ROOT / file).read_text(), f"{block.where}: no test {test}"
        assert block.page in (ROOT / file).read_text(), f"{block.where}: {file} does not read {block.page}"
    elif block.kind == "no-test" or is_readme_contract:
        assert is_readme_contract or block.attrs.get("reason", "").strip(), f"{block.where}: no-test without a reason"
        if block.is_shell:
            _check_statically(block, monkeypatch, tmp_path, capsys)
    elif block.is_shell:
        _run_bash(block, page_dirs(block.page)[0])
    else:
        cwd, namespace = page_dirs(block.page)
        _run_python(block, cwd, namespace, monkeypatch)


def test_every_block_says_how_it_is_tested() -> None:
    """A shell or Python block with an unknown marker, or a run-by without its test, fails here."""
    bad = [
        b.where
        for b in BLOCKS
        if set(b.classes) - {"no-test", "run-by"} or (b.kind == "run-by" and "test" not in b.attrs)
    ]
    assert bad == []


def test_the_static_checks_catch_stale_commands(monkeypatch, tmp_path, capsys) -> None:
    """An unknown key, a missing federation config, a wrong SuperNode count, a bad run_sim flag,
    a stated run count that is wrong: each fails."""

    def block(source: str, **attrs: str) -> Block:
        return Block(ROOT / "docs" / "x.md", 1, "bash", ("no-test",), {"reason": "r", **attrs}, source)

    fed = '--federation-config "num-supernodes=100 client-resources-num-cpus=1"'
    bad = [
        block(f'flwr run . --stream {fed} --run-config "no-such-key=1"'),
        block('flwr run . --stream --run-config "num-rounds=3"'),
        block('flwr run . --stream --federation-config "num-supernodes=7" --run-config "num-clients=10"'),
        block(f"flwr run . --stream {fed} --run-config \"algorithm='adaptive-clip' clip-count-stddev=0.1\""),
        block("python run_sim.py synthetic --no-such-flag"),
        block("python run_sim.py synthetic --algorithms clip norm", runs="107"),
        block('python -m dpfedavg.check . --federation-config "num-supernodes=7" --run-config "num-clients=10"'),
        block('python -m dpfedavg.check . --run-config "num-round=3"'),
    ]
    for b in bad:
        with pytest.raises(AssertionError):
            _check_statically(b, monkeypatch, tmp_path, capsys)
    _check_statically(block(f'flwr run . --stream {fed} --run-config "num-rounds=3"'), monkeypatch, tmp_path, capsys)
    good_check = block(f'python -m dpfedavg.check . {fed} --run-config "num-rounds=3"')
    _check_statically(good_check, monkeypatch, tmp_path, capsys)
