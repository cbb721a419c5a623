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
    # runtime/context.py imports the checkpoint package only inside its methods.
    assert "ray_fsdp_backend.checkpoint" in graph["ray_fsdp_backend.runtime.context"]


def test_package_imports_have_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_benchmark_imports_have_no_cycle():
    cycle = find_cycle(import_graph(Path(benchmarks.__file__).parent))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


LAYERS = (
    ("settings",),
    ("planning", "storage"),
    ("compat", "distributed"),
    ("ops", "context_parallel"),
    ("models",),
    ("strategies",),
    ("checkpoint", "hf", "dmuon", "metrics"),
    ("pipeline",),
    ("runtime",),
    ("sft",),
    ("preference",),
    ("rl",),
    ("",),
    ("trainer.schema",),
    ("trainer.data",),
    ("trainer", "trainer.loop"),
    ("cli",),
)
"""The package's layers, lowest first (docs/architecture.md): a module may
import its own folder and any folder of a lower layer; folders of one layer
never import each other. ``""`` is the package root, the public face."""

PURE_FOLDERS = ("settings", "planning")
"""Folders that import no torch, Ray or Hugging Face library, even lazily."""

HEAVY = {"torch", "ray", "transformers", "peft", "torchao", "safetensors", "pyarrow"}


def folder_of(module: str) -> str:
    """The folder of the layer table ``module`` belongs to (``trainer``'s
    subfolders are layers of their own)."""
    parts = module.split(".")[1:]
    if not parts:
        return ""
    if parts[0] == "trainer" and len(parts) > 1:
        return f"trainer.{parts[1]}"
    return parts[0] if len(parts) > 1 or (ROOT / parts[0]).is_dir() else ""


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that is not downward in :data:`LAYERS`, and every module
    in a folder the table does not name."""
    rank = {folder: i for i, layer in enumerate(LAYERS) for folder in layer}
    problems = []
    for module, edges in sorted(graph.items()):
        here = folder_of(module)
        if here not in rank:
            problems.append(f"{module}: folder {here or '(root)'!r} is in no layer")
            continue
        for target in sorted(edges):
            there = folder_of(target)
            if there != here and rank.get(there, len(LAYERS)) >= rank[here]:
                problems.append(
                    f"{module} -> {target}: {here or 'root'} does not sit above {there or 'root'}"
                )
    return problems


def test_layer_check_names_an_upward_import():
    graph = {
        "ray_fsdp_backend.planning.topology": {"ray_fsdp_backend.settings.config"},
        "ray_fsdp_backend.settings.config": {"ray_fsdp_backend.planning.memory"},
        "ray_fsdp_backend.ops.loss": {"ray_fsdp_backend.context_parallel.attention"},
    }
    assert layer_violations(graph) == [
        "ray_fsdp_backend.ops.loss -> ray_fsdp_backend.context_parallel.attention: "
        "ops does not sit above context_parallel",
        "ray_fsdp_backend.settings.config -> ray_fsdp_backend.planning.memory: "
        "settings does not sit above planning",
    ]


def test_root_holds_the_public_face_and_folders_only():
    loose = sorted(p.name for p in ROOT.glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"modules at the package root: {loose}; give each a folder"


def test_every_import_points_down_the_layers():
    # Lazy imports (inside functions) count: a lazy import hides an upward
    # dependency from the interpreter's start-up, not from the reader.
    problems = layer_violations(import_graph())
    assert problems == [], "\n".join(problems)


def _imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = {alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names}
    names |= {
        n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level
    }
    return {name.split(".")[0] for name in names}


@pytest.mark.parametrize("folder", PURE_FOLDERS)
def test_pure_folders_import_no_torch_ray_or_hugging_face(folder):
    modules = sorted((ROOT / folder).rglob("*.py"))
    assert modules, f"ray_fsdp_backend/{folder}/ holds no module"
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imported_roots(path) & HEAVY)
        for path in modules
        if _imported_roots(path) & HEAVY
    }
    assert offenders == {}, offenders


def test_pure_folders_reach_only_pure_folders():
    graph = import_graph()
    for module in graph:
        if folder_of(module) in PURE_FOLDERS:
            reached = {folder_of(m) for m in _reachable(graph, module)}
            assert reached <= set(PURE_FOLDERS), (module, reached)


def test_strategies_never_reach_the_backend_or_the_context():
    graph = import_graph()
    for module in graph:
        if module.startswith("ray_fsdp_backend.strategies"):
            reached = _reachable(graph, module)
            assert "ray_fsdp_backend.runtime.backend" not in reached, module
            assert "ray_fsdp_backend.runtime.context" not in reached, module
