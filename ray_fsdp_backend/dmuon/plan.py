"""PURE ownership planning for DMuon: which rank orthogonalises which matrix.

Every dedicated (Muon) matrix stays in FSDP2's row-sharded storage. Once per
step each matrix is assembled whole on ONE rank of its shard group, its
owner, which runs Newton–Schulz on it. This module decides the owners and the
exact layout of the two all-to-all exchanges that move row shards to owners
and orthogonalised rows back, from matrix names, shapes and the number of
ranks alone: every rank computes the same plan without communicating, and a
checkpoint taken at one world size is re-planned at another.

Row shards follow FSDP2's ``torch.chunk`` semantics: rank ``r`` of ``n`` holds
rows ``[r * c, min(rows, (r + 1) * c))`` with ``c = ceil(rows / n)``, so when a
matrix has fewer rows than there are ranks the last ranks hold none.

Scheduling: the exchanges and Newton–Schulz run bucket by bucket, and a rank
cannot run ahead of a bucket whose results others still wait for, so the
Newton–Schulz critical path of a step is the sum over buckets of the busiest
rank's cost (:attr:`OwnershipPlan.critical_path`), not the busiest rank's
total. Owners are therefore balanced by cost over all matrices, and then
every rank's work is cut into the same number of buckets of about equal
cost (:func:`schedule_buckets`), rather than cutting the model in order.

Teams: with whole matrices the critical path can never drop below the
largest matrix, and with fewer matrices than ranks some ranks idle (the 1B
preset has 154 matrices; at 256 ranks whole-matrix owners are 2.8x the
ideal). When they cannot come within :data:`TARGET_CRITICAL_PATH` of the
ideal, the planner splits the costliest matrices over teams: aligned blocks
of ``team_size`` consecutive ranks of the shard group, ``team_size`` a
divisor of ``max_team_size`` (with ``max_team_size`` the ranks per node and
ranks numbered node by node, no team crosses a node). Each member receives a
slice of the matrix's longer side and runs :func:`~ray_fsdp_backend.dmuon.
newton_schulz.zeropower_via_newtonschulz_split`: per iteration the team
all-reduces the ``m x m`` Gram matrix and all-gathers the rows of
``b A + c A^2`` each member formed, so each member's FLOPs are the whole
matrix's over ``team_size`` (:func:`team_ns_cost`). That traffic is the price
(:func:`team_traffic`: about ``15 m^2 (k - 1) / k`` elements per member and
matrix, against the ``2 m n`` the exchanges move per matrix), so the planner
takes the smallest team and the fewest split matrices that reach the target,
and none where whole matrices reach it. One team size per plan keeps each
team's members in lockstep: they share all their split matrices.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

TARGET_CRITICAL_PATH = 1.3
"""Critical path, as a multiple of the ideal, above which the planner splits
matrices over teams."""

DEFAULT_MAX_TEAM_SIZE = 8
"""Largest team the optimizer lets the planner form: one node of 8 GPUs."""

DEFAULT_BUCKET_NUMEL = 1 << 25
"""Matrix elements each owner assembles per bucket (on average): 64 MiB of
bfloat16 travels while the previous bucket is orthogonalised."""


@dataclass(frozen=True)
class MatrixSpec:
    """One dedicated matrix: its parameter name (FQN) and global 2-D shape."""

    name: str
    shape: tuple[int, int]


def ns_cost(shape: tuple[int, int], ns_steps: int = 5) -> int:
    """Multiply-adds of ``ns_steps`` quintic Newton–Schulz iterations on a
    matrix of ``shape``: each step forms the m x m Gram matrix (m = the smaller
    side, n = the larger), squares it and multiplies it back.
    """
    m, n = sorted(shape)
    return ns_steps * (2 * m * m * n + m * m * m)


def team_ns_cost(shape: tuple[int, int], team_size: int, ns_steps: int = 5) -> int:
    """Multiply-adds of each member of a team of ``team_size`` that splits a
    matrix of ``shape``: per step its slice of the larger side ``n`` in the
    Gram matrix and the product back, and its rows of ``A^2`` (``ns_cost``
    for a team of one)."""
    m, n = sorted(shape)
    return ns_steps * (2 * m * m * -(-n // team_size) + m * m * -(-m // team_size))


def row_range(rows: int, num_ranks: int, rank: int) -> tuple[int, int]:
    """``(start, stop)`` of the rows ``rank`` holds under ``torch.chunk``."""
    size = -(-rows // num_ranks)
    return min(rows, rank * size), min(rows, (rank + 1) * size)


def chunk_rows(rows: int, num_ranks: int) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` of the rows each rank holds under ``torch.chunk``."""
    return tuple(row_range(rows, num_ranks, r) for r in range(num_ranks))


@dataclass(frozen=True)
class OwnershipPlan:
    """Owners of the dedicated matrices of one shard group of ``num_ranks``.

    ``matrices`` keeps the caller's (model) order, which is also the order in
    which matrices are packed into the exchange buffers. A split matrix
    (``split[i]``) is worked on by the team of ``team_size`` ranks starting
    at ``owners[i]``; any other by ``owners[i]`` alone.
    """

    matrices: tuple[MatrixSpec, ...]
    owners: tuple[int, ...]
    num_ranks: int
    buckets: tuple[tuple[int, ...], ...] = ()
    """Indices of the matrices of each exchange bucket, in the order they run
    (each bucket in plan order); empty: one bucket of all matrices."""
    team_size: int = 1
    split: tuple[bool, ...] = ()
    """Per matrix: split over a team; empty: none is."""

    def is_split(self, index: int) -> bool:
        return bool(self.split) and self.split[index]

    def team(self, index: int) -> range:
        """The ranks that orthogonalise matrix ``index``."""
        size = self.team_size if self.is_split(index) else 1
        return range(self.owners[index], self.owners[index] + size)

    def cost(self, index: int) -> int:
        """Newton–Schulz cost of matrix ``index`` for each rank of its team."""
        return team_ns_cost(self.matrices[index].shape, len(self.team(index)))

    def piece(self, index: int, rank: int) -> tuple[int, int, int, int]:
        """``(row_start, row_stop, col_start, col_stop)`` of matrix ``index``
        that ``rank``, a member of its team, orthogonalises: the whole matrix,
        or the member's ``torch.chunk`` slice of the longer side (rows of a
        tall matrix, columns otherwise)."""
        rows, cols = self.matrices[index].shape
        if not self.is_split(index):
            return 0, rows, 0, cols
        part = rank - self.owners[index]
        if rows > cols:
            return (*row_range(rows, self.team_size, part), 0, cols)
        return (0, rows, *row_range(cols, self.team_size, part))

    def owned_by(self, rank: int) -> tuple[int, ...]:
        """Indices (into ``matrices``) of the matrices ``rank`` orthogonalises
        (alone or in its team), in order."""
        return self._owned[rank]

    @cached_property
    def _owned(self) -> tuple[tuple[int, ...], ...]:
        owned: list[list[int]] = [[] for _ in range(self.num_ranks)]
        for i in range(len(self.matrices)):
            for rank in self.team(i):
                owned[rank].append(i)
        return tuple(tuple(ids) for ids in owned)

    @cached_property
    def loads(self) -> tuple[int, ...]:
        """Newton–Schulz cost each rank carries (``cost``)."""
        return tuple(sum(self.cost(i) for i in ids) for ids in self._owned)

    @cached_property
    def schedule(self) -> tuple[tuple[int, ...], ...]:
        """The buckets in the order they run (``buckets``, or one of all)."""
        return self.buckets or (tuple(range(len(self.matrices))),)

    @cached_property
    def critical_path(self) -> int:
        """Newton–Schulz cost on the step's critical path: the sum over
        buckets of the busiest rank's cost in that bucket."""
        total = 0
        for bucket in self.schedule:
            load = [0] * self.num_ranks
            for i in bucket:
                for rank in self.team(i):
                    load[rank] += self.cost(i)
            total += max(load)
        return total

    @property
    def ideal(self) -> float:
        """Total Newton–Schulz cost of whole matrices spread evenly over the
        ranks (what teams add is counted against the plan, not the ideal)."""
        return sum(ns_cost(s.shape) for s in self.matrices) / self.num_ranks

    @property
    def whole_matrix_bound(self) -> float:
        """A lower bound on the critical path of any plan that gives each
        matrix to one rank: the ideal, the largest matrix, and, with more
        matrices than ranks, the ``N``-th plus ``N + 1``-th largest (two of
        them share a rank)."""
        costs = sorted((ns_cost(s.shape) for s in self.matrices), reverse=True)
        n = self.num_ranks
        pair = costs[n - 1] + costs[n] if len(costs) > n else 0
        return max(self.ideal, costs[0] if costs else 0, pair)

    def local_numel(self, index: int, rank: int) -> int:
        """Elements of matrix ``index`` held by ``rank``."""
        rows, cols = self.matrices[index].shape
        start, stop = row_range(rows, self.num_ranks, rank)
        return (stop - start) * cols

    def fingerprint(self) -> int:
        """A hash of the whole plan in ``[0, 2**62)`` (it and its negation fit
        an int64 tensor), for checking that every rank computed the same one."""
        fields = (self.num_ranks, self.matrices, self.owners, self.buckets)
        text = repr((*fields, self.team_size, self.split)).encode()
        return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 2


def compute_ownership_plan(
    matrices: Sequence[MatrixSpec],
    num_ranks: int,
    bucket_numel: int | None = None,
    max_team_size: int = 1,
) -> OwnershipPlan:
    """Assign each matrix to one of ``num_ranks`` owners, balancing the
    Newton–Schulz cost (``ns_cost``: FLOPs, not counts): largest cost first,
    each onto the least loaded rank (ties: the lower rank; equal costs are
    taken in name order), then cut every rank's work into the same number of
    buckets (see :func:`schedule_buckets`).

    Where that critical path exceeds :data:`TARGET_CRITICAL_PATH` times the
    ideal and ``max_team_size`` > 1, split matrices over teams (module
    docstring): the smallest team size dividing ``max_team_size``, and the
    fewest of the costliest matrices, that reach the target; the best plan tried
    when none does. The result depends only on names, shapes, ``num_ranks``,
    ``bucket_numel`` and ``max_team_size``.

    Raises:
        ValueError: ``num_ranks``, ``bucket_numel`` or ``max_team_size`` < 1,
            a shape that is not 2-D with positive sides, or a repeated name.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks} must be at least 1")
    _check_specs(matrices)
    if bucket_numel is not None and bucket_numel < 1:
        raise ValueError(f"bucket_numel={bucket_numel} must be at least 1 (or None)")
    if max_team_size < 1:
        raise ValueError(f"max_team_size={max_team_size} must be at least 1")
    best = _assign(matrices, num_ranks, bucket_numel, 1, ())
    target = TARGET_CRITICAL_PATH * best.ideal
    costs = [ns_cost(spec.shape) for spec in matrices]
    sizes = [k for k in range(2, min(max_team_size, num_ranks) + 1) if max_team_size % k == 0]
    for k in sizes if best.critical_path > target else ():
        for threshold in sorted(set(costs), reverse=True):
            split = tuple(c >= threshold for c in costs)
            plan = _assign(matrices, num_ranks, bucket_numel, k, split)
            if plan.critical_path <= target:
                return plan
            best = min(best, plan, key=lambda p: p.critical_path)
    return best


def _assign(
    matrices: Sequence[MatrixSpec],
    num_ranks: int,
    bucket_numel: int | None,
    team_size: int,
    split: tuple[bool, ...],
) -> OwnershipPlan:
    """Split matrices onto the least loaded team (aligned blocks of
    ``team_size`` ranks), then the others onto the least loaded rank, each
    largest cost first."""
    order = sorted(
        range(len(matrices)), key=lambda i: (-ns_cost(matrices[i].shape), matrices[i].name)
    )
    owners = [0] * len(matrices)
    teams = [(0, block * team_size) for block in range(num_ranks // team_size)]
    for i in (i for i in order if split and split[i]):
        load, first = heapq.heappop(teams)
        owners[i] = first
        heapq.heappush(teams, (load + team_ns_cost(matrices[i].shape, team_size), first))
    team_load = {first: load for load, first in teams}
    heap = [(team_load.get(rank - rank % team_size, 0), rank) for rank in range(num_ranks)]
    heapq.heapify(heap)
    for i in (i for i in order if not (split and split[i])):
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + ns_cost(matrices[i].shape), rank))
    plan = OwnershipPlan(
        matrices=tuple(matrices),
        owners=tuple(owners),
        num_ranks=num_ranks,
        team_size=team_size if any(split) else 1,
        split=split if any(split) else (),
    )
    buckets = schedule_buckets(plan, bucket_numel)
    return replace(plan, buckets=buckets) if len(buckets) > 1 else plan


def schedule_buckets(plan: OwnershipPlan, bucket_numel: int | None) -> tuple[tuple[int, ...], ...]:
    """Cut every rank's owned matrices into the same ``B`` buckets, each
    rank's share of a bucket costing about ``1 / B`` of its load, so that
    every bucket keeps every rank busy and the critical path (the sum over
    buckets of the busiest rank) stays near the busiest rank's total.

    ``B`` is the fewest buckets in which no rank assembles more than
    ``max(bucket_numel, largest matrix)`` elements on average; one bucket
    when ``bucket_numel`` is None. Each rank takes its matrices largest cost
    first (its team's split ones before its own) and puts each into the
    bucket where the midpoint of its cost falls on the rank's cumulative
    load; for split matrices, the load of the team's busiest member, so that
    all members put them in the same bucket. Buckets are in plan order;
    empty ones are dropped.
    """
    numel = [spec.shape[0] * spec.shape[1] for spec in plan.matrices]
    if bucket_numel is None or not numel:
        return (tuple(range(len(numel))),)
    per_owner = max(bucket_numel, max(numel))
    count = max(-(-sum(numel[i] // len(plan.team(i)) for i in plan.owned_by(r)) // per_owner)
                for r in range(plan.num_ranks))  # fmt: skip
    bucket_of = [0] * len(numel)
    for rank in range(plan.num_ranks):
        ids = sorted(
            plan.owned_by(rank),
            key=lambda i: (not plan.is_split(i), -plan.cost(i), plan.matrices[i].name),
        )
        done = 0
        for i in ids:
            mid = done + plan.cost(i) / 2
            load = max(plan.loads[r] for r in plan.team(i))
            bucket_of[i] = min(count - 1, int(count * mid / load))
            done += plan.cost(i)
    buckets = [[] for _ in range(count)]
    for i, b in enumerate(bucket_of):
        buckets[b].append(i)
    return tuple(tuple(b) for b in buckets if b)


def _check_specs(matrices: Sequence[MatrixSpec]) -> None:
    seen: set[str] = set()
    for spec in matrices:
        if len(spec.shape) != 2 or min(spec.shape) < 1:
            raise ValueError(
                f"dedicated parameter {spec.name!r} has shape {tuple(spec.shape)}: Muon "
                "orthogonalises 2-D matrices with positive sides only"
            )
        if spec.name in seen:
            raise ValueError(f"dedicated parameter name {spec.name!r} appears twice")
        seen.add(spec.name)


def compute_buckets(plan: OwnershipPlan, max_numel: int | None) -> tuple[tuple[int, ...], ...]:
    """The matrices in plan (model) order, cut into consecutive buckets of at
    most ``max_numel`` elements (a larger matrix is a bucket of its own); one
    bucket when ``max_numel`` is None. The optimizer runs ``plan.schedule``
    (:func:`schedule_buckets`) instead: model-order buckets leave most ranks
    idle in each bucket (``ray-fsdp plan`` prints both critical paths).

    Raises:
        ValueError: ``max_numel`` < 1.
    """
    if max_numel is not None and max_numel < 1:
        raise ValueError(f"bucket_numel={max_numel} must be at least 1 (or None)")
    buckets: list[list[int]] = []
    size = 0
    for i, spec in enumerate(plan.matrices):
        numel = spec.shape[0] * spec.shape[1]
        if not buckets or (max_numel is not None and size + numel > max_numel):
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += numel
    return tuple(tuple(b) for b in buckets)


@dataclass(frozen=True)
class NSBatch:
    """Matrices of one shape that a rank orthogonalises in one batched call:
    whole (``split`` False, ``piece == shape``) or its team's slices of
    split ones (``piece``: the shape of its slice)."""

    shape: tuple[int, int]
    ids: tuple[int, ...]
    split: bool
    piece: tuple[int, int]


@dataclass(frozen=True)
class RankLayout:
    """How one rank packs and unpacks the two exchanges of one bucket,
    computed once so that a step does no per-matrix arithmetic over all ranks.

    Shards to owners: this rank sends ``send_order`` (its rows of the
    bucket's matrices, grouped by the rank that orthogonalises them, each
    receiver's in its batch order) in ``send_splits``, matrix by matrix in
    ``send_sizes[dst]``, each cut from its shard at ``send_regions[dst]``
    (local ``(row_start, row_stop, col_start, col_stop)``: the whole shard
    for a whole matrix, its part of the receiver's piece for a split one). As
    a receiver it gets ``recv_splits``: from rank ``src`` the piece rows
    ``batch_rows[src][b]`` of every matrix of its ``b``-th batch
    (``batches``), which it copies straight into that batch's stack. The way
    back is the same with the roles swapped. ``batches`` lists the batched
    Newton–Schulz calls, a team's first; ``ns_batches`` maps the shapes of
    the whole-matrix ones to their ids. ``owned`` lists the matrices in plan
    order.
    """

    owned: tuple[int, ...]
    owners_of: tuple[tuple[int, ...], ...]
    send_order: tuple[int, ...]
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_sizes: tuple[tuple[int, ...], ...]
    send_sizes: tuple[tuple[int, ...], ...]
    send_regions: tuple[tuple[tuple[int, int, int, int], ...], ...]
    row_ranges: dict[int, tuple[tuple[int, int], ...]]
    ns_batches: dict[tuple[int, int], tuple[int, ...]]
    batches: tuple[NSBatch, ...]
    batch_rows: tuple[tuple[tuple[int, int], ...], ...]


def compute_rank_layout(
    plan: OwnershipPlan, rank: int, bucket: Sequence[int] | None = None
) -> RankLayout:
    """The exchange layout of ``rank`` for ``bucket`` (plan indices; default:
    all matrices) under ``plan``."""
    n = plan.num_ranks
    chosen = set(range(len(plan.matrices)) if bucket is None else bucket)
    owners_of = tuple(
        _batch_order(plan, [i for i in plan.owned_by(o) if i in chosen]) for o in range(n)
    )
    whole: dict[tuple[int, int], list[int]] = {}
    team: dict[tuple[int, int], list[int]] = {}
    for i in owners_of[rank]:
        (team if plan.is_split(i) else whole).setdefault(plan.matrices[i].shape, []).append(i)
    batches = []
    for shape, ids in team.items():
        r0, r1, c0, c1 = plan.piece(ids[0], rank)
        batches.append(NSBatch(shape, tuple(ids), True, (r1 - r0, c1 - c0)))
    batches += [NSBatch(shape, tuple(ids), False, shape) for shape, ids in whole.items()]
    regions = tuple(tuple(_send_region(plan, i, rank, dst) for i in ids)
                    for dst, ids in enumerate(owners_of))  # fmt: skip
    send_sizes = tuple(tuple((b - a) * (d - c) for a, b, c, d in regs) for regs in regions)
    batch_rows = tuple(tuple(_piece_rows(plan, b.ids[0], rank, src) for b in batches)
                       for src in range(n))  # fmt: skip
    recv_sizes = tuple(
        tuple(
            (stop - start) * batch.piece[1]
            for batch, (start, stop) in zip(batches, rows, strict=True)
            for _ in batch.ids
        )
        for rows in batch_rows
    )
    return RankLayout(
        owned=tuple(sorted(owners_of[rank])),
        owners_of=owners_of,
        send_order=tuple(i for ids in owners_of for i in ids),
        send_splits=tuple(sum(sizes) for sizes in send_sizes),
        recv_splits=tuple(sum(sizes) for sizes in recv_sizes),
        recv_sizes=recv_sizes,
        send_sizes=send_sizes,
        send_regions=regions,
        row_ranges={i: chunk_rows(plan.matrices[i].shape[0], n) for i in owners_of[rank]},
        ns_batches={shape: tuple(ids) for shape, ids in whole.items()},
        batches=tuple(batches),
        batch_rows=batch_rows,
    )


def _batch_order(plan: OwnershipPlan, ids: list[int]) -> tuple[int, ...]:
    """``ids`` grouped split before whole (a team's members run their shared
    batches first, in step), then by shape (shapes in order of first
    appearance), so that each batch of a receiver arrives as one block per
    sender."""
    first: dict[tuple[bool, tuple[int, int]], int] = {}
    key = {i: (plan.is_split(i), plan.matrices[i].shape) for i in ids}
    for k, i in enumerate(ids):
        first.setdefault(key[i], k)
    return tuple(sorted(ids, key=lambda i: (not key[i][0], first[key[i]])))


def _held_rows(plan: OwnershipPlan, index: int, src: int, dst: int) -> tuple[int, int]:
    """The rows of ``dst``'s piece of matrix ``index`` that ``src`` holds, as
    a global ``[start, stop)`` (empty: ``start == stop``, possibly outside
    both ranges, which slices to nothing)."""
    r0, r1, _, _ = plan.piece(index, dst)
    s0, s1 = row_range(plan.matrices[index].shape[0], plan.num_ranks, src)
    start = max(r0, s0)
    return start, max(start, min(r1, s1))


def _piece_rows(plan: OwnershipPlan, index: int, rank: int, src: int) -> tuple[int, int]:
    """Rows of ``rank``'s piece of matrix ``index`` that ``src`` holds, in
    the piece's own row numbers."""
    r0 = plan.piece(index, rank)[0]
    start, stop = _held_rows(plan, index, src, rank)
    return start - r0, stop - r0


def _send_region(plan: OwnershipPlan, index: int, src: int, dst: int) -> tuple[int, int, int, int]:
    """The part of ``dst``'s piece of matrix ``index`` in ``src``'s shard, in
    the shard's own rows: ``(row_start, row_stop, col_start, col_stop)``."""
    _, _, c0, c1 = plan.piece(index, dst)
    s0 = row_range(plan.matrices[index].shape[0], plan.num_ranks, src)[0]
    start, stop = _held_rows(plan, index, src, dst)
    return start - s0, stop - s0, c0, c1


def team_traffic(plan: OwnershipPlan, rank: int, ns_steps: int = 5) -> int:
    """Elements ``rank`` sends in its team's collectives per step: for each
    split matrix it shares, ring all-reduces of the squared norm and of the
    ``m x m`` Gram matrix, and an all-gather of its rows of ``b A + c A^2``
    (padded to ``ceil(m / k)``), at each of ``ns_steps`` iterations."""
    k, total = plan.team_size, 0
    for i in plan.owned_by(rank):
        if plan.is_split(i):
            m = min(plan.matrices[i].shape)
            per_step = 2 * (k - 1) * m * m / k + (k - 1) * -(-m // k) * m
            total += 2 * (k - 1) / k + ns_steps * per_step
    return round(total)


def format_ns_schedule(
    matrices: Sequence[MatrixSpec],
    num_ranks: int,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    max_team_size: int = DEFAULT_MAX_TEAM_SIZE,
) -> list[str]:
    """``ray-fsdp plan``'s lines on DMuon: Newton–Schulz work per rank and the
    step's critical path against the ideal (total / ``num_ranks``), for this
    schedule, for whole-matrix owners and for buckets cut in model order;
    with teams, what their collectives send."""
    if not matrices:
        return ["DMuon:    no dedicated matrices (everything goes to AdamW)"]
    plan = compute_ownership_plan(matrices, num_ranks, bucket_numel, max_team_size)
    whole = compute_ownership_plan(matrices, num_ranks, bucket_numel) if plan.split else plan
    in_order = replace(whole, buckets=compute_buckets(whole, bucket_numel))
    counts = [len(plan.owned_by(r)) for r in range(num_ranks)]
    tflop = 2 * plan.ideal * num_ranks / 1e12  # a multiply-add is two FLOPs
    lines = [
        f"DMuon:    Newton–Schulz on {len(matrices)} matrices, {tflop:,.2f} TFLOP per step, "
        f"owners among the {num_ranks} rank(s) of a shard group",
        f"  per rank       {min(counts)}-{max(counts)} matrices, "
        f"{min(plan.loads) / plan.ideal:.2f}-{max(plan.loads) / plan.ideal:.2f}x the ideal FLOPs",
        f"  critical path  {plan.critical_path / plan.ideal:.2f}x the ideal, "
        f"{len(plan.schedule)} bucket(s) (model-order buckets "
        f"{in_order.critical_path / plan.ideal:.2f}x; whole-matrix owners "
        f"{whole.critical_path / plan.ideal:.2f}x, at best "
        f"{plan.whole_matrix_bound / plan.ideal:.2f}x)",
    ]
    if plan.team_size > 1:
        held = max(sum(plan.local_numel(i, r) for i in range(len(matrices)))
                   for r in range(num_ranks))  # fmt: skip
        team = max(team_traffic(plan, r) for r in range(num_ranks))
        lines.append(
            f"  teams          {sum(plan.split)} matrices split over teams of {plan.team_size} "
            f"ranks: up to {team * 2 / 2**20:,.1f} MiB sent per rank and step in bf16 "
            f"({team / (2 * held):.1f}x what the exchanges send)"
        )
    return lines
