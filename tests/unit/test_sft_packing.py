"""Packing invariants (ray_fsdp_backend/sft/packing.py, docs/sft.md).

Every document appears exactly once, whole, in one row; positions restart at
0 per document; padding only at a row's end, its own document, never a
target; every document's first label -100, so the unshifted labels give the
same targets through transformers' shift as through the project's
``shift_labels`` with document boundaries; too long documents truncated or
split and counted; first-fit decreasing keeps padding low on mixed lengths.
"""

from __future__ import annotations

import numpy as np
import torch

from ray_fsdp_backend.context_parallel.sequence import document_ids, shift_labels
from ray_fsdp_backend.sft.packing import PackCounts, first_fit_decreasing, pack_documents

PAD = 3


def _documents(lengths, seed=0):
    rng = np.random.default_rng(seed)
    docs = []
    for n in lengths:
        ids = rng.integers(10, 1000, n).astype(np.int64)
        labels = ids.copy()
        labels[: n // 3] = -100  # a prompt
        docs.append((ids, labels))
    return docs


def _row_documents(rows):
    """``(row, start, end)`` of every document of the rows, padding included."""
    out = []
    for r, positions in enumerate(rows["position_ids"]):
        starts = [i for i, p in enumerate(positions.tolist()) if p == 0]
        for a, b in zip(starts, starts[1:] + [len(positions)], strict=True):
            assert positions[a:b].tolist() == list(range(b - a))
            out.append((r, a, b))
    return out


def test_every_document_once_whole_with_restarting_positions():
    lengths = [5, 17, 3, 32, 9, 9, 1 + 1, 30, 12, 7]
    docs = _documents(lengths)
    counts = PackCounts()
    rows = pack_documents(docs, 32, PAD, counts=counts)
    found, padding = [], 0
    for r, a, b in _row_documents(rows):
        ids, labels = rows["input_ids"][r, a:b], rows["labels"][r, a:b]
        assert labels[0] == -100
        match = [i for i, (d, _) in enumerate(docs) if np.array_equal(d, ids)]
        if match:
            found.append(match[0])
            assert labels[1:].tolist() == docs[match[0]][1][1:].tolist()
        else:  # padding: only at the row's end, never a target
            assert b == 32 and (ids == PAD).all() and (labels == -100).all()
            padding += b - a
    assert sorted(found) == list(range(len(docs)))
    assert counts.documents == len(docs) and counts.padding == padding
    assert counts.rows * 32 == counts.tokens + counts.padding == len(rows["input_ids"]) * 32


def test_unshifted_labels_give_the_packed_path_targets():
    """transformers shifts labels without looking at documents; the first label
    of every document is -100, so it equals shift_labels with boundaries, and
    no document's last token predicts the next document's first."""
    rows = pack_documents(_documents([6, 9, 4, 11, 2 + 5]), 16, PAD)
    labels = torch.from_numpy(rows["labels"])
    positions = torch.from_numpy(rows["position_ids"])
    plain = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    assert torch.equal(plain, shift_labels(labels, positions))
    docs = document_ids(positions)
    crossing = torch.nn.functional.pad(docs[:, 1:] != docs[:, :-1], (0, 1), value=False)
    assert (plain[crossing] == -100).all()


def test_too_long_documents_are_truncated_or_split_and_counted():
    docs = _documents([40, 8, 70])
    counts = PackCounts()
    rows = pack_documents(docs, 32, PAD, counts=counts)
    assert (counts.truncated, counts.split, counts.documents) == (2, 0, 3)
    kept = sorted(b - a for r, a, b in _row_documents(rows) if rows["input_ids"][r, a] != PAD)
    assert kept == [8, 32, 32]
    counts = PackCounts()
    pack_documents(docs, 32, PAD, split=True, counts=counts)
    # 40 -> 32 + 8, 70 -> 32 + 32 + 6: 6 documents with 8.
    assert (counts.truncated, counts.split, counts.documents) == (0, 2, 6)
    assert counts.tokens == 118


def test_documents_without_targets_are_dropped_and_counted():
    ids = np.arange(10, 20, dtype=np.int64)
    prompt_only = (ids, np.full(10, -100))
    first_only = (ids, np.r_[ids[:1], np.full(9, -100)])  # the first label never counts
    counts = PackCounts()
    rows = pack_documents([prompt_only, first_only, _documents([5])[0]], 16, PAD, counts=counts)
    assert (counts.records, counts.dropped, counts.documents, counts.rows) == (3, 2, 1, 1)
    assert len(rows["input_ids"]) == 1


def test_without_packing_one_document_a_row_padded_at_the_end():
    docs = _documents([5, 16, 9])
    rows = pack_documents(docs, 16, PAD, packing=False)
    assert len(rows["input_ids"]) == 3
    for r, (ids, _) in enumerate(docs):
        assert rows["input_ids"][r, : len(ids)].tolist() == ids.tolist()
        assert (rows["input_ids"][r, len(ids) :] == PAD).all()
        assert (rows["labels"][r, len(ids) :] == -100).all()
        assert rows["position_ids"][r, len(ids) :].tolist() == list(range(16 - len(ids)))


def test_first_fit_decreasing_packs_mixed_lengths_tightly():
    rng = np.random.default_rng(1)
    lengths = rng.integers(8, 400, 1024).tolist()
    bins = first_fit_decreasing(lengths, 512)
    assert sorted(i for b in bins for i in b) == list(range(1024))
    assert all(sum(lengths[i] for i in b) <= 512 for b in bins)
    padding = 1 - sum(lengths) / (len(bins) * 512)
    assert padding < 0.02, padding
