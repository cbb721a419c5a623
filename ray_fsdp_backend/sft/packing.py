"""PURE: token documents to fixed-length rows (numpy in, numpy out).

Rows follow the convention of the project's packed path
(:func:`ray_fsdp_backend.context_parallel.sequence.document_ids`): a document
starts wherever ``position_ids`` does not follow the previous position by 1,
so every document's positions run ``0, 1, ...``. Padding sits only at the end
of a row and is a document of its own (positions ``0, 1, ...`` again, labels
-100), so no document attends to it and it attends to no document.

Labels are unshifted, as transformers takes them: the loss at position
``t`` is ``labels[t + 1]``. The last token of a document therefore "predicts"
the first label of the next one; every document's first label is -100, so
that target never counts (in transformers' loss as in
:func:`~ray_fsdp_backend.context_parallel.sequence.shift_labels`), and
nothing is lost: a first token is predicted by no token of its own document.

Too long: a document longer than ``seq_len`` is cut to its first ``seq_len``
tokens (``truncated``), or, under ``split`` (format ``text``), into pieces
of ``seq_len`` tokens, each a document. A document left with no target is
dropped (``dropped``).

Packing is first-fit decreasing within a batch of documents: documents
sorted longest first, each put into the first row with room for it, a new row
when none has. Documents are never cut across rows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

IGNORE_INDEX = -100


class Counts:
    """A dataclass of counts that add up over batches (packing's tallies)."""

    def add(self, other):
        return type(self)(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )

    def as_dict(self) -> dict[str, int]:
        return {f.name: int(getattr(self, f.name)) for f in fields(self)}


@dataclass
class PackCounts(Counts):
    """What packing did to a batch of records (sums over batches add up)."""

    records: int = 0
    documents: int = 0
    """Documents packed (a chat record may render several; the dropped not counted)."""
    truncated: int = 0
    """Documents cut to ``seq_len`` tokens (their tail lost)."""
    split: int = 0
    """Documents cut into several (format ``text``)."""
    dropped: int = 0
    """Documents without a target left (nothing to learn)."""
    rows: int = 0
    tokens: int = 0
    """Document tokens in the rows (padding excluded)."""
    padding: int = 0
    targets: int = 0
    """Labels that count in the loss."""


def fit_documents(
    documents: list[tuple[np.ndarray, np.ndarray]],
    seq_len: int,
    *,
    split: bool,
    counts: PackCounts,
    records: int | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Documents of at most ``seq_len`` tokens with their first label -100,
    those without a target dropped (see the module docstring); ``counts``
    updated (``records``: the records ``documents`` came from; None: one each)."""
    out = []
    counts.records += len(documents) if records is None else records
    for ids, labels in documents:
        if len(ids) > seq_len:
            if split:
                counts.split += 1
                pieces = [
                    (ids[a : a + seq_len], labels[a : a + seq_len])
                    for a in range(0, len(ids), seq_len)
                ]
            else:
                counts.truncated += 1
                pieces = [(ids[:seq_len], labels[:seq_len])]
        else:
            pieces = [(ids, labels)]
        for piece_ids, piece_labels in pieces:
            piece_labels = piece_labels.copy()
            piece_labels[:1] = IGNORE_INDEX
            if not (piece_labels != IGNORE_INDEX).any():
                counts.dropped += 1
                continue
            out.append((piece_ids, piece_labels))
    counts.documents += len(out)
    return out


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of indices into ``lengths``), each summing to at most ``capacity``."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        for b, room in enumerate(free):
            if room >= n:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(capacity - n)
    return bins


def assemble_rows(
    documents: list[tuple[np.ndarray, np.ndarray]],
    bins: list[list[int]],
    seq_len: int,
    pad_id: int,
    counts: PackCounts,
) -> dict[str, np.ndarray]:
    """``[len(bins), seq_len]`` int64 ``input_ids``, ``labels``, ``position_ids``:
    each bin's documents in order, then padding (its own document)."""
    n = len(bins)
    input_ids = np.full((n, seq_len), pad_id, dtype=np.int64)
    labels = np.full((n, seq_len), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.empty((n, seq_len), dtype=np.int64)
    for row, members in enumerate(bins):
        at = 0
        for i in members:
            ids, lab = documents[i]
            end = at + len(ids)
            input_ids[row, at:end] = ids
            labels[row, at:end] = lab
            position_ids[row, at:end] = np.arange(len(ids))
            at = end
        position_ids[row, at:] = np.arange(seq_len - at)
        counts.tokens += at
        counts.padding += seq_len - at
    counts.rows += n
    counts.targets += int((labels != IGNORE_INDEX).sum())
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def pack_documents(
    documents: list[tuple[np.ndarray, np.ndarray]],
    seq_len: int,
    pad_id: int,
    *,
    packing: bool = True,
    split: bool = False,
    counts: PackCounts | None = None,
    records: int | None = None,
) -> dict[str, np.ndarray]:
    """Rows of ``seq_len`` tokens from ``(input_ids, labels)`` documents: packed
    first-fit decreasing, or one document a row (``packing=False``).
    ``records``: how many records the documents came from, for ``counts``
    (None: one document each; a chat record may render several)."""
    counts = PackCounts() if counts is None else counts
    docs = fit_documents(documents, seq_len, split=split, counts=counts, records=records)
    if packing:
        bins = first_fit_decreasing([len(ids) for ids, _ in docs], seq_len)
    else:
        bins = [[i] for i in range(len(docs))]
    return assemble_rows(docs, bins, seq_len, pad_id, counts)
