"""DMuon under tensor parallelism: whole matrices from TP-split ones.

With a TP plan applied, each dedicated matrix is split over the ``tp`` axis
(rows for a column-wise layer, columns for a row-wise one) and FSDP2 then
splits each rank's TP block by rows over ``dp_shard``. DMuon plans and
exchanges over ``dp_shard`` exactly as without TP, on the TP blocks: the
ranks of a tp group share their ``dp_shard`` coordinate, so they own the same
matrices, each holding its own TP block of them after the exchange. The
owners then all-gather those blocks over the tp group (one all-gather per
owned shape per bucket), every rank of the group runs Newton–Schulz on the
whole matrices (batched by whole shape) and keeps its own TP block of the
result, which the return exchange sends back over ``dp_shard``.

Exact: Newton–Schulz sees the same whole matrix as ``torch.optim.Muon`` in
one process. Cost beyond DMuon without TP: each owner receives ``tp - 1``
TP blocks of every matrix it owns per step (inside a node), and Newton–Schulz
runs on every rank of a tp group, ``tp`` times over.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ray_fsdp_backend.planning.topology import TP_AXIS

Stacks = dict[tuple[int, int], torch.Tensor]


@dataclass(frozen=True)
class TensorSplit:
    """How the dedicated matrices are split over the tp axis of their mesh.

    ``dims[i]`` is the dimension plan matrix ``i`` is split on (0: rows, 1:
    columns) or None where it is replicated over tp. ``size`` 1: no TP.
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int
    dims: tuple[int | None, ...]

    def block_shape(self, shape: Sequence[int], i: int) -> tuple[int, int]:
        """The shape of matrix ``i``'s TP block (what FSDP2 splits by rows)."""
        rows, cols = shape
        if self.dims[i] == 0:
            return rows // self.size, cols
        if self.dims[i] == 1:
            return rows, cols // self.size
        return rows, cols


def resolve_tensor_split(dedicated: list[tuple[str, nn.Parameter]]) -> TensorSplit:
    """The tp split of each dedicated parameter; no TP when their mesh has no
    ``tp`` axis.

    Raises:
        ValueError: a placement on tp other than ``Shard(0)``, ``Shard(1)`` or
            ``Replicate`` (naming the parameter).
    """
    none = TensorSplit(group=None, rank=0, size=1, dims=(None,) * len(dedicated))
    first = next((p for _, p in dedicated if isinstance(p, DTensor)), None)
    names = tuple(first.device_mesh.mesh_dim_names or ()) if first is not None else ()
    if TP_AXIS not in names:
        return none
    mesh, axis = first.device_mesh, names.index(TP_AXIS)
    dims = []
    for name, p in dedicated:
        placement = p.placements[axis]
        if isinstance(placement, Replicate):
            dims.append(None)
        elif type(placement) is Shard and placement.dim in (0, 1):
            dims.append(placement.dim)
        else:
            raise ValueError(
                f"dedicated parameter {name!r} has placement {placement} on the tp axis: DMuon "
                "takes matrices split on rows or columns (Shard(0) / Shard(1)) or replicated"
            )
    return TensorSplit(
        group=mesh.get_group(axis), rank=mesh.get_local_rank(axis), size=mesh.size(axis),
        dims=tuple(dims),
    )  # fmt: skip


def orthogonalize_whole(
    stacks: Stacks,
    ns_batches: dict[tuple[int, int], Sequence[int]],
    split: TensorSplit,
    orthogonalize: Callable[[Stacks], Stacks],
) -> Stacks:
    """``orthogonalize`` (Newton–Schulz by shape) applied to whole matrices.

    Args:
        stacks: the owned TP blocks of one bucket, stacked by block shape.
        ns_batches: the plan indices of each stack's matrices, in order.
        split: the tp split; with ``size`` 1 this is ``orthogonalize(stacks)``.
        orthogonalize: batched Newton–Schulz on ``{shape: (n, rows, cols)}``.

    Returns:
        This rank's TP block of every orthogonalised matrix, stacked as
        ``stacks``. Every rank of the tp group must call it (collective).
    """
    if split.size == 1:
        return orthogonalize(stacks)
    whole: dict[tuple[int, int], list[torch.Tensor]] = {}
    places = []  # (block shape, index in its stack, whole shape, index in the whole batch)
    for shape, stack in stacks.items():
        blocks = [torch.empty_like(stack) for _ in range(split.size)]
        dist.all_gather(blocks, stack.contiguous(), group=split.group)
        for k, i in enumerate(ns_batches[shape]):
            dim = split.dims[i]
            matrix = stack[k] if dim is None else torch.cat([b[k] for b in blocks], dim=dim)
            batch = whole.setdefault(tuple(matrix.shape), [])
            places.append((shape, k, tuple(matrix.shape), len(batch), dim))
            batch.append(matrix)
    results = orthogonalize({shape: torch.stack(ms) for shape, ms in whole.items()})
    out = {shape: torch.empty_like(stack) for shape, stack in stacks.items()}
    for shape, k, whole_shape, j, dim in places:
        result = results[whole_shape][j]
        out[shape][k] = result if dim is None else result.chunk(split.size, dim=dim)[split.rank]
    return out
