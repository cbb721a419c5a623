"""The collectives of DMuon: row shards to owners and back, one all-to-all each.

Where a matrix's rows live and who owns it is decided by the pure
:class:`~ray_fsdp_backend.dmuon.plan.OwnershipPlan`; this module only packs
tensors in the plan's order and calls ``all_to_all_single`` on the shard
group. Uneven splits are fine for ``all_to_all_single`` on gloo and NCCL
alike (unlike gloo's ``gather``), so nothing is padded, and a rank that
holds no rows of a matrix (more ranks than rows) simply sends nothing for it.
The layout never depends on gradients, so every rank issues the same
collectives in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ray_fsdp_backend.dmuon.plan import OwnershipPlan, compute_rank_layout


@dataclass(frozen=True)
class ShardGroup:
    """The ranks that split the dedicated matrices' rows among themselves.

    ``mesh`` is None for plain (unsharded) parameters: a group of one.
    """

    mesh: DeviceMesh | None
    axis: int | None
    rank: int
    size: int

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return None if self.mesh is None else self.mesh.get_group(self.axis)


def resolve_shard_group(dedicated: list[tuple[str, nn.Parameter]]) -> ShardGroup:
    """The mesh axis on which the dedicated parameters are row-sharded.

    All of them must be DTensors on one mesh, ``Shard(0)`` on exactly one axis
    and ``Replicate`` on the others (FSDP2: ``(Shard(0),)``, HSDP:
    ``(Replicate(), Shard(0))``), or all plain tensors.

    Raises:
        ValueError: mixed DTensor and plain parameters, several meshes, or
            another placement (naming the parameter).
    """
    dtensors = [(n, p) for n, p in dedicated if isinstance(p, DTensor)]
    if not dtensors:
        return ShardGroup(mesh=None, axis=None, rank=0, size=1)
    if len(dtensors) != len(dedicated):
        plain = next(n for n, p in dedicated if not isinstance(p, DTensor))
        raise ValueError(
            f"dedicated parameter {plain!r} is not sharded while others are: wrap the "
            "whole model with FSDP2 before building the optimizer"
        )
    mesh = dtensors[0][1].device_mesh
    axes = {_shard_axis(n, p, mesh) for n, p in dtensors}
    if len(axes) != 1:
        raise ValueError(f"dedicated parameters are sharded on different mesh axes {sorted(axes)}")
    axis = axes.pop()
    return ShardGroup(mesh=mesh, axis=axis, rank=mesh.get_local_rank(axis), size=mesh.size(axis))


def _shard_axis(name: str, p: DTensor, mesh: DeviceMesh) -> int:
    if p.device_mesh != mesh:
        raise ValueError(f"dedicated parameter {name!r} lives on another device mesh")
    sharded = [i for i, pl in enumerate(p.placements) if pl == Shard(0)]
    others_ok = all(pl == Replicate() for i, pl in enumerate(p.placements) if i not in sharded)
    if len(sharded) != 1 or not others_ok:
        raise ValueError(
            f"dedicated parameter {name!r} has placements {tuple(p.placements)}: DMuon needs "
            "Shard(0) on one mesh axis and Replicate on the others (FSDP2's default)"
        )
    return sharded[0]


class ShardExchange:
    """Moves per-matrix row shards to their owners and back, as the plan says."""

    def __init__(
        self, plan: OwnershipPlan, shard: ShardGroup, *, dtype: torch.dtype, device: torch.device
    ):
        self.plan = plan
        self.shard = shard
        self.dtype = dtype
        self.device = device
        self.layout = compute_rank_layout(plan, shard.rank)
        self.bytes_sent = 0
        """Bytes sent to other ranks since the last ``to_owners`` (one step)."""
        self.bytes_received = 0

    def verify_consistent(self, local_error: str | None) -> None:
        """Check, collectively, that every rank of the mesh computed this plan
        and that no rank found a local problem; raise on all ranks if not.

        One MAX all-reduce per mesh axis of ``(hash, -hash, error)``: reduced
        along every axis in turn, it gives the global maximum and minimum hash
        on every rank, so all ranks take the same decision.

        Raises:
            ValueError: ``local_error`` here, or a problem on another rank.
            RuntimeError: ranks computed different plans (different models).
        """
        mesh = self.shard.mesh
        if mesh is None:
            if local_error:
                raise ValueError(local_error)
            return
        fp = self.plan.fingerprint()
        flags = torch.tensor([fp, -fp, int(local_error is not None)], device=mesh.device_type)
        for axis in range(mesh.ndim):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=mesh.get_group(axis))
        max_fp, neg_min_fp, any_error = flags.tolist()
        if local_error:
            raise ValueError(local_error)
        if any_error:
            raise ValueError("DMuon: another rank rejected its parameter shards (see its error)")
        if max_fp != -neg_min_fp:
            raise RuntimeError(
                "DMuon: ranks computed different ownership plans: the dedicated parameters' "
                "names or shapes differ between ranks"
            )

    def to_owners(self, shards: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Full matrices this rank owns, keyed by plan index, assembled from
        every rank's ``shards`` (this rank's rows of every matrix, in plan
        order)."""
        lay = self.layout
        self.bytes_sent = self.bytes_received = 0
        outgoing = [shards[i].reshape(-1) for i in lay.send_order]
        received = self._all_to_all(outgoing, lay.recv_splits, lay.send_splits)
        pieces: dict[int, list[torch.Tensor]] = {i: [] for i in lay.owned}
        for src, chunk in enumerate(received.split(lay.recv_splits)):
            for i, piece in zip(lay.owned, chunk.split(lay.recv_sizes[src]), strict=True):
                pieces[i].append(piece.view(-1, self.plan.matrices[i].shape[1]))
        return {i: torch.cat(rows) for i, rows in pieces.items()}

    def to_shards(self, full: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """This rank's rows of every matrix (flat, in plan order), cut from the
        owners' ``full`` results."""
        lay = self.layout
        outgoing = [
            full[i][slice(*lay.row_ranges[i][dst])].reshape(-1)
            for dst in range(self.plan.num_ranks)
            for i in lay.owned
        ]
        received = self._all_to_all(outgoing, lay.send_splits, lay.recv_splits)
        shards: list[torch.Tensor | None] = [None] * len(self.plan.matrices)
        for owner, chunk in enumerate(received.split(lay.send_splits)):
            owned = self.plan.owned_by(owner)
            for i, piece in zip(owned, chunk.split(lay.send_sizes[owner]), strict=True):
                shards[i] = piece
        return shards

    def _all_to_all(self, parts: list[torch.Tensor], recv: tuple[int, ...], send: tuple[int, ...]):
        # A rank that owns nothing still takes part (it sends and receives rows).
        buf = torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype, device=self.device)
        me, itemsize = self.shard.rank, buf.element_size()
        self.bytes_sent += (sum(send) - send[me]) * itemsize
        self.bytes_received += (sum(recv) - recv[me]) * itemsize
        if self.shard.size == 1:
            return buf
        out = buf.new_empty(sum(recv))
        dist.all_to_all_single(out, buf, list(recv), list(send), group=self.shard.process_group)
        return out
