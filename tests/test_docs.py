"""The README and the documentation site stay true.

* The README is the front door: at most 150 lines, its first block is the project's two commands
  (``.ci/run`` runs the second), its links point at files that exist.
* ``mkdocs build --strict`` builds the site: a dead link or anchor, a missing page or a page left
  out of the navigation fails (checked on a copy with one of each planted).
* The configuration reference is generated from `dpfedavg.config.OPTIONS` and lists every key;
  a page that links a key the package no longer has fails.
* The built site shows no raw Sphinx roles (class, meth, func... between colons) and no RST double backticks: the
  docstrings are written for the site's renderer (mkdocstrings, Markdown); no code span shows a backslash before a
  pipe (in a table a code span's pipe needs none).
* The privacy overview, the configuration reference and the quickstart fit a phone: in headless Chromium at 390 px
  no page is wider than the screen and nothing in the text is cut off; wide tables and code scroll in their own box
  (``tools/site_overflow.py``; checked on a planted page too; skipped, saying so, where no Chromium is installed).
* The command-line reference has a section for every command of the three programs, its flags in a
  table read from the program's parser.
* The Performance page's numbers are the measurement log's.
* User pages speak to users: no issue numbers, no history, no "this machine" (the benchmarks page
  and the changelog excepted).

The blocks of every page are run or checked by ``tests/test_doc_blocks.py``.
"""

from __future__ import annotations

import importlib.util
import itertools
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


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _hook():
    return _load(DOCS / "hooks" / "reference.py", "docs_hook")


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


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for this module's tests (`mkdocs build --strict`)."""
    out = tmp_path_factory.mktemp("built") / "site"
    result = _mkdocs(ROOT, out)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def test_mkdocs_build_strict(site: Path) -> None:
    page = (site / "reference" / "configuration" / "index.html").read_text()
    for opt in OPTIONS:
        assert f'id="{opt.key}"' in page, opt.key


def test_the_site_renders_math_and_diagrams(site: Path) -> None:
    """Formulas reach MathJax as arithmatex spans (inline and display), MathJax and its configuration are
    loaded, and the Mermaid fences become diagrams the theme draws: at least four (a round, who sees what, a
    deployment's hosts and keys, the node's checks)."""
    round_page = (site / "explanation" / "one-round" / "index.html").read_text()
    assert '<span class="arithmatex">' in round_page and '<div class="arithmatex">' in round_page
    assert "assets/mathjax.js" in round_page and "mathjax@3" in round_page
    diagrams = {
        page.relative_to(site).as_posix(): page.read_text().count('<pre class="mermaid">')
        for page in site.rglob("*.html")
    }
    assert sum(diagrams.values()) >= 4, diagrams
    for page in ("explanation/one-round/index.html", "privacy/index.html", "how-to/deploy/index.html"):
        assert diagrams[page] >= 1, page
    assert "```mermaid" not in "".join(p.read_text() for p in site.rglob("*.html"))


class _Text(HTMLParser):
    """The text of a page as a reader sees it (scripts and the search index left out), `<pre>` apart."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.text: list[str] = []
        self.pre: list[str] = []
        self._skip = 0
        self._in_pre = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self._skip += tag in ("script", "style")
        self._in_pre += tag == "pre"

    def handle_endtag(self, tag: str) -> None:
        self._skip -= tag in ("script", "style") and self._skip > 0
        self._in_pre -= tag == "pre" and self._in_pre > 0

    def handle_data(self, data: str) -> None:
        if not self._skip:
            (self.pre if self._in_pre else self.text).append(data)


ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|data|attr|exc|obj|const|ref|term):`?")
DOUBLE = re.compile(r"(?<!`)``(?!`)(?:[^`\n]*(?<!`)``(?!`))?")  # ``x`` (or a lone ``), not a fence


def raw_markup(html: str) -> list[str]:
    """Sphinx roles, RST double backticks (a Markdown fence's three are fine) and `~a.b` cross-reference
    residue, as a reader of the page would see them."""
    page = _Text()
    page.feed(html)
    text, pre = "".join(page.text), "".join(page.pre)
    found = [m.group(0) for m in ROLE.finditer(text + pre)]
    everything = text + pre
    found += [everything[max(m.start() - 20, 0) : m.end() + 20] for m in re.finditer(DOUBLE, everything)]
    found += [m.group(0) for m in re.finditer(r"(?<![\w/])~[a-z_]+\.[\w.]+", text)]
    return found


def test_raw_markup_is_found_in_a_page_rendered_from_rst() -> None:
    tick = "`"  # kept apart so that a script converting roles in the sources leaves this test alone
    html = (
        "<p>Raises <code>ConfigError</code>; see :class:<code>~dpfedavg.config.RunConfig</code> and :meth:"
        + tick
        + "from_run_config"
        + tick
        + ", ``sampling_rate``.</p><pre>```python</pre><script>var a = ':class:'</script>"
    )
    found = raw_markup(html)
    assert found[:2] == [":class:", ":meth:" + tick] and found[3:] == ["~dpfedavg.config.RunConfig"]
    assert "``sampling_rate``" in found[2]
    assert raw_markup("<p>See <code>RunConfig</code>, <code>from_run_config()</code>.</p><pre>```</pre>") == []


def test_the_built_site_shows_no_raw_sphinx_roles_or_double_backticks(site: Path) -> None:
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 30
    found = {page.relative_to(site).as_posix(): markup for page in pages if (markup := raw_markup(page.read_text()))}
    assert found == {}


def test_no_code_span_shows_an_escaped_pipe(site: Path) -> None:
    """Python-Markdown keeps a backslash before a pipe inside a table's code span (it needs none there)."""
    found = {
        page.relative_to(site).as_posix(): hits
        for page in sorted(site.rglob("*.html"))
        if (hits := re.findall(r"<code>[^<]*\\\|[^<]*</code>", page.read_text()))
    }
    assert found == {}


# ------------------------------------------------------------------ the site on a phone (headless Chromium)
OVERFLOW = _load(ROOT / "tools" / "site_overflow.py", "site_overflow")
needs_chromium = pytest.mark.skipif(
    OVERFLOW.find_chromium() is None,
    reason="no Chromium binary (chromium, chromium-browser, google-chrome or $CHROMIUM): "
    "the phone-width check needs one (apt-get install chromium)",
)


@needs_chromium
def test_the_privacy_configuration_and_quickstart_pages_fit_a_phone(site: Path) -> None:
    results = OVERFLOW.check(site, OVERFLOW.PAGES, 390)
    assert [r.page for r in results] == list(OVERFLOW.PAGES)
    assert [r.line() for r in results if r.overflows] == []
    assert all(r.client_width == r.inner_width == 390 for r in results)


@needs_chromium
def test_the_phone_check_finds_a_page_wider_than_a_phone_and_text_cut_off(tmp_path: Path) -> None:
    head = '<!doctype html><meta name="viewport" content="width=device-width,initial-scale=1"><body><article>'
    pages = {
        "wide.html": '<table style="width:1000px"><tr><td id="planted">wide</td></tr></table>',
        "cut.html": '<div id="box" style="overflow:hidden;width:200px"><span style="display:inline-block;'
        'width:400px">cut</span></div>',
        "scrolls.html": '<div style="overflow-x:auto"><table style="width:1000px"><tr><td>wide</td></tr></table></div>',
    }
    for name, body in pages.items():
        (tmp_path / name).write_text(head + body + "</article></body>")
    wide, cut, scrolls = OVERFLOW.check(tmp_path, tuple(pages), 390)
    assert wide.overflows and wide.scroll_width >= 1000 and "td#planted" in wide.line()
    assert cut.overflows and cut.scroll_width == 390 and "span in div#box" in cut.line()
    assert not scrolls.overflows and scrolls.scroll_width == 390 and len(scrolls.scrolls) == 1


def test_the_site_has_a_logo_a_repository_link_and_a_dark_mode(site: Path) -> None:
    import tomllib

    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python/name:", ""))
    schemes = {p["scheme"] for p in config["theme"]["palette"]}
    assert schemes == {"default", "slate"} and all("toggle" in p for p in config["theme"]["palette"])
    assert (DOCS / config["theme"]["logo"]).read_text().lstrip().startswith("<svg")
    home = (site / "index.html").read_text()
    assert f'href="{config["repo_url"]}"' in home and "md-logo" in home and "logo.svg" in home
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("urls", {})
    for name in ("Repository", "Source", "repository", "source"):
        if name in urls:  # the site links the repository the package's metadata names
            assert config["repo_url"].rstrip("/") == urls[name].rstrip("/")


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


def test_the_configuration_keys_are_grouped_each_key_once() -> None:
    hook = _hook()
    groups = hook.option_groups()
    assert [title for title, _, _ in groups][:5] == ["Training", "Privacy", "Federation", "Output", "Deployment"]
    keys = [opt.key for _, _, options in groups for opt in options]
    assert sorted(keys) == sorted(opt.key for opt in OPTIONS) and len(keys) == len(set(keys))
    page = hook.options_tables()
    assert [line for line in page.splitlines() if line.startswith("### ")] == [f"### {t}" for t, _, _ in groups]
    assert page.count("| key | default | meaning |") == len(groups)
    assert "docs: " not in page and "README" not in page  # pointers are links, no notes for maintainers
    with pytest.raises(ValueError, match="in no group"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(hook, "OPTION_GROUPS", hook.OPTION_GROUPS[1:])
            hook.option_groups()


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


# ------------------------------------------------------------------ the command-line reference
def test_every_command_has_a_section_on_the_command_line_page() -> None:
    hook = _hook()
    page = (DOCS / "reference" / "cli.md").read_text()
    commands = hook.every_command()
    assert ("run_sim.py", "synthetic") in commands and ("dpfedavg.deploy", "supernode") in commands
    assert [c for c in commands if f"<!-- generated: cli {' '.join(c)} -->" not in page] == []
    assert "<!-- generated: help" not in page  # no raw --help dumps


@pytest.mark.parametrize("command", [("dpfedavg",), ("run_sim.py", "table1"), ("dpfedavg.deploy", "supernode")])
def test_the_flags_table_lists_every_flag_of_the_parser(command: tuple[str, ...]) -> None:
    hook = _hook()
    table = hook.cli_reference(*command)
    flags = [f for a in hook.parser_of(*command)._actions for f in a.option_strings if f not in ("-h", "--help")]
    assert flags
    rows = [line for line in table.splitlines() if line.startswith("| `-")]
    assert len(rows) == len(hook.parser_of(*command)._actions) - 1  # one row per action but --help
    assert [f for f in flags if f"`{f}`" not in table] == []
    assert "``" not in table.replace("```", "")


def test_a_subcommand_the_program_does_not_have_fails_the_build() -> None:
    with pytest.raises(ValueError, match="has no subcommand 'no-such'; it has synthetic"):
        _hook().generate("cli run_sim.py no-such")


# ------------------------------------------------------------------ the performance page
def _section(markdown: str, anchor: str) -> str:
    """The text of the `##`/`###` section of a page whose heading slug is `anchor`."""
    from markdown.extensions.toc import slugify

    parts = re.split(r"^###? (.+)$", markdown, flags=re.M)
    for heading, body in zip(parts[1::2], parts[2::2], strict=True):
        if slugify(heading, "-") == anchor:
            return body
    raise AssertionError(f"no section #{anchor}")


def test_the_performance_numbers_are_the_measurement_logs() -> None:
    performance = _hook()._performance()
    log = (DOCS / "development" / "benchmarks.md").read_text()
    assert "<!-- generated: performance scale -->" in (DOCS / "performance.md").read_text()
    for name, m in performance.MEASUREMENTS.items():
        sections = "".join(_section(log, anchor) for _, anchor in m.sources)
        values = [f"{y:g}" for s in m.series for _, y in s.points]
        values += [v for row in m.rows for cell in row for v in re.findall(r"\d+\.\d+x?", cell)]
        assert [v for v in values if v not in sections] == [], name
        assert "<svg" in performance.generate(name)


# ------------------------------------------------------------------ long pages start with a summary
#: Pages that are not guides: the reference, the logs, and the architecture page (drawn by its own maintainers).
NOT_GUIDES = ("reference/", "development/", "results/", "changelog.md", "architecture.md")


def _prose_words(text: str) -> int:
    return len(re.sub(r"^```.*?^```", "", text, flags=re.M | re.S).split())


@pytest.mark.parametrize("path", sorted(DOCS.rglob("*.md")), ids=lambda p: p.relative_to(DOCS).as_posix())
def test_every_long_guide_page_starts_with_a_summary_of_at_most_five_lines(path: Path) -> None:
    rel = path.relative_to(DOCS).as_posix()
    text = path.read_text()
    if rel.startswith(NOT_GUIDES) or _prose_words(text) <= 800:
        return
    lines = text.splitlines()
    assert lines[0].startswith("# ") and lines[2] == '!!! abstract "In short"', f"{rel}: no summary under the title"
    body = list(itertools.takewhile(lambda line: line.startswith("    "), lines[3:]))
    assert 1 <= len(body) <= 5, f"{rel}: the summary has {len(body)} lines"


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
