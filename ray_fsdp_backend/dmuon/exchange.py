"""The collectives of DMuon: row shards to owners and back, by all-to-all,
and those of teams.

Where a matrix's rows live and who owns it is decided by the pure
:mod:`~ray_fsdp_backend.dmuon.plan`; this module only packs tensors in the
plan's order and calls ``all_to_all_single`` on the shard group, one pair
per bucket of matrices, asynchronously so that the next bucket travels while
the owners orthogonalise this one. A matrix split over a team travels the
same way, each member receiving only its slice (the layout's pieces); the
team's members then all-reduce their partial Gram matrices and all-gather
rows of the Newton–Schulz polynomial on a process group of their own
(:class:`Team`, ``form_teams``). Each side packs and unpacks with one
copy: the momentum update is copied into the send buffer, an owner copies
each sender's block of a batch straight into the batch's stack (no copy at
all in a group of one), and results go back the same way. Uneven splits are fine for
``all_to_all_single`` on gloo and NCCL alike (unlike gloo's ``gather``), so
nothing is padded, and a rank that holds no rows of a matrix (more ranks
than rows) simply sends nothing for it. The layout never depends on
gradients, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ray_fsdp_backend.dmuon.plan import OwnershipPlan, RankLayout, compute_rank_layout, row_range

Stacks = list[torch.Tensor]
"""What a rank orthogonalises in one bucket: a ``(count, rows, cols)`` stack
per entry of its layout's ``batches``."""


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
class Team:
    """The ranks that split matrices among themselves: member ``rank`` of
    ``size`` on ``group`` (None: the default group). ``sent`` is called with
    the bytes each collective sends from this rank, as a ring does."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    sent: Callable[[int], None] = lambda nbytes: None

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the team, in place."""
        self.sent(2 * (self.size - 1) * tensor.numel() * tensor.element_size() // self.size)
        dist.all_reduce(tensor, group=self.group)

    def all_gather_rows(self, rows: torch.Tensor, total: int) -> torch.Tensor:
        """Members' ``torch.chunk`` row blocks ``(batch, rows_j, cols)`` of a
        ``(batch, total, cols)`` stack, gathered whole on every member (each
        block padded to the largest, as ``all_gather`` needs equal sizes)."""
        chunk = -(-total // self.size)
        send = rows.new_zeros(rows.size(0), chunk, rows.size(2))
        send[:, : rows.size(1)] = rows
        blocks = [torch.empty_like(send) for _ in range(self.size)]
        self.sent((self.size - 1) * send.numel() * send.element_size())
        dist.all_gather(blocks, send, group=self.group)
        return torch.cat(blocks, dim=1)[:, :total]


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
        self.team: Team | None = None
        """This rank's team (``form_teams``); None: it is in none."""
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

    def form_teams(self) -> None:
        """Create this rank's :class:`Team` (``self.team``) when the plan
        splits matrices over teams: aligned blocks of ``plan.team_size``
        ranks of the shard group, each on a process group of its own (the
        shard group's when one team spans it). Only each team's members take
        part in creating it; call it on every rank after ``verify_consistent``."""
        size, rank = self.plan.team_size, self.shard.rank
        if size == 1 or rank >= self.shard.size // size * size:
            return
        group = self.shard.process_group
        if size < self.shard.size:
            ranks = dist.get_process_group_ranks(group)
            first = rank - rank % size
            group = dist.new_group(ranks[first : first + size], use_local_synchronization=True)
        self.team = Team(group, rank % size, size, self._count_team_bytes)

    def _count_team_bytes(self, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.bytes_received += nbytes

    def start_to_owners(
        self, bucket: int, updates: dict[int, torch.Tensor | None]
    ) -> PendingExchange:
        """Send this rank's rows of ``bucket``'s matrices (``updates``, by
        plan index: the local ``(rows, cols)`` shard of each, or None for
        zeros) to the ranks that orthogonalise them: one copy each into the
        send buffer, cut by the layout's regions."""
        lay = self.layouts[bucket]
        buf = torch.empty(sum(lay.send_splits), dtype=self.dtype, device=self.device)
        regions = [region for regions in lay.send_regions for region in regions]
        sizes = [size for sizes in lay.send_sizes for size in sizes]
        for i, (a, b, c, d), piece in zip(lay.send_order, regions, buf.split(sizes), strict=True):
            piece = piece.view(b - a, d - c)
            if updates[i] is None:
                piece.zero_()
            else:
                piece.copy_(updates[i][a:b, c:d])
        return self._start(buf, lay.recv_splits, lay.send_splits, lay)

    def finish_to_owners(self, pending: PendingExchange) -> Stacks:
        """The pieces this rank orthogonalises in the bucket (whole matrices
        or its slices of split ones), one ``(count, rows, cols)`` stack per
        ``layout.batches`` entry; a sender's block that already is the whole
        stack (a group of one) is used as it is."""
        lay = self._wait(pending)
        stacks: Stacks = [None] * len(lay.batches)
        for src, chunk in enumerate(pending.out.split(lay.recv_splits)):
            sizes = self._batch_sizes(lay, src)
            for b, (batch, (start, stop), block) in enumerate(
                zip(lay.batches, lay.batch_rows[src], chunk.split(sizes), strict=True)
            ):
                rows, cols = batch.piece
                block = block.view(len(batch.ids), stop - start, cols)
                if stop - start == rows:
                    stacks[b] = block
                elif stop > start:
                    if stacks[b] is None:
                        stacks[b] = block.new_empty(len(batch.ids), rows, cols)
                    stacks[b][:, start:stop].copy_(block)
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
            for batch, result, (start, stop) in zip(lay.batches, results, rows, strict=True):
                block = next(blocks).view(len(batch.ids), stop - start, batch.piece[1])
                block.copy_(result[:, start:stop])
        return self._start(buf, lay.send_splits, lay.recv_splits, lay)

    def finish_to_shards(self, pending: PendingExchange) -> dict[int, torch.Tensor]:
        """This rank's rows ``(rows, cols)`` of every matrix of the bucket, by
        plan index."""
        lay = self._wait(pending)
        if pending.out is None:  # a group of one: the results themselves
            return {
                i: stack[k]
                for batch, stack in zip(lay.batches, pending.send, strict=True)
                for k, i in enumerate(batch.ids)
            }
        shards: dict[int, torch.Tensor] = {}
        for owner, chunk in enumerate(pending.out.split(lay.send_splits)):
            ids, regions = lay.owners_of[owner], lay.send_regions[owner]
            pieces = chunk.split(lay.send_sizes[owner])
            for i, (a, b, c, d), piece in zip(ids, regions, pieces, strict=True):
                rows, cols = self.plan.matrices[i].shape
                if not self.plan.is_split(i):
                    shards[i] = piece.view(-1, cols)
                    continue
                if i not in shards:  # the team's pieces cover the shard
                    start, stop = row_range(rows, self.shard.size, self.shard.rank)
                    shards[i] = piece.new_empty(stop - start, cols)
                shards[i][a:b, c:d].copy_(piece.view(b - a, d - c))
        return shards

    @staticmethod
    def _batch_sizes(lay: RankLayout, src: int) -> list[int]:
        rows = lay.batch_rows[src]
        return [
            len(batch.ids) * (stop - start) * batch.piece[1]
            for batch, (start, stop) in zip(lay.batches, rows, strict=True)
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
