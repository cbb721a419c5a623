"""Which parameters Muon orthogonalises ("dedicated") and which go to AdamW."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.fsdp import FSDPModule

from ray_fsdp_backend.dmuon.plan import MatrixSpec
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
    tables. Embeddings, the output head, norms and biases (outside blocks or
    not 2-D) go to AdamW."""
    prefixes = tuple(p + "." for p in block_prefixes(model))
    embeddings = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }

    def is_dedicated(name: str, param: nn.Parameter) -> bool:
        return param.ndim == 2 and name.startswith(prefixes) and id(param) not in embeddings

    return is_dedicated


def select_parameters(
    model: nn.Module, is_dedicated: Callable[[str, nn.Parameter], bool] | None = None
) -> tuple[NamedParams, NamedParams]:
    """Split the model's trainable parameters (each once, in model order) into
    (dedicated, rest) with ``is_dedicated`` or :func:`default_dedicated`.

    Raises:
        ValueError: a dedicated parameter that is not 2-D (naming it).
    """
    choose = is_dedicated or default_dedicated(model)
    dedicated: NamedParams = []
    rest: NamedParams = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (dedicated if choose(name, p) else rest).append((name, p))
    for name, p in dedicated:
        if p.ndim != 2:
            raise ValueError(
                f"dedicated parameter {name!r} has shape {tuple(p.shape)}: Muon orthogonalises "
                "2-D matrices only; leave it to AdamW (is_dedicated)"
            )
    return dedicated, rest


def dedicated_specs(
    model: nn.Module, is_dedicated: Callable[[str, nn.Parameter], bool] | None = None
) -> list[MatrixSpec]:
    """Name and shape of each matrix Muon would orthogonalise in ``model``
    (which may live on the meta device), for planning without building it."""
    dedicated, _ = select_parameters(model, is_dedicated)
    return [MatrixSpec(name, tuple(p.shape)) for name, p in dedicated]
