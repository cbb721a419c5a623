"""The package's imports form a tree (a DAG): read bottom-up, layer by layer.

Every ``import`` and ``from ... import`` statement of every module is an edge,
including those inside functions and ``TYPE_CHECKING`` blocks: a lazy import
hides a dependency from the interpreter's start-up, not from the reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import benchmarks
import ray_fsdp_backend

ROOT = Path(ray_fsdp_backend.__file__).parent


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: Path) -> dict[str, Path]:
    return {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module that ``name`` (dotted, maybe ending in a symbol) is."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package modules it imports (symbols resolve to their module)."""
    package = root.name
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(node, module, path.name == "__init__.py")
                targets = [f"{source}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == package:
                    resolved = _resolve(target, modules)
                    if resolved and resolved != module:
                        edges.add(resolved)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_finder_names_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_graph_sees_imports_inside_functions():
    graph = import_graph()
    # context.py imports the checkpoint package only inside its methods.
    assert "ray_fsdp_backend.checkpoint" in graph["ray_fsdp_backend.runtime.context"]


def test_package_imports_have_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_benchmark_imports_have_no_cycle():
    cycle = find_cycle(import_graph(Path(benchmarks.__file__).parent))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_pure_layers_import_only_the_config():
    # The config's checks test a pipeline schedule with the pure schedule
    # rules, which import nothing of the package.
    graph = import_graph()
    schedules = "ray_fsdp_backend.planning.pipeline_schedules"
    config = {"ray_fsdp_backend.settings.config", "ray_fsdp_backend.settings.checks", schedules}
    assert _reachable(graph, schedules) == set()
    assert _reachable(graph, "ray_fsdp_backend.settings.config") == config - {
        "ray_fsdp_backend.settings.config"
    }
    for pure in (
        "ray_fsdp_backend.planning.topology",
        "ray_fsdp_backend.planning.memory",
        "ray_fsdp_backend.planning.elastic",
    ):
        assert _reachable(graph, pure) <= config, pure


def test_strategies_never_reach_the_backend_or_the_context():
    graph = import_graph()
    for module in graph:
        if module.startswith("ray_fsdp_backend.strategies"):
            reached = _reachable(graph, module)
            assert "ray_fsdp_backend.runtime.backend" not in reached, module
            assert "ray_fsdp_backend.runtime.context" not in reached, module


@pytest.mark.parametrize("name", ["config.py", "config_checks.py"])
def test_config_does_not_import_ray(name):
    source = (ROOT / name).read_text()
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom)
    }
    assert "ray" not in imported
