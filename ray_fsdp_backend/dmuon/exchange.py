"""The collectives of DMuon: row shards to owners and back, by all-to-all.

Where a matrix's rows live and who owns it is decided by the pure
:mod:`~ray_fsdp_backend.dmuon.plan`; this module only packs tensors in the
plan's order and calls ``all_to_all_single`` on the shard group, one pair
per bucket of matrices, asynchronously so that the next bucket travels while
the owners orthogonalise this one. Uneven splits are fine for
``all_to_all_single`` on gloo and NCCL alike (unlike gloo's ``gather``), so
nothing is padded, and a rank that holds no rows of a matrix (more ranks
than rows) simply sends nothing for it. The layout never depends on
gradients, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ray_fsdp_backend.dmuon.plan import (
    OwnershipPlan,
    RankLayout,
    compute_buckets,
    compute_rank_layout,
)


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


@dataclass
class PendingExchange:
    """An all-to-all in flight: wait on ``work``, then read ``out``."""

    work: dist.Work | None
    out: torch.Tensor
    layout: RankLayout
    send: torch.Tensor  # kept alive until the exchange is done


class ShardExchange:
    """Moves per-matrix row shards to their owners and back, bucket by bucket,
    as the plan says. ``start_*`` issues an asynchronous all-to-all and
    returns at once; ``finish_*`` waits for it and unpacks, so a caller can
    orthogonalise one bucket while the next one travels. Every rank must
    start the same buckets in the same order."""

    def __init__(
        self,
        plan: OwnershipPlan,
        shard: ShardGroup,
        *,
        dtype: torch.dtype,
        device: torch.device,
        bucket_numel: int | None = None,
    ):
        self.plan = plan
        self.shard = shard
        self.dtype = dtype
        self.device = device
        self.layouts = tuple(
            compute_rank_layout(plan, shard.rank, bucket)
            for bucket in compute_buckets(plan, bucket_numel)
        )
        self.bytes_sent = 0
        """Bytes sent to other ranks since the last ``reset_counters``."""
        self.bytes_received = 0

    def reset_counters(self) -> None:
        self.bytes_sent = self.bytes_received = 0

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

    def start_to_owners(self, bucket: int, shards: list[torch.Tensor]) -> PendingExchange:
        """Send this rank's rows (``shards``: one per matrix, in plan order)
        of ``bucket``'s matrices to their owners."""
        lay = self.layouts[bucket]
        outgoing = [shards[i].reshape(-1) for i in lay.send_order]
        return self._start(outgoing, lay.recv_splits, lay.send_splits, lay)

    def finish_to_owners(self, pending: PendingExchange) -> dict[int, torch.Tensor]:
        """The full matrices this rank owns in the bucket, keyed by plan index."""
        lay = self._wait(pending)
        pieces: dict[int, list[torch.Tensor]] = {i: [] for i in lay.owned}
        for src, chunk in enumerate(pending.out.split(lay.recv_splits)):
            for i, piece in zip(lay.owned, chunk.split(lay.recv_sizes[src]), strict=True):
                pieces[i].append(piece.view(-1, self.plan.matrices[i].shape[1]))
        return {i: torch.cat(rows) for i, rows in pieces.items()}

    def start_to_shards(self, bucket: int, full: dict[int, torch.Tensor]) -> PendingExchange:
        """Send each rank its rows of the owned results ``full`` of ``bucket``."""
        lay = self.layouts[bucket]
        outgoing = [
            full[i][slice(*lay.row_ranges[i][dst])].reshape(-1)
            for dst in range(self.plan.num_ranks)
            for i in lay.owned
        ]
        return self._start(outgoing, lay.send_splits, lay.recv_splits, lay)

    def finish_to_shards(self, pending: PendingExchange) -> dict[int, torch.Tensor]:
        """This rank's rows (flat) of every matrix of the bucket, by plan index."""
        lay = self._wait(pending)
        shards: dict[int, torch.Tensor] = {}
        for owner, chunk in enumerate(pending.out.split(lay.send_splits)):
            ids = lay.owners_of[owner]
            shards.update(zip(ids, chunk.split(lay.send_sizes[owner]), strict=True))
        return shards

    def _start(
        self, parts: list[torch.Tensor], recv: tuple[int, ...], send: tuple[int, ...], lay
    ) -> PendingExchange:
        # A rank that owns nothing still takes part (it sends and receives rows).
        buf = torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype, device=self.device)
        me, itemsize = self.shard.rank, buf.element_size()
        self.bytes_sent += (sum(send) - send[me]) * itemsize
        self.bytes_received += (sum(recv) - recv[me]) * itemsize
        if self.shard.size == 1:
            return PendingExchange(work=None, out=buf, layout=lay, send=buf)
        out = buf.new_empty(sum(recv))
        work = dist.all_to_all_single(
            out, buf, list(recv), list(send), group=self.shard.process_group, async_op=True
        )
        return PendingExchange(work=work, out=out, layout=lay, send=buf)

    @staticmethod
    def _wait(pending: PendingExchange) -> RankLayout:
        if pending.work is not None:
            pending.work.wait()
        return pending.layout
