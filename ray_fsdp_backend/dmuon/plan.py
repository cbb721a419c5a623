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
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property


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

    def local_numel(self, index: int, rank: int) -> int:
        """Elements of matrix ``index`` held by ``rank``."""
        rows, cols = self.matrices[index].shape
        start, stop = row_range(rows, self.num_ranks, rank)
        return (stop - start) * cols

    def fingerprint(self) -> int:
        """A hash of the whole plan in ``[0, 2**62)`` (it and its negation fit
        an int64 tensor), for checking that every rank computed the same one."""
        text = repr((self.num_ranks, self.matrices, self.owners)).encode()
        return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 2


def compute_ownership_plan(matrices: Sequence[MatrixSpec], num_ranks: int) -> OwnershipPlan:
    """Assign each matrix to one of ``num_ranks`` owners, balancing the
    Newton–Schulz cost: largest cost first, each onto the least loaded rank
    (ties: the lower rank; equal costs are taken in name order), so the result
    depends only on names, shapes and ``num_ranks``.

    Raises:
        ValueError: ``num_ranks`` < 1, a shape that is not 2-D with positive
            sides, or a repeated name.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks} must be at least 1")
    _check_specs(matrices)
    order = sorted(
        range(len(matrices)), key=lambda i: (-ns_cost(matrices[i].shape), matrices[i].name)
    )
    heap = [(0, rank) for rank in range(num_ranks)]
    owners = [0] * len(matrices)
    for i in order:
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + ns_cost(matrices[i].shape), rank))
    return OwnershipPlan(matrices=tuple(matrices), owners=tuple(owners), num_ranks=num_ranks)


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
    """The matrices in plan order, cut into consecutive buckets of at most
    ``max_numel`` elements (a larger matrix is a bucket of its own); one
    bucket when ``max_numel`` is None. Each bucket is one pair of exchanges,
    so the next bucket travels while the owners orthogonalise this one.

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
    bucket's matrices, grouped by owner) in ``send_splits``; as an owner it
    receives ``recv_splits``, and from rank ``src`` the rows of its owned
    matrices in sizes ``recv_sizes[src]``. The way back is the same with the
    roles swapped: it sends ``recv_splits``, cutting each owned matrix ``i``
    at ``row_ranges[i]``, and receives ``send_splits``, unpacked by owner
    (``owners_of[owner]``) in sizes ``send_sizes[owner]``. ``ns_batches``
    groups the owned matrices by shape: one batched Newton–Schulz call each.
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


def compute_rank_layout(
    plan: OwnershipPlan, rank: int, bucket: Sequence[int] | None = None
) -> RankLayout:
    """The exchange layout of ``rank`` for ``bucket`` (plan indices; default:
    all matrices) under ``plan``."""
    n = plan.num_ranks
    chosen = set(range(len(plan.matrices)) if bucket is None else bucket)
    owners_of = tuple(tuple(i for i in plan.owned_by(o) if i in chosen) for o in range(n))
    owned = owners_of[rank]
    send_sizes = tuple(tuple(plan.local_numel(i, rank) for i in ids) for ids in owners_of)
    recv_sizes = tuple(tuple(plan.local_numel(i, src) for i in owned) for src in range(n))
    batches: dict[tuple[int, int], list[int]] = {}
    for i in owned:
        batches.setdefault(plan.matrices[i].shape, []).append(i)
    return RankLayout(
        owned=owned,
        owners_of=owners_of,
        send_order=tuple(i for ids in owners_of for i in ids),
        send_splits=tuple(sum(sizes) for sizes in send_sizes),
        recv_splits=tuple(sum(sizes) for sizes in recv_sizes),
        recv_sizes=recv_sizes,
        send_sizes=send_sizes,
        row_ranges={i: chunk_rows(plan.matrices[i].shape[0], n) for i in owned},
        ns_batches={shape: tuple(ids) for shape, ids in batches.items()},
    )
