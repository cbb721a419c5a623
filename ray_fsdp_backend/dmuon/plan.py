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

Floor: each matrix is orthogonalised whole by one rank, so no plan beats the
largest matrix (nor, with more matrices than ranks, the two that must share a
rank: :attr:`OwnershipPlan.whole_matrix_bound`). At scale that floor is the
critical path (the 1B preset at 256 ranks: one 5504 x 2048 matrix, about 1 ms
in bf16 on an H200); splitting matrices over ranks was measured to cost more
on GPUs than it saves (docs/dmuon.md).
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

DEFAULT_BUCKET_NUMEL = 1 << 25
"""Matrix elements each owner assembles per bucket (on average): 64 MiB of
bfloat16 travels while the previous bucket is orthogonalised."""


@dataclass(frozen=True)
class MatrixSpec:
    """One dedicated matrix: its parameter name (FQN) and global 2-D shape."""

    name: str
    shape: tuple[int, int]


def is_default_dedicated(
    ndim: int,
    *,
    in_block: bool,
    embedding: bool = False,
    expert_stack: bool = False,
    expert_bias: bool = False,
) -> bool:
    """DMuon's default choice for one parameter, from where it lives: a 2-D
    weight inside a block that is no embedding table, or an experts module's
    3-D weight stack (one matrix per expert). Everything else (outside the
    blocks, norms, biases, an experts module's bias stacks) goes to AdamW.
    The runtime (:func:`~ray_fsdp_backend.dmuon.selection.default_dedicated`)
    and ``plan`` (:func:`dedicated_from_shapes`) both decide with this."""
    if not in_block or expert_bias:
        return False
    return expert_stack or (ndim == 2 and not embedding)


def dedicated_from_shapes(
    params: Sequence[tuple[str, tuple[int, ...]]],
    block_prefixes: Sequence[str],
    embeddings: Sequence[str] = (),
) -> list[MatrixSpec]:
    """The 2-D matrices Muon orthogonalises among ``params`` (name, shape in
    model order; a model without expert stacks), the blocks being the
    modules named ``block_prefixes`` and ``embeddings`` the embedding tables'
    parameter names: what ``dedicated_specs`` returns for the built model."""
    prefixes = tuple(p + "." for p in block_prefixes)
    return [
        MatrixSpec(name, shape)
        for name, shape in params
        if is_default_dedicated(
            len(shape), in_block=name.startswith(prefixes), embedding=name in embeddings
        )
    ]


def ns_cost(shape: tuple[int, int], ns_steps: int = 5) -> int:
    """Multiply-adds of ``ns_steps`` quintic Newton–Schulz iterations on a
    matrix of ``shape``: each step forms the m x m Gram matrix (m = the smaller
    side, n = the larger), squares it and multiplies it back.
    """
    m, n = sorted(shape)
    return ns_steps * (2 * m * m * n + m * m * m)


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
    which matrices are packed into the exchange buffers.
    """

    matrices: tuple[MatrixSpec, ...]
    owners: tuple[int, ...]
    num_ranks: int
    buckets: tuple[tuple[int, ...], ...] = ()
    """Indices of the matrices of each exchange bucket, in the order they run
    (each bucket in plan order); empty: one bucket of all matrices."""

    def owned_by(self, rank: int) -> tuple[int, ...]:
        """Indices (into ``matrices``) of the matrices ``rank`` owns, in order."""
        return self._owned[rank]

    @cached_property
    def _owned(self) -> tuple[tuple[int, ...], ...]:
        return tuple(
            tuple(i for i, o in enumerate(self.owners) if o == r) for r in range(self.num_ranks)
        )

    @cached_property
    def loads(self) -> tuple[int, ...]:
        """Newton–Schulz cost (``ns_cost``) each rank carries."""
        load = [0] * self.num_ranks
        for spec, owner in zip(self.matrices, self.owners, strict=True):
            load[owner] += ns_cost(spec.shape)
        return tuple(load)

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
                load[self.owners[i]] += ns_cost(self.matrices[i].shape)
            total += max(load)
        return total

    @property
    def ideal(self) -> float:
        """Total Newton–Schulz cost spread evenly over the ranks."""
        return sum(self.loads) / self.num_ranks

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
        text = repr((self.num_ranks, self.matrices, self.owners, self.buckets)).encode()
        return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 2


def compute_ownership_plan(
    matrices: Sequence[MatrixSpec], num_ranks: int, bucket_numel: int | None = None
) -> OwnershipPlan:
    """Assign each matrix to one of ``num_ranks`` owners, balancing the
    Newton–Schulz cost (``ns_cost``: FLOPs, not counts): largest cost first,
    each onto the least loaded rank (ties: the lower rank; equal costs are
    taken in name order), then cut every rank's work into the same number of
    buckets (see :func:`schedule_buckets`). The result depends only on names,
    shapes, ``num_ranks`` and ``bucket_numel``.

    Raises:
        ValueError: ``num_ranks`` < 1, ``bucket_numel`` < 1, a shape that is
            not 2-D with positive sides, or a repeated name.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks} must be at least 1")
    _check_specs(matrices)
    if bucket_numel is not None and bucket_numel < 1:
        raise ValueError(f"bucket_numel={bucket_numel} must be at least 1 (or None)")
    order = sorted(
        range(len(matrices)), key=lambda i: (-ns_cost(matrices[i].shape), matrices[i].name)
    )
    heap = [(0, rank) for rank in range(num_ranks)]
    owners = [0] * len(matrices)
    for i in order:
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + ns_cost(matrices[i].shape), rank))
    plan = OwnershipPlan(matrices=tuple(matrices), owners=tuple(owners), num_ranks=num_ranks)
    buckets = schedule_buckets(plan, bucket_numel)
    return replace(plan, buckets=buckets) if len(buckets) > 1 else plan


def schedule_buckets(plan: OwnershipPlan, bucket_numel: int | None) -> tuple[tuple[int, ...], ...]:
    """Cut every rank's owned matrices into the same ``B`` buckets, each
    rank's share of a bucket costing about ``1 / B`` of its load, so that
    every bucket keeps every rank busy and the critical path (the sum over
    buckets of the busiest rank) stays near the busiest rank's total.

    ``B`` is the fewest buckets in which no owner assembles more than
    ``max(bucket_numel, largest matrix)`` elements on average; one bucket
    when ``bucket_numel`` is None. Each rank takes its matrices largest cost
    first and puts each into the bucket where the midpoint of its cost falls
    on the rank's cumulative load. Buckets are in plan order; empty ones are
    dropped.
    """
    numel = [spec.shape[0] * spec.shape[1] for spec in plan.matrices]
    if bucket_numel is None or not numel:
        return (tuple(range(len(numel))),)
    per_owner = max(bucket_numel, max(numel))
    count = max(-(-sum(numel[i] for i in plan.owned_by(r)) // per_owner)
                for r in range(plan.num_ranks))  # fmt: skip
    bucket_of = [0] * len(numel)
    for rank in range(plan.num_ranks):
        ids = sorted(plan.owned_by(rank), key=lambda i: (-_cost(plan, i), plan.matrices[i].name))
        done = 0
        for i in ids:
            mid = done + _cost(plan, i) / 2
            bucket_of[i] = min(count - 1, int(count * mid / plan.loads[rank]))
            done += _cost(plan, i)
    buckets = [[] for _ in range(count)]
    for i, b in enumerate(bucket_of):
        buckets[b].append(i)
    return tuple(tuple(b) for b in buckets if b)


def _cost(plan: OwnershipPlan, index: int) -> int:
    return ns_cost(plan.matrices[index].shape)


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
class RankLayout:
    """How one rank packs and unpacks the two exchanges of one bucket,
    computed once so that a step does no per-matrix arithmetic over all ranks.

    Shards to owners: this rank sends ``send_order`` (its rows of the
    bucket's matrices, grouped by owner, each owner's grouped by shape) in
    ``send_splits``, matrix by matrix in ``send_sizes[owner]``; as an owner
    it receives ``recv_splits``, from rank ``src`` the rows
    ``batch_rows[src][b]`` of every matrix of its ``b``-th ``ns_batches``
    entry, which it copies straight into that batch's stack. The way back is
    the same with the roles swapped. ``ns_batches`` groups the owned matrices
    by shape: one batched Newton–Schulz call each. ``owned`` lists them in
    plan order.
    """

    owned: tuple[int, ...]
    owners_of: tuple[tuple[int, ...], ...]
    send_order: tuple[int, ...]
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_sizes: tuple[tuple[int, ...], ...]
    send_sizes: tuple[tuple[int, ...], ...]
    row_ranges: dict[int, tuple[tuple[int, int], ...]]
    ns_batches: dict[tuple[int, int], tuple[int, ...]]
    batch_rows: tuple[tuple[tuple[int, int], ...], ...]


def compute_rank_layout(
    plan: OwnershipPlan, rank: int, bucket: Sequence[int] | None = None
) -> RankLayout:
    """The exchange layout of ``rank`` for ``bucket`` (plan indices; default:
    all matrices) under ``plan``."""
    n = plan.num_ranks
    chosen = set(range(len(plan.matrices)) if bucket is None else bucket)
    owners_of = tuple(
        _by_shape(plan, [i for i in plan.owned_by(o) if i in chosen]) for o in range(n)
    )
    batches: dict[tuple[int, int], list[int]] = {}
    for i in owners_of[rank]:
        batches.setdefault(plan.matrices[i].shape, []).append(i)
    send_sizes = tuple(tuple(plan.local_numel(i, rank) for i in ids) for ids in owners_of)
    recv_sizes = tuple(tuple(plan.local_numel(i, src) for i in owners_of[rank]) for src in range(n))
    return RankLayout(
        owned=tuple(sorted(owners_of[rank])),
        owners_of=owners_of,
        send_order=tuple(i for ids in owners_of for i in ids),
        send_splits=tuple(sum(sizes) for sizes in send_sizes),
        recv_splits=tuple(sum(sizes) for sizes in recv_sizes),
        recv_sizes=recv_sizes,
        send_sizes=send_sizes,
        row_ranges={i: chunk_rows(plan.matrices[i].shape[0], n) for i in owners_of[rank]},
        ns_batches={shape: tuple(ids) for shape, ids in batches.items()},
        batch_rows=tuple(tuple(row_range(rows, n, src) for rows, _ in batches) for src in range(n)),
    )


def _by_shape(plan: OwnershipPlan, ids: list[int]) -> tuple[int, ...]:
    """``ids`` grouped by shape (shapes in order of first appearance), so
    that each batch of an owner arrives as one block per sender."""
    first: dict[tuple[int, int], int] = {}
    for k, i in enumerate(ids):
        first.setdefault(plan.matrices[i].shape, k)
    return tuple(sorted(ids, key=lambda i: first[plan.matrices[i].shape]))


def format_ns_schedule(
    matrices: Sequence[MatrixSpec], num_ranks: int, bucket_numel: int = DEFAULT_BUCKET_NUMEL
) -> list[str]:
    """``ray-fsdp plan``'s lines on DMuon: Newton–Schulz work per rank and the
    step's critical path against the ideal (total / ``num_ranks``), for this
    schedule and for buckets cut in model order, and the largest matrix: the
    floor of any plan that orthogonalises each matrix on one rank."""
    if not matrices:
        return ["DMuon:    no dedicated matrices (everything goes to AdamW)"]
    plan = compute_ownership_plan(matrices, num_ranks, bucket_numel)
    in_order = replace(plan, buckets=compute_buckets(plan, bucket_numel))
    counts = [len(plan.owned_by(r)) for r in range(num_ranks)]
    tflop = 2 * sum(plan.loads) / 1e12  # a multiply-add is two FLOPs
    largest = max(matrices, key=lambda spec: ns_cost(spec.shape))
    return [
        f"DMuon:    Newton–Schulz on {len(matrices)} matrices, {tflop:,.2f} TFLOP per step, "
        f"owners among the {num_ranks} rank(s) of a shard group",
        f"  per rank       {min(counts)}-{max(counts)} matrices, "
        f"{min(plan.loads) / plan.ideal:.2f}-{max(plan.loads) / plan.ideal:.2f}x the ideal FLOPs",
        f"  critical path  {plan.critical_path / plan.ideal:.2f}x the ideal, "
        f"{len(plan.schedule)} bucket(s) (model-order buckets "
        f"{in_order.critical_path / plan.ideal:.2f}x; whole-matrix owners allow "
        f"{plan.whole_matrix_bound / plan.ideal:.2f}x)",
        f"  floor          one largest matrix ({largest.shape[0]}x{largest.shape[1]}) is "
        f"{ns_cost(largest.shape) / plan.ideal:.2f}x the ideal; the critical path is "
        f"{plan.critical_path / ns_cost(largest.shape):.2f} of them",
    ]
