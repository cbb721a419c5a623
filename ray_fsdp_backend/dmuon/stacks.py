"""DMuon on stacked matrices (mixture-of-experts weights): each one separately.

A stack is a 3-D dedicated parameter ``[N, rows, cols]`` holding ``N``
matrices, one per index of dim 0: transformers' experts modules keep every
expert's ``gate_up_proj`` (and ``down_proj``) in one such tensor. Muon
orthogonalises each matrix on its own, as ``torch.optim.Muon`` would with
every expert's matrix as its own 2-D parameter (learning rate adjusted by
the matrix's shape, not the stack's).

FSDP2 shards a stack on dim 0, and expert parallelism splits it on dim 0
over ``ep`` before FSDP2 shards each ep rank's experts over ``efsdp``: either
way every rank holds whole matrices of the experts it keeps. Each rank
therefore orthogonalises the matrices it holds, where they live, batched by
shape: stacks take no part in DMuon's exchanges, so neither ep nor efsdp
adds a byte to the optimizer step (the gradients' reduce-scatter over efsdp
is FSDP2's, as under AdamW). The balance follows the experts: a rank
orthogonalises ``ceil(N / ep / efsdp)`` matrices of a stack at most.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

STACK_NDIM = 3
"""A dedicated parameter of this many dims is a stack of matrices on dim 0."""


def is_expert_stack(module: nn.Module, param: nn.Parameter) -> bool:
    """A 3-D parameter of a transformers experts module (one with
    ``num_experts``): one matrix per expert."""
    return param.ndim == STACK_NDIM and hasattr(module, "num_experts")


def stack_layout_error(name: str, p: torch.Tensor) -> str | None:
    """Why this rank's shard of stack ``p`` does not hold whole matrices
    (split on dim 1 or 2), or None."""
    local = p.to_local() if isinstance(p, DTensor) else p
    if tuple(local.shape[1:]) == tuple(p.shape[1:]):
        return None
    return (
        f"dedicated stack {name!r}: local shard has shape {tuple(local.shape)} of "
        f"{tuple(p.shape)}: DMuon orthogonalises stacked matrices only where each rank holds "
        "whole ones (sharded on dim 0, the expert dim); leave it to AdamW (is_dedicated)"
    )


def local_matrix_names(name: str, p: torch.Tensor) -> tuple[str, ...]:
    """``name[i]`` for the global index ``i`` of each matrix this rank holds."""
    if not isinstance(p, DTensor):
        return tuple(f"{name}[{i}]" for i in range(p.shape[0]))
    # torch 2.13's private helper: the only one that resolves FSDP2's
    # _StridedShard over an ep Shard(0) to this rank's first expert.
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(f"{name}[{offset[0] + i}]" for i in range(shape[0]))


def orthogonalize_stacks(
    updates: Sequence[torch.Tensor],
    orthogonalize: Callable[[dict[tuple[int, int], torch.Tensor]], dict],
) -> list[torch.Tensor]:
    """``orthogonalize`` (batched Newton–Schulz by shape) applied to every
    matrix of the local ``updates`` (``(n, rows, cols)`` each), one call for
    all matrices of one shape; returns the results shaped as ``updates``."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    for k, u in enumerate(updates):
        if u.shape[0]:
            by_shape.setdefault(tuple(u.shape[1:]), []).append(k)
    stacks = {s: torch.cat([updates[k] for k in ks]) for s, ks in by_shape.items()}
    results = orthogonalize(stacks)
    out = list(updates)
    for shape, ks in by_shape.items():
        pieces = results[shape].split([updates[k].shape[0] for k in ks])
        for k, piece in zip(ks, pieces, strict=True):
            out[k] = piece
    return out
