"""The README stays true: its two commands, the CI entry point, the config table, its Python snippet."""

from __future__ import annotations

import re
from pathlib import Path

from dpfedavg.config import OPTIONS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_starts_with_exactly_two_commands_and_ci_runs_the_second() -> None:
    first_block = README.split("```bash\n", 1)[1].split("```", 1)[0]
    assert README.index("```bash") < README.index("\n## ")  # before any section
    commands = [line for line in first_block.splitlines() if line.strip()]
    assert len(commands) == 2
    assert "flwr run ." in commands[0] and "pip install -e ." in commands[0]
    assert "pytest" in commands[1] and ".[test]" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci.splitlines()


def test_every_config_key_is_documented() -> None:
    table = README.split("## Configuration", 1)[1]
    for opt in OPTIONS:
        assert f"| `{opt.key}` |" in table, opt.key


def test_strategy_in_isolation_snippet_runs(capsys) -> None:
    snippet = next(b for b in _code_blocks("python") if "InProcessGrid" in b)
    exec(compile(snippet, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()
