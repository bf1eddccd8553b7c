"""The package's import structure: no cycles (lazy imports included), light modules stay light."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path


def test_the_server_core_and_the_batched_engine_import_no_flower() -> None:
    modules = "dpfedavg.engines.batched, dpfedavg.server.run, dpfedavg.privacy.audit"
    code = f"import sys, {modules}; assert 'flwr' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dpfedavg"


def _module_name(path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the dpfedavg modules it imports anywhere in its text: at module level, in functions, under
    ``TYPE_CHECKING`` (an AST walk, so lazy imports count)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                    )
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def test_no_import_cycle_lazy_imports_included() -> None:
    graph = _import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            strongconnect(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_check_finds_a_planted_cycle(monkeypatch) -> None:
    """The check above can fail: a graph with a lazy import back from config to the tasks is a cycle."""
    graph = _import_graph()
    assert "dpfedavg.tasks" in graph["dpfedavg.tasks.quadratic"] or "dpfedavg.config" in graph["dpfedavg.tasks"]
    graph["dpfedavg.config"].add("dpfedavg.tasks")
    monkeypatch.setattr(sys.modules[__name__], "_import_graph", lambda: graph)
    try:
        test_no_import_cycle_lazy_imports_included()
    except AssertionError as err:
        assert "dpfedavg.config" in str(err)
    else:
        raise AssertionError("a planted cycle was not found")


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys, json; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(json.loads(out))


def test_importing_the_config_loads_no_task_no_torch_no_accounting_library() -> None:
    loaded = _loaded_after("import dpfedavg.config")
    assert not {m for m in loaded if m.startswith("dpfedavg.tasks")}, "the config imports task modules"
    assert not {"torch", "flwr", "dp_accounting"} & {m.split(".")[0] for m in loaded}


def test_importing_the_public_api_loads_neither_flower_nor_torch() -> None:
    loaded = _loaded_after("import dpfedavg; from dpfedavg import RunConfig, ConfigError")
    assert not {"torch", "flwr"} & {m.split(".")[0] for m in loaded}
    loaded = _loaded_after("from dpfedavg import RunConfig, TorchTask, run")
    assert "torch" not in {m.split(".")[0] for m in loaded}  # TorchTask imports torch when a task is built
