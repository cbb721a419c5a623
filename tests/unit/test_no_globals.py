"""Run state lives in objects with an owner, not in module globals.

The only ``global`` statement in the package is the holder of
``get_context()``'s context: per-run state (the async save in flight, the
async-save process group, what Ray registered) belongs to the
``TrainContext`` or to an object it holds, created with the process group
and dropped at teardown, so that a re-initialised process starts clean.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ray_fsdp_backend

ROOT = Path(ray_fsdp_backend.__file__).parent
ALLOWED = {("runtime/context.py", "set_context", "_CONTEXT")}


def global_statements(root: Path = ROOT) -> set[tuple[str, str, str]]:
    """``(module path, innermost enclosing function, name)`` of every
    ``global`` statement under ``root``."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        stack = [(ast.parse(path.read_text(), str(path)), "<module>")]
        while stack:
            node, func = stack.pop()
            if isinstance(node, ast.Global):
                found.update((rel, func, name) for name in node.names)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                func = node.name
            stack += [(child, func) for child in ast.iter_child_nodes(node)]
    return found


def test_only_the_context_holder_uses_global():
    assert global_statements() == ALLOWED


def test_the_scan_finds_global_in_nested_functions_and_methods(tmp_path):
    (tmp_path / "mod.py").write_text(
        "class A:\n    def m(self):\n        def inner():\n            global X, Y\n"
    )
    assert global_statements(tmp_path) == {("mod.py", "inner", "X"), ("mod.py", "inner", "Y")}


def test_the_context_owns_its_checkpoint_state_and_teardown_drops_it():
    from dataclasses import fields

    from ray_fsdp_backend.checkpoint import RunCheckpoints
    from ray_fsdp_backend.runtime.context import TrainContext, get_context, set_context

    ctx = TrainContext(**{f.name: None for f in fields(TrainContext) if f.init})
    state = ctx.checkpoints  # created on first use, then kept
    assert isinstance(state, RunCheckpoints) and ctx.checkpoints is state
    set_context(ctx)
    assert get_context() is ctx
    set_context(None)  # what teardown_worker does before destroying the process group
    assert ctx._checkpoints is None
    assert ctx.checkpoints is not state  # a context used again starts clean
