"""Which parameters Muon orthogonalises ("dedicated") and which go to AdamW.

A dedicated parameter is a 2-D matrix, or a 3-D stack of matrices on dim 0
(an experts module's ``[E, out, in]`` weights: E matrices, see
:mod:`~ray_fsdp_backend.dmuon.stacks`)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.fsdp import FSDPModule

from ray_fsdp_backend.dmuon.plan import MatrixSpec, is_default_dedicated
from ray_fsdp_backend.dmuon.stacks import STACK_NDIM, is_expert_stack
from ray_fsdp_backend.strategies.blocks import find_blocks

NamedParams = list[tuple[str, nn.Parameter]]


def block_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Names of the model's sharded blocks: every FSDP2 unit nested inside
    another unit (the outermost units keep embeddings, head and final norm).
    For a model without nested units, every child of an ``nn.ModuleList``,
    the per-block policy's default
    (:func:`~ray_fsdp_backend.strategies.blocks.find_blocks`)."""
    units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    nested = tuple(u for u in units if any(_is_ancestor(v, u) for v in units))
    if nested:
        return nested
    names = {id(m): name for name, m in model.named_modules()}
    return tuple(names[id(b)] for b in find_blocks(model))


def _is_ancestor(outer: str, inner: str) -> bool:
    return outer != inner and (outer == "" or inner.startswith(outer + "."))


def default_dedicated(model: nn.Module) -> Callable[[str, nn.Parameter], bool]:
    """The default choice: 2-D weights inside a block, except embedding
    tables, and the 3-D weights of experts modules (every expert's matrix).
    Embeddings, the output head, norms and biases (outside blocks or not
    2-D; an experts module's 2-D bias stacks included) go to AdamW
    (:func:`~ray_fsdp_backend.dmuon.plan.is_default_dedicated`, which
    ``plan`` applies to shapes)."""
    prefixes = tuple(p + "." for p in block_prefixes(model))
    embeddings = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    stacks, bias_stacks = expert_stacks(model)

    def is_dedicated(name: str, param: nn.Parameter) -> bool:
        return is_default_dedicated(
            param.ndim,
            in_block=name.startswith(prefixes),
            embedding=id(param) in embeddings,
            expert_stack=id(param) in stacks,
            expert_bias=id(param) in bias_stacks,
        )

    return is_dedicated


def expert_stacks(model: nn.Module) -> tuple[set[int], set[int]]:
    """Ids of the experts modules' 3-D weight stacks (one matrix per expert)
    and of their 2-D bias stacks (one bias vector per expert, gpt-oss's
    ``gate_up_proj_bias`` ``[E, 2I]``: not a matrix, so AdamW's)."""
    stacks: set[int] = set()
    biases: set[int] = set()
    for m in model.modules():
        own = list(m.parameters(recurse=False))
        if any(is_expert_stack(m, p) for p in own):
            stacks.update(id(p) for p in own if p.ndim == STACK_NDIM)
            biases.update(id(p) for p in own if p.ndim < STACK_NDIM)
    return stacks, biases


def select_parameters(
    model: nn.Module, is_dedicated: Callable[[str, nn.Parameter], bool] | None = None
) -> tuple[NamedParams, NamedParams]:
    """Split the model's trainable parameters (each once, in model order) into
    (dedicated, rest) with ``is_dedicated`` or :func:`default_dedicated`.

    Raises:
        ValueError: a dedicated parameter that is not 2-D or 3-D (naming it).
    """
    choose = is_dedicated or default_dedicated(model)
    dedicated: NamedParams = []
    rest: NamedParams = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (dedicated if choose(name, p) else rest).append((name, p))
    for name, p in dedicated:
        if p.ndim not in (2, STACK_NDIM):
            raise ValueError(
                f"dedicated parameter {name!r} has shape {tuple(p.shape)}: Muon orthogonalises "
                "2-D matrices and 3-D stacks of them (one per index of dim 0) only; leave it "
                "to AdamW (is_dedicated)"
            )
    return dedicated, rest


def dedicated_specs(
    model: nn.Module, is_dedicated: Callable[[str, nn.Parameter], bool] | None = None
) -> list[MatrixSpec]:
    """Name and shape of each 2-D matrix Muon would orthogonalise in
    ``model`` (which may live on the meta device), for planning the owners
    without building it; stacks (:func:`dedicated_stacks`) need no owners."""
    dedicated, _ = select_parameters(model, is_dedicated)
    return [MatrixSpec(name, tuple(p.shape)) for name, p in dedicated if p.ndim == 2]


def dedicated_stacks(
    model: nn.Module, is_dedicated: Callable[[str, nn.Parameter], bool] | None = None
) -> list[tuple[int, int, int]]:
    """The shape of each dedicated stack of matrices (experts) in ``model``."""
    dedicated, _ = select_parameters(model, is_dedicated)
    return [tuple(p.shape) for _, p in dedicated if p.ndim == STACK_NDIM]
