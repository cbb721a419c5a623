"""The guard for host tensors in collectives (issue 55, item 1), on CPU.

On GPUs without offload every process group is plain NCCL, which refuses a
CPU tensor ("No backend type associated with device type cpu"); on a gloo
CPU mesh any tensor works, so no distributed test here can see the mistake.
Two crashes of this class reached the pipeline before step 1: the FLOPs
meter all-reduced ``torch.tensor(float(own))`` over pp
(``trainer/loop/pipeline.py``), and the clipping made a frozen stage's norm
``torch.zeros((), device=torch.device("cpu"))`` and all-reduced it over pp
(``distributed/clip.py``).

The design: every tensor the package creates says where it lives. Each call
of ``torch.tensor`` / ``zeros`` / ``ones`` / ``full`` / ``empty`` names
``device=``, and no code spells ``torch.device("cpu")``, unless a line of the
call carries a ``# host: why`` comment (a checkpoint's bytes, a mesh's rank
grid, data rows before they move): a new host tensor is then a decision a
reviewer reads, not a default. The test reads every module's syntax tree
and names each unmarked call as ``FILE:LINE``; it fails on the two modules
above as they were before the fix (checked).
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ray_fsdp_backend"
FACTORIES = {"tensor", "zeros", "ones", "full", "empty"}
MARK = "# host:"


def _marked_lines(source: str) -> set[int]:
    """Lines whose comment starts with ``# host:``."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0] for t in tokens if t.type == tokenize.COMMENT and t.string.startswith(MARK)}


def _torch_call(node: ast.AST, names: set[str]) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in names
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "torch"
    )


def _is_cpu_device(node: ast.AST) -> bool:
    """``torch.device("cpu")``."""
    return (
        _torch_call(node, {"device"})
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == "cpu"
    )


def unplaced_tensors(source: str) -> list[int]:
    """Lines of ``source`` that create a tensor without ``device=``, or
    spell ``torch.device("cpu")``, with no ``# host:`` mark on the call."""
    marked = _marked_lines(source)
    found = []
    for node in ast.walk(ast.parse(source)):
        factory = _torch_call(node, FACTORIES) and all(k.arg != "device" for k in node.keywords)
        if not (factory or _is_cpu_device(node)):
            continue
        if not marked & set(range(node.lineno, node.end_lineno + 1)):
            found.append(node.lineno)
    return sorted(found)


def test_every_tensor_the_package_creates_names_its_device():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line in unplaced_tensors(path.read_text()):
            problems.append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    assert not problems, (
        "tensors created without device= (NCCL refuses a host tensor in a collective): "
        + ", ".join(problems)
        + f"; pass the compute device, or mark a host-only tensor '{MARK} why'"
    )


def test_the_guard_sees_what_it_guards():
    """What the two crashes looked like is caught; a device, or a marked
    host tensor, passes."""
    caught = [
        "total = torch.tensor(float(own), dtype=torch.float64)",
        'device = grads[0].device if grads else torch.device("cpu")',
        "zero = torch.zeros(\n    ()\n)",
    ]
    for source in caught:
        assert unplaced_tensors(source) == [1], source
    passed = [
        "total = torch.tensor(1.0, device=ctx.device)",
        "rows = torch.tensor(ids)  # host: data rows, moved by the loop",
        "x = torch.zeros(\n    3,  # host: a checkpoint's bytes\n)",
        "x = torch.zeros_like(y)",
    ]
    for source in passed:
        assert unplaced_tensors(source) == [], source
