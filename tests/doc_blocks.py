"""The fenced code blocks of the documentation, found with Sybil's Markdown lexer.

A block's fence says whether and how it is tested (see docs/development/testing.md):

* `` ```bash `` / `` ```python ``: run as written by ``tests/test_doc_blocks.py``;
* `` ``` { .bash .run-by test="tests/test_x.py::name" } ``: run as written by that test;
* `` ``` { .bash .no-test reason="..." } ``: not run, for the reason given (its commands are still
  checked statically by ``tests/test_doc_blocks.py``); ``runs="N"`` states the number of runs of the
  sweep it starts.

The fence's info string is either a language word or a Python-Markdown attribute list
(``{ .lang .class key="value" }``), which is what mkdocs renders.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from sybil import Region, Sybil
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SHELL = ("bash", "sh", "shell", "console")
PYTHON = ("python", "py")


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its fence's classes and attributes, its text."""

    path: Path
    line: int
    language: str
    classes: tuple[str, ...]
    attrs: dict[str, str] = field(hash=False)
    source: str

    @property
    def page(self) -> str:
        return str(self.path.relative_to(ROOT))

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def kind(self) -> str:
        """``run`` (run as written here), ``run-by`` (by another test) or ``no-test``."""
        if "no-test" in self.classes:
            return "no-test"
        if "run-by" in self.classes:
            return "run-by"
        return "run"

    @property
    def is_shell(self) -> bool:
        return self.language in SHELL

    @property
    def is_python(self) -> bool:
        return self.language in PYTHON


def parse_info(info: str) -> tuple[str, tuple[str, ...], dict[str, str]]:
    """A fence's info string -> (language, classes, attributes)."""
    info = info.strip()
    if not info.startswith("{"):
        return (info.split()[0] if info else ""), (), {}
    words = shlex.split(info.strip("{} "))
    classes = [w[1:] for w in words if w.startswith(".")]
    attrs = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("."))
    language, classes = (classes[0], classes[1:]) if classes else ("", [])
    return language, tuple(classes), attrs


_LEXER = RawFencedCodeBlockLexer(info_pattern=re.compile(r"(?P<info>[^\n]*)$\n", re.MULTILINE))


def _parser(document):
    for region in _LEXER(document):
        language, classes, attrs = parse_info(region.lexemes["info"])
        source = str(region.lexemes["source"])
        line = document.text.count("\n", 0, region.start) + 1
        block = Block(Path(document.path), line, language, classes, attrs, source)
        yield Region(region.start, region.end, parsed=block, evaluator=_evaluate)


def _evaluate(example) -> None:  # the tests evaluate blocks themselves, with their own set-up
    raise NotImplementedError


SYBIL = Sybil(parsers=[_parser], patterns=["*.md"])


def page_blocks(path: Path) -> list[Block]:
    """Every fenced block of one Markdown file, in order."""
    return [example.parsed for example in SYBIL.parse(path)]


def site_pages() -> list[Path]:
    """Every Markdown page of the site (the results pages included), then the README."""
    return [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]


def all_blocks() -> list[Block]:
    return [block for path in site_pages() for block in page_blocks(path)]


def commands(block: Block) -> list[list[str]]:
    """The block's shell commands as argument lists: comments dropped, ``\\`` continuations joined,
    ``&&`` chains split, leading ``VAR=value`` assignments removed."""
    text = re.sub(r"\\\n\s*", " ", block.source)
    out = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", ";", "||"):
                while current and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", current[0]):
                    current.pop(0)
                if current:
                    out.append(current)
                current = []
            else:
                current.append(word)
    return out
