"""Byte-level data: disjoint rank shards, a seed-fixed global order, exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_fsdp_backend.trainer.data.corpus import (
    ShardedBatches,
    WindowOrder,
    compute_rank_samples,
    decode,
    encode,
    load_corpus,
    pack_text_rows,
    split_corpus,
)

TOKENS = torch.arange(2000) % 251  # distinct windows, values < 256


def batches(dp_rank, dp_size, micro=4, seed=0, position=0, seq_len=16):
    return ShardedBatches(TOKENS, seq_len, micro, dp_rank, dp_size, seed=seed, position=position)


def test_shipped_corpus_is_bytes():
    tokens = load_corpus()
    assert tokens.dtype == torch.long and len(tokens) > 5000
    assert 0 <= int(tokens.min()) and int(tokens.max()) < 256
    assert decode(tokens[:11]) == "On Training"
    assert decode(encode("héllo")) == "héllo"


def test_targets_are_inputs_shifted_by_one():
    inputs, targets = batches(0, 1).next_batch()
    assert inputs.shape == targets.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_ranks_split_one_global_batch_between_them():
    one = batches(0, 1, micro=8)
    two = [batches(r, 2, micro=4) for r in range(2)]
    for _ in range(30):  # across epoch boundaries (~120 windows per epoch)
        full, _ = one.next_batch()
        parts = [b.next_batch()[0] for b in two]
        assert torch.equal(torch.cat(parts), full)
        starts = [tuple(row[:4].tolist()) for row in torch.cat(parts)]
        assert len(set(starts)) == len(starts)  # no window twice in a global batch


def test_resume_from_position_continues_exactly():
    run = batches(1, 2)
    for _ in range(7):
        run.next_batch()
    resumed = batches(1, 2)
    resumed.load_state_dict(run.state_dict())
    for _ in range(5):
        assert torch.equal(run.next_batch()[0], resumed.next_batch()[0])


def test_order_is_fixed_by_the_seed_and_changes_between_epochs():
    a, b, c = WindowOrder(2000, 16, seed=3), WindowOrder(2000, 16, seed=3), WindowOrder(2000, 16, 4)
    n = a.num_windows
    first = [a.start(i) for i in range(n)]
    assert first == [b.start(i) for i in range(n)]
    assert first != [c.start(i) for i in range(n)]
    second = [a.start(n + i) for i in range(n)]
    assert sorted(first) != sorted(second)  # new epoch: new shift and new permutation
    assert max(first + second) + 17 <= 2000


def test_rank_samples_are_contiguous_blocks():
    assert compute_rank_samples(100, 4, 0, 2) == range(100, 104)
    assert compute_rank_samples(100, 4, 1, 2) == range(104, 108)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="too short"):
        ShardedBatches(torch.zeros(20, dtype=torch.long), 16, 2, 0, 1)
    with pytest.raises(ValueError, match="dp_rank=2"):
        batches(2, 2)
    with pytest.raises(ValueError, match="val_fraction"):
        split_corpus(TOKENS, 1.0)


def test_pack_text_rows_cuts_fixed_length_rows():
    texts = np.array(["hello world", "second row of text"], dtype=object)
    out = pack_text_rows({"text": texts}, seq_len=7)["tokens"]
    joined = b"hello world\nsecond row of text"
    assert out.shape == (len(joined) // 8, 8)
    assert bytes(out.reshape(-1).astype(np.uint8)) == joined[: out.size]
