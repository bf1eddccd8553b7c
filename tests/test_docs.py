"""The README and the documentation site stay true.

* The README is the front door: at most 150 lines, its first block is the project's two commands
  (``.ci/run`` runs the second), its links point at files that exist.
* ``mkdocs build --strict`` builds the site: a dead link or anchor, a missing page or a page left
  out of the navigation fails (checked on a copy with one of each planted).
* The configuration reference is generated from ``dpfedavg.config.OPTIONS`` and lists every key;
  a page that links a key the package no longer has fails.
* User pages speak to users: no issue numbers, no history, no "this machine" (the benchmarks page
  and the changelog excepted).

The blocks of every page are run or checked by ``tests/test_doc_blocks.py``.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from dpfedavg.config import OPTIONS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent


def _hook():
    spec = importlib.util.spec_from_file_location("docs_hook", DOCS / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ README
def test_readme_starts_with_exactly_two_commands_and_ci_runs_the_second() -> None:
    first_block = README.split("```bash\n", 1)[1].split("```", 1)[0]
    assert README.index("```bash") < README.index("\n## ")  # before any section
    commands = [line for line in first_block.splitlines() if line.strip()]
    assert len(commands) == 2
    assert "flwr run ." in commands[0] and "pip install -e ." in commands[0]
    assert "pytest" in commands[1] and ".[test]" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci.splitlines()


def test_readme_is_short_and_its_links_resolve() -> None:
    import markdown

    assert len(README.splitlines()) <= 150

    class Links(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.targets: list[str] = []

        def handle_starttag(self, tag, attrs) -> None:
            attrs = dict(attrs)
            if tag == "a" and attrs.get("href"):
                self.targets.append(attrs["href"])
            if tag == "img" and attrs.get("src"):
                self.targets.append(attrs["src"])

    links = Links()
    links.feed(markdown.markdown(README))
    local = [t.split("#")[0] for t in links.targets if "://" not in t and not t.startswith("#")]
    assert local, "the README links the documentation"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert missing == []


# ------------------------------------------------------------------ the site builds
def _mkdocs(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "mkdocs"), "build", "--strict", "--config-file", str(root / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": f"{BIN}:/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": str(site.parent)},
    )


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    result = _mkdocs(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    page = (tmp_path / "site" / "reference" / "configuration" / "index.html").read_text()
    for opt in OPTIONS:
        assert f'id="{opt.key}"' in page, opt.key


def test_mkdocs_strict_fails_on_a_dead_link_a_dead_anchor_and_a_page_left_out(tmp_path: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(DOCS, root / "docs")
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    for name in ("dpfedavg", "run_sim.py", "tests"):
        (root / name).symlink_to(ROOT / name)
    quickstart = root / "docs" / "getting-started" / "quickstart.md"
    quickstart.write_text(
        quickstart.read_text() + "\n[gone](../no-such-page.md) [no anchor](install.md#no-such-heading)\n"
    )
    (root / "docs" / "orphan.md").write_text("# Not in the navigation\n")
    result = _mkdocs(root, tmp_path / "site")
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert "no-such-page.md" in out and "no-such-heading" in out and "orphan.md" in out, out


# ------------------------------------------------------------------ the configuration reference
def test_the_configuration_reference_is_generated_from_the_options() -> None:
    assert "<!-- generated: options -->" in (DOCS / "reference" / "configuration.md").read_text()
    table = _hook().options_table()
    for opt in OPTIONS:
        assert f"`{opt.key}`" in table, opt.key
    assert table.count("\n") == len(OPTIONS) + 1  # header, rule, one row per key


def test_an_unknown_generated_part_fails_the_build() -> None:
    with pytest.raises(ValueError, match="unknown generated part"):
        _hook().expand("text\n<!-- generated: no-such-part -->\n")


def test_every_key_a_page_names_exists() -> None:
    """A page linking `key` to the configuration reference names a key the package has."""
    keys = {opt.key for opt in OPTIONS}
    named = {
        (path.relative_to(ROOT).as_posix(), key)
        for path in DOCS.rglob("*.md")
        for key in re.findall(r"\[`([a-z0-9-]+)`\]\([./]*(?:reference/)?configuration\.md", path.read_text())
    }
    assert named, "pages link keys to the configuration reference"
    assert [(page, key) for page, key in sorted(named) if key not in keys] == []


# ------------------------------------------------------------------ user pages speak to users
HISTORY = [
    r"\bissue #?\d+",
    r"\bbefore the (privacy )?fix\b",
    r"\bold default\b",
    r"\bthis machine\b",
    r"\bload average\b",
    r"\bwhat else had to change\b",
    r"(?-i:\bBENCHMARKS\.md\b)",
]
NOT_USER_PAGES = {"development/benchmarks.md", "changelog.md"}


@pytest.mark.parametrize(
    "path", [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"], ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_user_pages_do_not_tell_the_projects_history(path: Path) -> None:
    rel = path.relative_to(DOCS).as_posix() if DOCS in path.parents else path.name
    if rel in NOT_USER_PAGES or rel.startswith("results/"):
        return
    text = path.read_text()
    found = [m.group(0) for pattern in HISTORY for m in re.finditer(pattern, text, flags=re.I)]
    assert found == [], f"{rel}: {found}"
