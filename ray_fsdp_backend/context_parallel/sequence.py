"""PURE sequence bookkeeping for context parallelism: which tokens a cp rank
holds, where documents start, and the labels a shard needs.

Nothing here communicates; every function maps tensors to tensors, so the
driver-side checks, the workers and the single-process reference in the tests
agree on the same split.

The split is along dim 1 of ``[batch, seq]`` tensors. Two layouts:

- contiguous (Ulysses): rank ``r`` holds tokens ``[r * s / cp, (r + 1) * s / cp)``.
  Ulysses gathers the whole sequence for a subset of heads before attention,
  so every rank does the same attention work whatever the split, and the
  token-wise layers (MLP, norms) are balanced by construction.
- load-balanced (ring, causal): the sequence is cut into ``2 * cp`` chunks and
  rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` (head and tail), so the
  causal ring gives every rank the same number of unmasked scores. This is
  the order torch's ``context_parallel`` uses (``_cp_options.enable_load_balance``).

Labels are shifted *before* the split: the model's own shift inside a shard
would drop the last target of every shard (its next token lives on the next
rank). Packed rows keep their per-document ``position_ids``; a target that
would cross from one document into the next is ignored.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

IGNORE_INDEX = -100
"""Label value that the loss skips (PyTorch's and transformers' default)."""

SHIFTED_KEYS = ("labels",)
"""Keys that :func:`shard_sequence` shifts one token left before splitting."""

HF_SHIFTED_LABELS = "shift_labels"
"""transformers' keyword for targets it takes without shifting them again
(its ``ForCausalLMLoss``, transformers 5.25): :func:`shard_sequence` returns
the shifted labels under this key too."""


def default_position_ids(batch: int, seq: int, device=None) -> torch.Tensor:
    """``0 .. seq-1`` for every row: the positions of unpacked rows."""
    return torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq).contiguous()


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Per-token document index of packed rows ``[batch, seq]``: a document
    starts wherever the position does not follow the previous one by 1
    (transformers' ``find_packed_sequence_indices`` uses the same rule)."""
    first = position_ids[:, :1] - 1
    starts = torch.diff(position_ids, prepend=first, dim=-1) != 1
    return starts.long().cumsum(-1)


def is_packed(position_ids: torch.Tensor) -> bool:
    """Whether any row holds more than one document (a host read)."""
    return bool(any_packed(position_ids))


def any_packed(position_ids: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on ``position_ids``' device: whether any row holds more
    than one document."""
    return (document_ids(position_ids)[:, -1] > 0).any()


def shift_labels(labels: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Targets aligned with the inputs: ``out[:, t] = labels[:, t + 1]``, the
    last position ignored, and (with ``position_ids``) a position whose next
    token starts another document ignored too."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    if position_ids is not None:
        docs = document_ids(position_ids)
        crosses = docs[:, 1:] != docs[:, :-1]
        shifted[:, :-1] = shifted[:, :-1].masked_fill(crosses, IGNORE_INDEX)
    return shifted


def chunk_indices(seq: int, cp_rank: int, cp_size: int, *, load_balance: bool) -> torch.Tensor:
    """Token indices (dim 1) that ``cp_rank`` holds of a ``seq``-long row.

    Raises:
        ValueError: ``seq`` is not divisible by ``cp_size`` (``2 * cp_size``
            with ``load_balance``).
    """
    parts = 2 * cp_size if load_balance else cp_size
    if seq % parts:
        rule = "2 x context_parallel_size" if load_balance else "context_parallel_size"
        raise ValueError(
            f"sequence length {seq} is not divisible by {rule} = {parts}; "
            "pad the rows or choose a seq_len that is"
        )
    size = seq // parts
    chunks = (cp_rank, parts - 1 - cp_rank) if load_balance else (cp_rank,)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])


RING_PACKED = (
    "packed rows (position_ids restart inside a row) with context_parallel_backend='ring': "
    "torch's ring attention takes no mask, so documents would attend to each other; use 'ulysses'"
)


def _refuse_packed_rows(position_ids: torch.Tensor) -> None:
    """Refuse packed rows for the ring. Host rows are read (ValueError); rows
    on a device are checked by a device-side assert: reading the answer
    would stall the host on the device once per micro-batch."""
    packed = any_packed(position_ids)
    if position_ids.device.type == "cpu":
        if packed:
            raise ValueError(RING_PACKED)
        return
    torch._assert_async(~packed, RING_PACKED)


def shard_sequence(
    batch: Mapping[str, torch.Tensor],
    cp_rank: int,
    cp_size: int,
    *,
    load_balance: bool = False,
) -> dict[str, torch.Tensor]:
    """This cp rank's part of every ``[batch, seq]`` tensor of ``batch``.

    ``seq`` is read from ``input_ids`` (else the first 2-D tensor). Tensors
    whose first two dims are ``[batch, seq]`` are split along dim 1; anything
    else passes through unchanged. ``labels`` (unshifted, as transformers
    takes them) are shifted first (:func:`shift_labels`), so the shard's loss
    is ``cross_entropy(logits, labels)`` without a further shift; the same
    tensor is returned as ``shift_labels`` (transformers' keyword for
    targets it does not shift again), so ``model(**batch)`` of a
    transformers model computes its loss on the right targets too (a
    ``shift_labels`` already in ``batch`` is split as it is).
    ``position_ids`` are made when absent (``0 .. seq-1``) and split with the
    tokens, so rotary embeddings and document masks see true positions.

    Raises:
        ValueError: no ``[batch, seq]`` tensor, ``seq`` not divisible (see
            :func:`chunk_indices`), or packed host rows with ``load_balance``
            (torch's ring, which takes no document mask); packed rows on a
            GPU fail a device-side assert there instead (no host sync).
    """
    reference = batch.get("input_ids")
    if reference is None:
        reference = next((t for t in batch.values() if torch.is_tensor(t) and t.ndim >= 2), None)
    if reference is None:
        raise ValueError("shard_sequence needs a [batch, seq] tensor (e.g. input_ids)")
    rows, seq = reference.shape[:2]
    out = dict(batch)
    if out.get("position_ids") is None:
        out["position_ids"] = default_position_ids(rows, seq, reference.device)
    position_ids = out["position_ids"].expand(rows, seq)
    if load_balance:
        _refuse_packed_rows(position_ids)
    for key in SHIFTED_KEYS:
        if out.get(key) is not None:
            out[key] = shift_labels(out[key], position_ids)
    index = chunk_indices(seq, cp_rank, cp_size, load_balance=load_balance)
    index = index.to(reference.device)
    for key, value in out.items():
        if torch.is_tensor(value) and value.ndim >= 2 and tuple(value.shape[:2]) == (rows, seq):
            out[key] = value.index_select(1, index)
        elif key == "position_ids":  # a [1, seq] row broadcast over the batch
            out[key] = position_ids.index_select(1, index)
    if out.get("labels") is not None and out.get(HF_SHIFTED_LABELS) is None:
        out[HF_SHIFTED_LABELS] = out["labels"]
    return out


def count_valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Targets the loss counts (not ``IGNORE_INDEX``), as a 0-d int64 tensor."""
    return (labels != IGNORE_INDEX).sum()


def pack_documents(
    documents: list[torch.Tensor], seq_len: int, rows: int | None = None
) -> dict[str, torch.Tensor]:
    """Concatenate 1-D token documents into ``[rows, seq_len]`` packed rows.

    Returns ``input_ids``, ``labels`` (equal to ``input_ids``, unshifted, as
    transformers takes them: :func:`shift_labels` ignores the targets that
    cross documents) and ``position_ids`` restarting at 0 for every document.
    A document that does not fit the rest of a row continues on the next row
    as a new document (position 0). ``rows=None`` keeps every full row; the
    partial tail is dropped.
    """
    pieces, positions, used = [], [], 0
    for doc in documents:
        doc = doc.reshape(-1).long()
        while doc.numel():
            piece = doc[: seq_len - used % seq_len]
            pieces.append(piece)
            positions.append(torch.arange(piece.numel()))
            used, doc = used + piece.numel(), doc[piece.numel() :]
    full = used // seq_len
    n = full if rows is None else min(rows, full)
    input_ids = torch.cat(pieces)[: n * seq_len].view(n, seq_len)
    position_ids = torch.cat(positions)[: n * seq_len].view(n, seq_len)
    return {"input_ids": input_ids, "labels": input_ids.clone(), "position_ids": position_ids}
