"""PURE: preference pairs (two token documents each) to fixed-length rows.

Rows follow SFT's convention (:mod:`ray_fsdp_backend.sft.packing`:
``input_ids``, unshifted ``labels`` with every document's first label -100,
``position_ids`` restarting at 0 at every document, padding a document of its
own at the row's end) and add, per token:

- ``sequence_ids``: pair ``p`` of the row (``p = 0, 1, ...`` in row order)
  is sequence ``2p`` (its chosen document) and ``2p + 1`` (its rejected
  document, right after the chosen); padding -1;
- ``pair_index``: the pair's global index (the caller's: the record's place
  in the source, :mod:`.dataset`); padding -1.

A pair's two documents always sit in the same row. With ``packing`` several
pairs share a row (first-fit decreasing on the pair's length, as SFT packs
documents); without, one pair a row.

Too long (the two documents hold more than ``seq_len`` tokens): the prompts
are kept whole and the responses cut, keeping their starts (TRL's
``keep_start``), the room shared evenly (a response shorter than its half
keeps all of it, the other gets the rest); ``truncated`` counts such pairs.
A pair whose two prompts leave fewer than one response token each is dropped
(``dropped``: the prompt alone does not fit, as TRL drops it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_fsdp_backend.sft.packing import (
    IGNORE_INDEX,
    Counts,
    PackCounts,
    assemble_rows,
    first_fit_decreasing,
)

Document = tuple[np.ndarray, np.ndarray]
PairDocuments = tuple[Document, Document]


@dataclass
class PairCounts(Counts):
    """What packing did to a batch of pairs (sums over batches add up)."""

    records: int = 0
    """Pairs handed in."""
    pairs: int = 0
    """Pairs packed into rows."""
    truncated: int = 0
    """Pairs whose responses were cut to fit ``seq_len``."""
    dropped: int = 0
    """Pairs dropped: their prompts leave no room for a response token each."""
    rows: int = 0
    tokens: int = 0
    """Document tokens in the rows (padding excluded)."""
    padding: int = 0
    targets: int = 0
    """Labels that count in the loss."""


def prompt_length(labels: np.ndarray) -> int:
    """Tokens before the document's first target (its length when it has none)."""
    targets = np.flatnonzero(labels != IGNORE_INDEX)
    return int(targets[0]) if len(targets) else len(labels)


def share_room(chosen: int, rejected: int, room: int) -> tuple[int, int]:
    """PURE: the response tokens kept of each, summing to at most ``room``
    (module docstring); each keeps at least one when ``room >= 2``."""
    if chosen + rejected <= room:
        return chosen, rejected
    keep_chosen = min(chosen, max(room // 2, room - rejected))
    return keep_chosen, min(rejected, room - keep_chosen)


def fit_pair(pair: PairDocuments, seq_len: int) -> tuple[PairDocuments | None, bool]:
    """``(documents, truncated)``: the pair's documents with their first label
    -100, cut to fit ``seq_len`` together; None when they cannot (the
    prompts leave no room, or a document has no target)."""
    docs = []
    for ids, labels in pair:
        labels = labels.copy()
        labels[:1] = IGNORE_INDEX
        docs.append((ids, labels))
    prompts = [prompt_length(labels) for _, labels in docs]
    responses = [len(ids) - p for (ids, _), p in zip(docs, prompts, strict=True)]
    if min(responses) < 1:
        return None, False
    if sum(map(len, (ids for ids, _ in docs))) <= seq_len:
        return (docs[0], docs[1]), False
    room = seq_len - sum(prompts)
    if room < 2:
        return None, False
    keep = share_room(responses[0], responses[1], room)
    cut = [
        (ids[: p + k], labels[: p + k])
        for (ids, labels), p, k in zip(docs, prompts, keep, strict=True)
    ]
    return (cut[0], cut[1]), True


def pack_pairs(
    pairs: list[PairDocuments],
    indices: list[int],
    seq_len: int,
    pad_id: int,
    *,
    packing: bool = True,
    counts: PairCounts | None = None,
) -> dict[str, np.ndarray]:
    """Rows of ``seq_len`` tokens from the pairs (``indices``: each pair's
    ``pair_index``), as the module docstring says: ``input_ids``, ``labels``,
    ``position_ids``, ``sequence_ids``, ``pair_index``, each ``[rows, seq_len]`` int64."""
    counts = PairCounts() if counts is None else counts
    counts.records += len(pairs)
    kept, kept_index = [], []
    for pair, index in zip(pairs, indices, strict=True):
        fitted, truncated = fit_pair(pair, seq_len)
        if fitted is None:
            counts.dropped += 1
            continue
        counts.truncated += truncated
        kept.append(fitted)
        kept_index.append(index)
    counts.pairs += len(kept)
    lengths = [len(c[0]) + len(r[0]) for c, r in kept]
    pair_bins = (
        first_fit_decreasing(lengths, seq_len) if packing else [[i] for i in range(len(kept))]
    )
    documents = [doc for pair in kept for doc in pair]
    bins = [[d for p in members for d in (2 * p, 2 * p + 1)] for members in pair_bins]
    packed = PackCounts()
    rows = assemble_rows(documents, bins, seq_len, pad_id, packed)
    rows["sequence_ids"], rows["pair_index"] = _pair_columns(
        documents, pair_bins, kept_index, seq_len
    )
    for name in ("rows", "tokens", "padding", "targets"):
        setattr(counts, name, getattr(counts, name) + getattr(packed, name))
    return rows


def _pair_columns(documents, pair_bins, indices, seq_len: int):
    """``sequence_ids`` and ``pair_index`` of the rows :func:`assemble_rows` laid out."""
    sequence_ids = np.full((len(pair_bins), seq_len), -1, dtype=np.int64)
    pair_index = np.full((len(pair_bins), seq_len), -1, dtype=np.int64)
    for row, members in enumerate(pair_bins):
        at = 0
        for p, i in enumerate(members):
            for side in (0, 1):
                n = len(documents[2 * i + side][0])
                sequence_ids[row, at : at + n] = 2 * p + side
                pair_index[row, at : at + n] = indices[i]
                at += n
    return sequence_ids, pair_index
