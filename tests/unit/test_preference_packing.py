"""Preference rows (issue 56, item 1 / the contract's rows): a pair's two
documents sit whole and adjacent in one row, ``sequence_ids`` number them
``2p`` / ``2p + 1`` in row order, ``pair_index`` carries the caller's index,
padding is -1 in both; too long, the prompts are kept and the responses cut
keeping their starts; a prompt that leaves no room drops the pair, counted."""

from __future__ import annotations

import numpy as np
import pytest

from ray_fsdp_backend.preference.packing import PairCounts, pack_pairs, share_room

PAD = 0


def _doc(prompt: int, response: int, start: int) -> tuple[np.ndarray, np.ndarray]:
    """A document of distinct ids: ``prompt`` untrained tokens, then ``response`` targets."""
    ids = np.arange(start, start + prompt + response, dtype=np.int64)
    labels = np.where(np.arange(len(ids)) >= prompt, ids, -100)
    return ids, labels


def _pairs(rng, n: int, longest: int = 30):
    pairs, start = [], 1
    for _ in range(n):
        p = int(rng.integers(1, 10))
        c, r = (int(x) for x in rng.integers(1, longest, size=2))
        pairs.append((_doc(p, c, start), _doc(p, r, start + 1000)))
        start += 2000
    return pairs


def _unpack(rows):
    """``{pair_index: [(sequence_id, ids, labels, positions), ...]}`` read back from the rows."""
    found = {}
    for r in range(len(rows["input_ids"])):
        seq = rows["sequence_ids"][r]
        for s in sorted(set(seq.tolist()) - {-1}):
            at = np.flatnonzero(seq == s)
            assert (np.diff(at) == 1).all()  # a document is one run
            index = set(rows["pair_index"][r][at].tolist())
            assert len(index) == 1
            found.setdefault((r, index.pop()), []).append(
                (s, rows["input_ids"][r][at], rows["labels"][r][at], rows["position_ids"][r][at])
            )
    return found


@pytest.mark.parametrize("packing", [True, False])
def test_pairs_sit_whole_in_one_row_with_their_ids(packing):
    rng = np.random.default_rng(0)
    pairs = _pairs(rng, 40)
    indices = [7 * i + 3 for i in range(40)]
    counts = PairCounts()
    rows = pack_pairs(pairs, indices, 96, PAD, packing=packing, counts=counts)
    found = _unpack(rows)
    assert sorted(i for _, i in found) == sorted(indices)  # every pair once
    for (row, index), docs in found.items():
        (c, r) = pairs[indices.index(index)]
        assert [s % 2 for s, *_ in docs] == [0, 1] and docs[1][0] == docs[0][0] + 1
        for (_, ids, labels, pos), (ref_ids, ref_labels) in zip(docs, (c, r), strict=True):
            assert ids.tolist() == ref_ids.tolist()
            assert labels[0] == -100 and labels[1:].tolist() == ref_labels[1:].tolist()
            assert pos.tolist() == list(range(len(ids)))
        seq = rows["sequence_ids"][row]
        assert sorted(set(seq.tolist()) - {-1}) == list(range(max(seq) + 1))
    pad = rows["sequence_ids"] == -1
    assert (rows["pair_index"][pad] == -1).all() and (rows["labels"][pad] == -100).all()
    assert (rows["input_ids"][pad] == PAD).all()
    assert counts.records == counts.pairs == 40 and counts.rows == len(rows["input_ids"])
    assert counts.padding == int(pad.sum())
    if packing:
        assert counts.rows < 40 and max(rows["sequence_ids"].max(axis=1)) >= 3
    else:
        assert counts.rows == 40 and rows["sequence_ids"].max() == 1


def test_too_long_keeps_the_prompts_and_the_responses_starts():
    chosen, rejected = _doc(5, 30, 100), _doc(5, 4, 200)
    counts = PairCounts()
    rows = pack_pairs([(chosen, rejected)], [0], 24, PAD, counts=counts)
    (docs,) = _unpack(rows).values()
    (_, c_ids, *_), (_, r_ids, *_) = docs
    assert r_ids.tolist() == rejected[0].tolist()  # the short response whole
    assert c_ids.tolist() == chosen[0][: 24 - 9].tolist()  # the long one's start
    assert counts.truncated == 1 and counts.padding == 0


def test_a_prompt_that_leaves_no_room_drops_the_pair_counted():
    counts = PairCounts()
    long_prompt = (_doc(12, 3, 100), _doc(12, 3, 200))
    fine = (_doc(2, 3, 300), _doc(2, 3, 400))
    rows = pack_pairs([long_prompt, fine], [0, 1], 24, PAD, counts=counts)
    assert set(rows["pair_index"].ravel().tolist()) == {-1, 1}
    assert (counts.records, counts.pairs, counts.dropped) == (2, 1, 1)


def test_the_room_is_shared_evenly_and_each_keeps_a_token():
    assert share_room(30, 4, 19) == (15, 4)
    assert share_room(30, 30, 20) == (10, 10)
    assert share_room(3, 30, 20) == (3, 17)
    assert share_room(1, 1, 2) == (1, 1)
    assert share_room(5, 5, 10) == (5, 5)
