"""PURE DMuon ownership planning: owners, balance, exchange layout, hashing."""

from __future__ import annotations

import itertools

import pytest
import torch

from ray_fsdp_backend.dmuon.plan import (
    MatrixSpec,
    chunk_rows,
    compute_buckets,
    compute_ownership_plan,
    compute_rank_layout,
    ns_cost,
)

SPECS = [
    MatrixSpec("layers.0.attn.qkv", (48, 16)),
    MatrixSpec("layers.0.attn.out", (16, 16)),
    MatrixSpec("layers.0.mlp.up", (64, 16)),
    MatrixSpec("layers.0.mlp.down", (16, 64)),
    MatrixSpec("layers.1.attn.qkv", (48, 16)),
    MatrixSpec("layers.1.attn.out", (16, 16)),
    MatrixSpec("layers.1.mlp.up", (64, 16)),
    MatrixSpec("layers.1.mlp.down", (16, 64)),
    MatrixSpec("layers.1.router", (3, 16)),
]


@pytest.mark.parametrize("rows, n", [(8, 4), (9, 4), (3, 4), (1, 8), (16, 1), (5, 3)])
def test_chunk_rows_matches_torch_chunk(rows, n):
    chunks = torch.arange(rows).chunk(n)
    expected = [(int(c[0]), int(c[-1]) + 1) for c in chunks]
    got = [r for r in chunk_rows(rows, n) if r[1] > r[0]]
    assert got == expected
    assert len(chunk_rows(rows, n)) == n


def test_ns_cost_is_symmetric_and_grows_with_size():
    assert ns_cost((16, 64)) == ns_cost((64, 16))
    assert ns_cost((64, 64)) > ns_cost((16, 64)) > ns_cost((16, 16))
    assert ns_cost((16, 16), ns_steps=10) == 2 * ns_cost((16, 16))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 16])
def test_every_matrix_has_one_owner_and_load_is_balanced(n):
    plan = compute_ownership_plan(SPECS, n)
    assert len(plan.owners) == len(SPECS)
    assert sorted(i for r in range(n) for i in plan.owned_by(r)) == list(range(len(SPECS)))
    assert sum(plan.loads) == sum(ns_cost(s.shape) for s in SPECS)
    # Greedy largest-first: the spread is at most the largest single cost.
    assert max(plan.loads) - min(plan.loads) <= max(ns_cost(s.shape) for s in SPECS)


def test_largest_first_onto_least_loaded_with_deterministic_ties():
    specs = [MatrixSpec("b", (4, 4)), MatrixSpec("a", (4, 4)), MatrixSpec("big", (8, 8))]
    plan = compute_ownership_plan(specs, 2)
    owner = dict(zip([s.name for s in specs], plan.owners, strict=True))
    # big -> rank 0; then equal costs in name order: a -> rank 1, b -> rank 1.
    assert owner == {"big": 0, "a": 1, "b": 1}


def test_owners_depend_on_names_and_shapes_not_on_order():
    base = compute_ownership_plan(SPECS, 3)
    by_name = dict(zip([s.name for s in SPECS], base.owners, strict=True))
    for perm in itertools.islice(itertools.permutations(SPECS), 0, 50, 7):
        plan = compute_ownership_plan(list(perm), 3)
        assert dict(zip([s.name for s in perm], plan.owners, strict=True)) == by_name


@pytest.mark.parametrize("n", [1, 2, 4, 16])
def test_exchange_layout_is_consistent_between_senders_and_owners(n):
    plan = compute_ownership_plan(SPECS, n)
    layouts = [compute_rank_layout(plan, r) for r in range(n)]
    for owner, lay in enumerate(layouts):
        # What each rank sends to ``owner`` is what ``owner`` expects from it.
        assert tuple(layouts[src].send_splits[owner] for src in range(n)) == lay.recv_splits
        assert lay.recv_sizes == tuple(layouts[src].send_sizes[owner] for src in range(n))
        full = sum(SPECS[i].shape[0] * SPECS[i].shape[1] for i in lay.owned)
        assert sum(lay.recv_splits) == full
        for i in lay.owned:
            assert lay.row_ranges[i] == chunk_rows(SPECS[i].shape[0], n)
    for src, lay in enumerate(layouts):
        assert sorted(lay.send_order) == list(range(len(SPECS)))
        assert [plan.owners[i] for i in lay.send_order] == sorted(plan.owners)
        held = sum(plan.local_numel(i, src) for i in range(len(SPECS)))
        assert sum(lay.send_splits) == held


def test_more_ranks_than_rows_leaves_empty_shards():
    plan = compute_ownership_plan(SPECS, 16)
    router = next(i for i, s in enumerate(SPECS) if s.name.endswith("router"))
    assert [plan.local_numel(router, r) for r in range(16)] == [16] * 3 + [0] * 13
    assert any(not plan.owned_by(r) for r in range(16))  # more ranks than matrices


def test_ns_batches_group_owned_matrices_by_shape():
    plan = compute_ownership_plan(SPECS, 1)
    batches = compute_rank_layout(plan, 0).ns_batches
    assert set(batches) == {s.shape for s in SPECS}
    assert sum(len(ids) for ids in batches.values()) == len(SPECS)
    assert all(SPECS[i].shape == shape for shape, ids in batches.items() for i in ids)


@pytest.mark.parametrize("cap", [None, 1, 768, 2048, 10**9])
def test_buckets_cut_plan_order_under_the_cap(cap):
    plan = compute_ownership_plan(SPECS, 4)
    buckets = compute_buckets(plan, cap)
    assert [i for b in buckets for i in b] == list(range(len(SPECS)))
    numel = [s.shape[0] * s.shape[1] for s in SPECS]
    for b in buckets:
        assert cap is None or len(b) == 1 or sum(numel[i] for i in b) <= cap
    if cap is None or cap >= sum(numel):
        assert len(buckets) == 1
    # Per-bucket layouts together cover every owned matrix once.
    for rank in range(4):
        owned = [i for b in buckets for i in compute_rank_layout(plan, rank, b).owned]
        assert owned == list(plan.owned_by(rank))


def test_bucket_cap_must_be_positive():
    with pytest.raises(ValueError, match="bucket_numel=0"):
        compute_buckets(compute_ownership_plan(SPECS, 2), 0)


def test_fingerprint_identifies_the_plan():
    a = compute_ownership_plan(SPECS, 4)
    assert a.fingerprint() == compute_ownership_plan(list(SPECS), 4).fingerprint()
    assert 0 <= a.fingerprint() < 2**62
    changed = [MatrixSpec(SPECS[0].name, (47, 16)), *SPECS[1:]]
    assert compute_ownership_plan(changed, 4).fingerprint() != a.fingerprint()
    assert compute_ownership_plan(SPECS, 2).fingerprint() != a.fingerprint()


@pytest.mark.parametrize(
    "specs, n, message",
    [
        (SPECS, 0, "num_ranks=0"),
        ([MatrixSpec("norm.weight", (16,))], 2, "'norm.weight' has shape (16,)"),
        ([MatrixSpec("w", (0, 4))], 2, "'w' has shape (0, 4)"),
        ([MatrixSpec("w", (2, 4)), MatrixSpec("w", (2, 4))], 2, "'w' appears twice"),
    ],
)
def test_bad_inputs_raise_value_error(specs, n, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        compute_ownership_plan(specs, n)
