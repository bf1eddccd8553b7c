"""mkdocs hook: the reference pages' generated parts, built from the code at every build.

A page asks for a part with an HTML comment on a line of its own:

* `<!-- generated: options -->`: a table per group (`OPTION_GROUPS`: training, privacy, federation, output,
  deployment, task-specific) of every run_config key, from `dpfedavg.config.OPTIONS` (key, paper symbol,
  default, allowed values, meaning), so the configuration reference cannot drift;
* `<!-- generated: metrics-columns -->`: `metrics.csv`'s columns, in order (`RoundStats.columns`);
* `<!-- generated: cli PROGRAM [SUBCOMMAND] -->`: the usage line and a table of the flags (or of the
  subcommands) of `run_sim.py`, `python -m dpfedavg.check`, `python -m dpfedavg` or
  `python -m dpfedavg.deploy`, read from the program's own argparse parser;
* `<!-- generated: test-files -->`: every `tests/test_*.py` with the first line of its docstring;
* `<!-- generated: layout -->`: every module of the package with the first line of its docstring;
* `<!-- generated: performance NAME -->`: a table and a chart of one set of measurements (`performance.py`).

An unknown marker fails the build. The functions are plain so that tests can call them.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import shlex
import sys
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- generated: (?P<what>[^>]*?) -->$", re.M)


def _toml(value: Any) -> str:
    """A default as it is written in `pyproject.toml` / `--run-config`."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


#: The configuration reference's groups: (heading, what the keys are for, the keys in the page's order). Every key of
#: `dpfedavg.config.OPTIONS` is in exactly one group; a key in none (or two) fails the build.
OPTION_GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "Training",
        "The task and the optimization: what every run sets first.",
        ("task", "num-rounds", "local-steps", "local-lr", "lr-decay", "server-lr", "server-momentum", "seed"),
    ),
    (
        "Privacy",
        "The bound on each update, the noise and its accounting, the mode, the audit.",
        (
            "algorithm", "clip", "epsilon", "delta", "noise-multiplier", "accountant", "max-epsilon",
            "noise-placement", "secure-noise", "diagnostics", "noise-mechanism", "bands", "participation",
            "max-participations", "strategy-coefficients", "target-quantile", "clip-lr", "clip-count-stddev",
            "clip-range-factor", "canary-clients",
        ),
    ),
    (
        "Federation",
        "Who takes part: the clients, the expected cohort, the clients each SuperNode hosts.",
        ("num-clients", "clients-per-round", "sampling", "clients-per-node"),
    ),
    (
        "Output",
        "Where the results go, what is written and how a run resumes.",
        ("output-dir", "run-name", "eval-every", "save-trajectory", "checkpoint-every", "resume"),
    ),
    (
        "Deployment",
        "Waiting for SuperNodes and replies, failing fast, secure aggregation.",
        (
            "node-wait-timeout", "round-timeout", "max-failed-fraction", "secure-aggregation",
            "secagg-quantization-bits", "secagg-modulus-bits", "secagg-clip-stds", "secagg-num-shares",
            "secagg-reconstruction-threshold", "secagg-timeout",
        ),
    ),
    (
        "Task-specific",
        "Read only by the tasks named in each row (the quadratic, the real-data and the torch tasks).",
        (
            "init", "dim", "data-dir", "cache-dir", "data-seed", "weight-decay", "feature-image-size", "backend",
            "device", "torch-dtype", "torch-compile", "local-batch-size",
        ),
    ),
)  # fmt: skip

_DOCS_PATH = re.compile(r"\(?docs: ([\w/.-]+\.md)\)?")


def _page_title(rel: str) -> str:
    """The first heading of ``docs/<rel>``."""
    text = (ROOT / "docs" / rel).read_text()
    return next((line[2:].strip() for line in text.splitlines() if line.startswith("# ")), rel)


def _help(text: str) -> str:
    """A key's help for the page: a ``docs: page.md`` pointer becomes a link to that page, under its title."""
    return _DOCS_PATH.sub(lambda m: f"(see [{_page_title(m.group(1))}](../{m.group(1)}))", _cell(text))


def option_groups() -> list[tuple[str, str, list[Any]]]:
    """`OPTION_GROUPS` with the options themselves; raises if a key is in no group or in two."""
    from dpfedavg.config import OPTIONS

    by_key = {opt.key: opt for opt in OPTIONS}
    listed = [key for _, _, keys in OPTION_GROUPS for key in keys]
    missing = sorted(set(by_key) - set(listed))
    twice = sorted({key for key in listed if listed.count(key) > 1})
    unknown = sorted(set(listed) - set(by_key))
    if missing or twice or unknown:
        raise ValueError(f"OPTION_GROUPS: keys in no group {missing}, in two {twice}, unknown {unknown}")
    return [(title, intro, [by_key[key] for key in keys]) for title, intro, keys in OPTION_GROUPS]


def options_tables() -> str:
    """The configuration reference: one heading and table per group of `option_groups()`."""
    parts = []
    for title, intro, options in option_groups():
        parts += [f"### {title}", "", intro, "", '<div class="dp-options" markdown>', "", options_table(options), "",
                  "</div>", ""]  # fmt: skip
    return "\n".join(parts)


def options_table(options: Any = None) -> str:
    """The Markdown table of run_config keys (default: every key of `dpfedavg.config.OPTIONS`, in order).

    Three columns, so that it reads at the page's normal width: the key (with the paper's symbol
    under it), the default, and the meaning followed by the allowed values.
    """
    from dpfedavg.config import OPTIONS

    rows = [
        "| key | default | meaning |",
        "|---|---|---|",
    ]
    for opt in OPTIONS if options is None else options:
        if opt.choices:
            allowed = ", ".join(f"`{_toml(c)}`" for c in opt.choices)
        elif opt.allowed:
            allowed = _cell(opt.allowed)
        else:
            allowed = "`true`, `false`" if opt.kind is bool else opt.kind.__name__
        symbol = "" if opt.symbol in ("", "-") else f"<br>*{_cell(opt.symbol)}*"
        rows.append(
            f'| <span id="{opt.key}"></span>`{opt.key}`{symbol} | `{_toml(opt.default)}` '
            f"| {_help(opt.help)}<br>**Allowed:** {allowed} |"
        )
    return "\n".join(rows)


def metrics_columns() -> str:
    """`metrics.csv`'s columns for a task with metrics `<task metrics>`, as one code line."""
    from dpfedavg.io.metrics import RoundStats

    return "`" + ",".join(RoundStats.columns(("<task metrics>",))) + "`"


def _load_run_sim() -> Any:
    spec = importlib.util.spec_from_file_location("run_sim", ROOT / "run_sim.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROGRAMS = ("dpfedavg.check", "dpfedavg", "run_sim.py", "dpfedavg.deploy")


class _Parsed(Exception):
    """Raised in place of parsing, carrying the parser a program's `main` built."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _main_of(program: str) -> Any:
    if program == "run_sim.py":
        return _load_run_sim().main
    if program == "dpfedavg":
        from dpfedavg.__main__ import main

        return main
    if program == "dpfedavg.check":
        from dpfedavg.check import main

        return main
    if program == "dpfedavg.deploy":
        from dpfedavg.deploy.__main__ import main

        return main
    raise ValueError(f"unknown program {program!r}; known: {', '.join(PROGRAMS)}")


def parser_of(program: str, *subcommands: str) -> argparse.ArgumentParser:
    """The argparse parser that `main` of a program builds (its subcommand's, if named), without running it."""

    def stop(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Parsed(self)

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", stop),
        mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop),
    ):
        try:
            _main_of(program)([])
        except _Parsed as parsed:
            parser = parsed.parser
        else:  # pragma: no cover - every program parses its arguments
            raise ValueError(f"{program} did not build a parser")
    for name in subcommands:
        choices = _subcommands(parser)
        if name not in choices:
            raise ValueError(f"{parser.prog} has no subcommand {name!r}; it has {', '.join(choices)}")
        parser = choices[name]
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _subcommand_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def _md(text: str) -> str:
    """argparse help (which may use RST double backticks) as one Markdown table cell; `<` and `>`
    outside code spans are shown, not read as HTML."""
    text = re.sub(r"``(.+?)``", r"`\1`", " ".join(text.split()))
    parts = text.split("`")
    parts[::2] = [p.replace("<", "&lt;").replace(">", "&gt;") for p in parts[::2]]
    return _cell("`".join(parts))


def _without_default(help_text: str) -> str:
    """A flag's help without the "(default X)" its default column already shows."""
    text = re.sub(r"\s*\(default:? [^()]*\)\s*$", "", help_text.strip())
    return "" if re.fullmatch(r"default:? .*", text) else text


def _usage(parser: argparse.ArgumentParser) -> str:
    """The command with its required arguments; `[options]` stands for the flags in the table."""
    formatter = parser._get_formatter()
    words = [parser.prog]
    optional = False
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            words.append("COMMAND")
        elif not action.option_strings:
            words.append(formatter._format_args(action, action.dest.upper()))
        elif action.required:
            words.append(f"{action.option_strings[-1]} {formatter._format_args(action, action.dest.upper())}")
        else:
            optional = True
    return " ".join(words + (["[options]"] if optional else []))


def _argument(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None:
        return ", ".join(f"`{c}`" for c in action.choices)
    formatter = parser._get_formatter()
    default = action.dest.upper() if action.option_strings else action.dest
    text = formatter._format_args(action, default)
    repeat = " (repeatable)" if isinstance(action, argparse._AppendAction) else ""
    return f"`{text}`{repeat}"


def _default(action: argparse.Action) -> str:
    if action.required or (not action.option_strings and action.nargs not in ("?", "*")):
        return "required"
    if action.nargs == 0 or action.default in (None, [], "", argparse.SUPPRESS):
        return ""
    values = action.default if isinstance(action.default, list | tuple) else [action.default]
    return " ".join(f"`{v}`" for v in values)


def cli_reference(program: str, *subcommands: str) -> str:
    """The usage line and a table of one command's flags, or of its subcommands, from its parser."""
    parser = parser_of(program, *subcommands)
    lines = ["```text", _usage(parser), "```", ""]
    subs = _subcommand_help(parser)
    if subs:
        lines += ["| command | what it does |", "|---|---|"]
        lines += [f"| `{name}` | {_md(text)} |" for name, text in subs.items()]
        return "\n".join(lines)
    formatter = parser._get_formatter()
    lines += ["| flag | value | default | meaning |", "|---|---|---|---|"]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        flags = ", ".join(f"`{f}`" for f in action.option_strings) or f"`{action.dest}`"
        meaning = _without_default(formatter._expand_help(action)) if action.help else ""
        lines.append(f"| {flags} | {_argument(action, parser)} | {_default(action)} | {_md(meaning)} |")
    return "\n".join([*lines[:4], '<div class="dp-flags" markdown>', "", *lines[4:], "", "</div>"])


def every_command() -> list[tuple[str, ...]]:
    """Every (program, subcommand...) the programs have, in the order they declare them."""
    out: list[tuple[str, ...]] = []

    def walk(path: tuple[str, ...]) -> None:
        out.append(path)
        for name in _subcommands(parser_of(*path)):
            walk((*path, name))

    for program in PROGRAMS:
        walk((program,))
    return out


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


def _performance() -> Any:
    """The Performance page's measurements (`performance.py` beside this hook)."""
    if "docs_performance" not in sys.modules:
        spec = importlib.util.spec_from_file_location("docs_performance", Path(__file__).with_name("performance.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["docs_performance"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["docs_performance"]


def generate(what: str) -> str:
    """The Markdown for one marker."""
    words = shlex.split(what)
    if words == ["options"]:
        return options_tables()
    if words == ["metrics-columns"]:
        return metrics_columns()
    if words == ["test-files"]:
        return test_files()
    if words == ["layout"]:
        return layout()
    if words and words[0] == "cli":
        return cli_reference(*words[1:])
    if words and words[0] == "performance":
        return _performance().generate(*words[1:])
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
