"""mkdocs hook: the reference pages' generated parts, built from the code at every build.

A page asks for a part with an HTML comment on a line of its own:

* ``<!-- generated: options -->``: the table of every run_config key, from ``dpfedavg.config.OPTIONS``
  (key, paper symbol, default, allowed values, meaning), so the configuration reference cannot drift;
* ``<!-- generated: metrics-columns -->``: ``metrics.csv``'s columns, in order (``RoundStats.columns``);
* ``<!-- generated: help PROGRAM [SUBCOMMAND] -->``: the ``--help`` text of ``run_sim.py``,
  ``python -m dpfedavg.run`` or ``python -m dpfedavg.deploy`` (argparse's own output);
* ``<!-- generated: test-files -->``: every ``tests/test_*.py`` with the first line of its docstring;
* ``<!-- generated: layout -->``: every module of the package with the first line of its docstring.

An unknown marker fails the build. The functions are plain so that tests can call them.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- generated: (?P<what>[^>]*?) -->$", re.M)


def _toml(value: Any) -> str:
    """A default as it is written in ``pyproject.toml`` / ``--run-config``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def options_table() -> str:
    """The Markdown table of every run_config key, from ``dpfedavg.config.OPTIONS``."""
    from dpfedavg.config import OPTIONS

    rows = [
        "| key | symbol | default | allowed | meaning |",
        "|---|---|---|---|---|",
    ]
    for opt in OPTIONS:
        if opt.choices:
            allowed = ", ".join(f"`{_toml(c)}`" for c in opt.choices)
        elif opt.allowed:
            allowed = _cell(opt.allowed)
        else:
            allowed = "`true`, `false`" if opt.kind is bool else opt.kind.__name__
        symbol = "" if opt.symbol in ("", "-") else opt.symbol
        rows.append(
            f'| <span id="{opt.key}"></span>`{opt.key}` | {_cell(symbol)} | `{_toml(opt.default)}` | {allowed} '
            f"| {_cell(opt.help)} |"
        )
    return "\n".join(rows)


def metrics_columns() -> str:
    """``metrics.csv``'s columns for a task with metrics ``<task metrics>``, as one code line."""
    from dpfedavg.io.metrics import RoundStats

    return "`" + ",".join(RoundStats.columns(("<task metrics>",))) + "`"


def _load_run_sim() -> Any:
    spec = importlib.util.spec_from_file_location("run_sim", ROOT / "run_sim.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def help_text(program: str, *args: str) -> str:
    """The ``--help`` output of one of the project's command-line programs (80 columns)."""
    if program == "run_sim.py":
        main = _load_run_sim().main
    elif program == "dpfedavg.run":
        from dpfedavg.run import main
    elif program == "dpfedavg.deploy":
        from dpfedavg.deploy.__main__ import main
    else:
        raise ValueError(f"unknown program {program!r}")
    out = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main([*args, "--help"])
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    return "```text\n" + out.getvalue().rstrip() + "\n```"


def _first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    line = doc.strip().splitlines()[0] if doc.strip() else ""
    return _cell(re.sub(r" \(issue \d+\)", "", line))


def test_files() -> str:
    """A table of the test modules and what each checks (their docstrings)."""
    rows = ["| file | what it checks |", "|---|---|"]
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        rows.append(f"| `tests/{path.name}` | {_first_line(path)} |")
    return "\n".join(rows)


def layout() -> str:
    """A table of the package's modules and packages (their docstrings), in path order."""
    rows = ["| module | what it holds |", "|---|---|"]
    for path in sorted((ROOT / "dpfedavg").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if "__pycache__" in rel.parts:
            continue
        name = str(rel.parent) + "/" if path.name == "__init__.py" else str(rel)
        rows.append(f"| `{name}` | {_first_line(path)} |")
    return "\n".join(rows)


def generate(what: str) -> str:
    """The Markdown for one marker."""
    words = shlex.split(what)
    if words == ["options"]:
        return options_table()
    if words == ["metrics-columns"]:
        return metrics_columns()
    if words == ["test-files"]:
        return test_files()
    if words == ["layout"]:
        return layout()
    if words and words[0] == "help":
        return help_text(*words[1:])
    raise ValueError(f"unknown generated part {what!r}")


def expand(markdown: str) -> str:
    """Every marker of a page replaced by its generated part."""
    return MARKER.sub(lambda m: generate(m.group("what")), markdown)


def on_config(config: Any) -> Any:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return expand(markdown)
