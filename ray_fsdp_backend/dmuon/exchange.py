"""The collectives of DMuon: row shards to owners and back, by all-to-all.

Where a matrix's rows live and who owns it is decided by the pure
:mod:`~ray_fsdp_backend.dmuon.plan`; this module only packs tensors in the
plan's order and calls ``all_to_all_single`` on the shard group, one pair
per bucket of matrices, asynchronously so that the next bucket travels while
the owners orthogonalise this one. Each side packs and unpacks with one copy:
the momentum update is written into the send buffer, an owner copies each
sender's block of a shape batch straight into the batch's stack (no copy at
all in a group of one), and results go back the same way. Uneven splits are fine for
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
from torch.distributed.tensor.placement_types import _StridedShard

from ray_fsdp_backend.dmuon.plan import OwnershipPlan, RankLayout, compute_rank_layout
from ray_fsdp_backend.planning.topology import TP_AXIS

Stacks = dict[tuple[int, int], torch.Tensor]
"""Owned matrices of one bucket by shape: ``(count, rows, cols)`` each."""


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
    ``(Replicate(), Shard(0))``), or all plain tensors. A ``tp`` axis is left
    to :mod:`~ray_fsdp_backend.dmuon.tensor_parallel`; over a TP-split
    matrix FSDP2 shards rows with ``_StridedShard(0)``, which counts as
    ``Shard(0)`` here (each rank holds ``torch.chunk`` rows of its TP block).

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
    names = tuple(mesh.mesh_dim_names or ())
    tp_axis = names.index(TP_AXIS) if TP_AXIS in names else None
    axes = {_shard_axis(n, p, mesh, tp_axis) for n, p in dtensors}
    if len(axes) != 1:
        raise ValueError(f"dedicated parameters are sharded on different mesh axes {sorted(axes)}")
    axis = axes.pop()
    return ShardGroup(mesh=mesh, axis=axis, rank=mesh.get_local_rank(axis), size=mesh.size(axis))


def _shard_axis(name: str, p: DTensor, mesh: DeviceMesh, tp_axis: int | None) -> int:
    if p.device_mesh != mesh:
        raise ValueError(f"dedicated parameter {name!r} lives on another device mesh")
    placements = {i: pl for i, pl in enumerate(p.placements) if i != tp_axis}
    sharded = [i for i, pl in placements.items() if _rows(pl)]
    others_ok = all(pl == Replicate() for i, pl in placements.items() if i not in sharded)
    if len(sharded) != 1 or not others_ok:
        raise ValueError(
            f"dedicated parameter {name!r} has placements {tuple(p.placements)}: DMuon needs "
            "Shard(0) on one mesh axis and Replicate on the others (FSDP2's default)"
        )
    return sharded[0]


def _rows(placement) -> bool:
    """``Shard(0)``, or FSDP2's ``_StridedShard(0)`` over a TP-split matrix."""
    return placement == Shard(0) or (isinstance(placement, _StridedShard) and placement.dim == 0)


@dataclass
class PendingExchange:
    """An all-to-all in flight: wait on ``work``, then read ``out``."""

    work: dist.Work | None
    out: torch.Tensor | None
    layout: RankLayout
    send: torch.Tensor | Stacks  # kept alive until the exchange is done


class ShardExchange:
    """Moves per-matrix row shards to their owners and back, bucket by bucket
    (``plan.schedule``). ``start_*`` issues an asynchronous all-to-all and
    returns at once; ``finish_*`` waits for it and unpacks, so a caller can
    orthogonalise one bucket while the next one travels. Every rank must
    start the same buckets in the same order."""

    def __init__(
        self, plan: OwnershipPlan, shard: ShardGroup, *, dtype: torch.dtype, device: torch.device
    ):
        self.plan = plan
        self.shard = shard
        self.dtype = dtype
        self.device = device
        self.layouts = tuple(compute_rank_layout(plan, shard.rank, b) for b in plan.schedule)
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

    def send_buffer(self, bucket: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """An empty buffer for this rank's rows of ``bucket``'s matrices and,
        by plan index, the ``(rows, cols)`` view of it each matrix's rows go
        in: fill the views, then ``start_to_owners(bucket, buffer)``."""
        lay = self.layouts[bucket]
        buf = torch.empty(sum(lay.send_splits), dtype=self.dtype, device=self.device)
        sizes = [size for sizes in lay.send_sizes for size in sizes]
        views = {
            i: piece.view(-1, self.plan.matrices[i].shape[1])
            for i, piece in zip(lay.send_order, buf.split(sizes), strict=True)
        }
        return buf, views

    def start_to_owners(self, bucket: int, buffer: torch.Tensor) -> PendingExchange:
        """Send the filled ``send_buffer`` of ``bucket`` to the owners."""
        lay = self.layouts[bucket]
        return self._start(buffer, lay.recv_splits, lay.send_splits, lay)

    def finish_to_owners(self, pending: PendingExchange) -> Stacks:
        """The full matrices this rank owns in the bucket, stacked by shape
        (``layout.ns_batches`` order); a sender's block that already is the
        whole stack (a group of one) is used as it is."""
        lay = self._wait(pending)
        stacks: Stacks = {}
        for src, chunk in enumerate(pending.out.split(lay.recv_splits)):
            sizes = self._batch_sizes(lay, src)
            for (shape, ids), (start, stop), block in zip(
                lay.ns_batches.items(), lay.batch_rows[src], chunk.split(sizes), strict=True
            ):
                block = block.view(len(ids), stop - start, shape[1])
                if stop - start == shape[0]:
                    stacks[shape] = block
                elif stop > start:
                    if shape not in stacks:
                        stacks[shape] = block.new_empty(len(ids), *shape)
                    stacks[shape][:, start:stop].copy_(block)
        return stacks

    def start_to_shards(self, bucket: int, results: Stacks) -> PendingExchange:
        """Send each rank its rows of the orthogonalised stacks of ``bucket``."""
        lay = self.layouts[bucket]
        if self.shard.size == 1:
            return PendingExchange(work=None, out=None, layout=lay, send=results)
        buf = torch.empty(sum(lay.recv_splits), dtype=self.dtype, device=self.device)
        sizes = [size for dst in range(self.shard.size) for size in self._batch_sizes(lay, dst)]
        blocks = iter(buf.split(sizes))
        for rows in lay.batch_rows:
            for (shape, ids), (start, stop) in zip(lay.ns_batches.items(), rows, strict=True):
                block = next(blocks).view(len(ids), stop - start, shape[1])
                block.copy_(results[shape][:, start:stop])
        return self._start(buf, lay.send_splits, lay.recv_splits, lay)

    def finish_to_shards(self, pending: PendingExchange) -> dict[int, torch.Tensor]:
        """This rank's rows ``(rows, cols)`` of every matrix of the bucket, by
        plan index."""
        lay = self._wait(pending)
        if pending.out is None:  # a group of one: the results themselves
            return {
                i: stack[k]
                for shape, stack in pending.send.items()
                for k, i in enumerate(lay.ns_batches[shape])
            }
        shards: dict[int, torch.Tensor] = {}
        for owner, chunk in enumerate(pending.out.split(lay.send_splits)):
            ids = lay.owners_of[owner]
            for i, piece in zip(ids, chunk.split(lay.send_sizes[owner]), strict=True):
                shards[i] = piece.view(-1, self.plan.matrices[i].shape[1])
        return shards

    @staticmethod
    def _batch_sizes(lay: RankLayout, src: int) -> list[int]:
        rows = lay.batch_rows[src]
        return [
            len(ids) * (stop - start) * shape[1]
            for (shape, ids), (start, stop) in zip(lay.ns_batches.items(), rows, strict=True)
        ]

    def _start(
        self, buf: torch.Tensor, recv: tuple[int, ...], send: tuple[int, ...], lay: RankLayout
    ) -> PendingExchange:
        # A rank that owns nothing still takes part (it sends and receives rows).
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
