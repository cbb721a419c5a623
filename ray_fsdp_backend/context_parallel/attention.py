"""Attention over whole (possibly packed) rows: causal, and never across documents.

The one kernel both the project's decoder and the Ulysses exchange call, in
memory linear in the sequence: no ``seq x seq`` tensor is built for packed
rows or sliding windows.

- Unpacked rows take SDPA's ``is_causal`` path (no mask tensor; the flash
  kernels stay eligible: CPU, CUDA).
- Packed rows are cut at their documents' boundaries
  (:func:`document_spans`, read from ``position_ids`` with one host
  transfer) and each document runs the same causal kernel on its own slice:
  a document's tokens see exactly its own earlier tokens, the
  per-document mask of transformers, without building it.
- A sliding window cuts a document further into query chunks of ``window``
  tokens, each attending to at most the ``2 * window - 1`` keys it can reach
  through a ``window x (2 * window - 1)`` mask: memory ``O(seq * window)``.
- A logit soft-cap (Gemma 2) or attention sinks (gpt-oss) have no fused SDPA
  kernel: those layers take the explicit form (:func:`eager_attention`) per
  document, whose scores are ``doc_len x doc_len`` per head.

flex attention was measured and set aside: torch 2.13 has no flex backward
on CPU ("FlexAttention does not support backward on CPU"), and eager flex
materialises the scores.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

Span = tuple[int, int]
"""``(start, end)`` token offsets of one document in a row."""

DocumentSpans = list[tuple[list[int], list[Span]]]
"""Rows grouped by their documents: ``(rows, spans)`` pairs, each group's
rows sharing one tuple of spans that covers the whole row."""


def document_spans(position_ids: torch.Tensor, rows: int) -> DocumentSpans | None:
    """The documents of ``rows`` packed rows from their ``position_ids``
    (``[rows or 1, seq]``; a document starts wherever the position does not
    follow the previous one by 1, the rule of
    :func:`~ray_fsdp_backend.context_parallel.sequence.document_ids`),
    rows with equal boundaries grouped. One host transfer. None when every
    row is one document (plain causal attention suffices)."""
    seq = position_ids.shape[-1]
    starts = torch.diff(position_ids, dim=-1) != 1
    row_of, col_of = (t.tolist() for t in starts.nonzero(as_tuple=True))
    if not row_of:
        return None
    cuts: list[list[int]] = [[] for _ in range(position_ids.shape[0])]
    for row, col in zip(row_of, col_of, strict=True):
        cuts[row].append(col + 1)
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, row_cuts in enumerate(cuts):
        groups.setdefault(tuple(row_cuts), []).append(row)
    if position_ids.shape[0] == 1:
        groups = {key: list(range(rows)) for key in groups}
    spans = []
    for key, members in groups.items():
        bounds = [0, *key, seq]
        spans.append((members, list(zip(bounds[:-1], bounds[1:], strict=True))))
    return spans


def tensor_version(t: torch.Tensor) -> int | None:
    """Autograd's version counter of ``t`` (bumped by every in-place write),
    or None for an inference tensor, which has none."""
    return None if t.is_inference() else t._version


class SpanCache:
    """The document spans of the forward in flight, found once per forward
    rather than once per layer: keyed on the ``position_ids`` tensor itself
    (held weakly) *and its version counter*, so every layer of one forward
    shares one host transfer, and a buffer refilled in place for the next
    batch (which bumps the counter) gets new spans. An inference tensor has
    no counter: its spans are found again every call. ``find(position_ids,
    rows)`` computes them (:func:`document_spans`, or Ulysses' gather first)."""

    def __init__(self, find: Callable[[torch.Tensor, int], DocumentSpans | None]) -> None:
        self.find = find
        self._key: tuple[weakref.ref, int | None, int] | None = None
        self._spans: DocumentSpans | None = None

    def __call__(self, position_ids: torch.Tensor, rows: int) -> DocumentSpans | None:
        version = tensor_version(position_ids)
        key = self._key
        same = key is not None and key[0]() is position_ids and key[1:] == (version, rows)
        if version is None or not same:
            self._key = (weakref.ref(position_ids), version, rows)
            self._spans = self.find(position_ids, rows)
        return self._spans


ONE_PROCESS_SPANS = SpanCache(document_spans)
"""The spans cache of one-process (no cp) attention: one per process, which
holds no tensor (a weak key) and whose key is the forward's own tensor."""


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    scale: float | None = None,
    documents: bool = True,
) -> torch.Tensor:
    """Causal SDPA of ``[batch, heads, seq, head_dim]`` tensors, restricted to
    each token's document when ``position_ids`` (``[batch or 1, seq]``) mark
    packed rows (``documents=False``: plain causal, for torch's ring, which
    takes no mask). Grouped-query ``k``/``v`` (fewer heads) are allowed. The
    documents are read once per forward (:class:`SpanCache`): the layers of
    one forward share one host transfer."""
    spans = None
    if position_ids is not None and documents:
        spans = ONE_PROCESS_SPANS(position_ids, q.shape[0])
    return document_attention(q, k, v, spans, scale=scale)


def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spans: DocumentSpans | None,
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention of ``[batch, heads, seq, head_dim]`` tensors within
    each document of ``spans`` (:func:`document_spans`; None: each row is
    one document), at most ``window - 1`` tokens back when ``window`` is
    given (transformers' ``sliding_window_overlay``: ``kv > q - window``).
    ``softcap`` (``softcap * tanh(s / softcap)``, Gemma 2), ``sinks`` (one
    logit per query head that joins the softmax and is dropped after it,
    gpt-oss) and ``dropout`` (on the attention weights; pass 0 in eval) are
    computed as transformers' eager functions do. Grouped-query ``k``/``v``
    are allowed."""
    biases: dict = {}  # window biases by shape, shared by every chunk and document
    options = dict(
        scale=scale, window=window, softcap=softcap, sinks=sinks, dropout=dropout, biases=biases
    )
    if spans is None:
        return span_attention(q, k, v, **options)
    outs, order = [], []
    for rows, row_spans in spans:
        index = torch.tensor(rows, device=q.device) if len(spans) > 1 else None
        parts = [t if index is None else t.index_select(0, index) for t in (q, k, v)]
        pieces = [span_attention(*(t[:, :, a:b] for t in parts), **options) for a, b in row_spans]
        outs.append(torch.cat(pieces, dim=2))
        order.extend(rows)
    if len(outs) == 1:
        return outs[0]
    inverse = torch.empty(len(order), dtype=torch.long, device=q.device)
    inverse[torch.tensor(order, device=q.device)] = torch.arange(len(order), device=q.device)
    return torch.cat(outs).index_select(0, inverse)


def span_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    dropout: float,
    biases: dict | None = None,
) -> torch.Tensor:
    """Causal attention of one document (or whole rows): every query sees
    the keys at or before it, within ``window``. A window's chunks take
    additive biases from ``biases`` (:func:`window_bias`, built once per
    shape): SDPA saves a mask's float form for backward, so one tensor per
    shape is saved, not one per chunk."""
    seq = q.shape[2]
    biases = {} if biases is None else biases
    window = None if window is None or window >= seq else window
    if softcap is not None or sinks is not None:
        warn_math_once(q, "softcap" if softcap is not None else "attention sinks")
        mask = None if window is None else window_mask(seq, seq, 0, window, q.device)
        return eager_attention(
            q, k, v, mask, scale=scale, softcap=softcap, sinks=sinks, dropout=dropout
        )
    if window is None:
        return sdpa(q, k, v, None, scale=scale, dropout=dropout)
    chunks = []
    for start in range(0, seq, window):
        end, first = min(start + window, seq), max(0, start - window + 1)
        shape = (end - start, end - first, start - first)
        mask = window_bias(shape, window, q, biases)
        kv = (t[:, :, first:end] for t in (k, v))
        chunks.append(sdpa(q[:, :, start:end], *kv, mask, scale=scale, dropout=dropout))
    return torch.cat(chunks, dim=2)


def window_mask(
    queries: int, keys: int, offset: int, window: int | None, device=None
) -> torch.Tensor:
    """``[queries, keys]`` boolean mask (True: attend) of query ``i`` at key
    position ``offset + i``: causal and (``window``) fewer than ``window``
    tokens back."""
    back = torch.arange(queries, device=device)[:, None] + offset
    back = back - torch.arange(keys, device=device)[None, :]
    allowed = back >= 0
    return allowed if window is None else allowed & (back < window)


def window_bias(
    shape: tuple[int, int, int], window: int, q: torch.Tensor, biases: dict
) -> torch.Tensor:
    """The additive ``[queries, keys]`` bias (0: attend, -inf: not) of
    :func:`window_mask` for ``shape`` = ``(queries, keys, offset)``, in
    ``q``'s dtype and device, taken from ``biases`` or built there once.
    Measured at 8192 tokens, window 1024 (4 heads of 16, fp32, CPU): 68.1 MiB
    saved for backward with a fresh bool mask per chunk, 20.1 MiB shared."""
    if shape not in biases:
        allowed = window_mask(*shape, window, q.device)
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
        biases[shape] = bias.masked_fill_(~allowed, float("-inf"))
    return biases[shape]


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float | None,
    dropout: float,
) -> torch.Tensor:
    """torch's SDPA, causal when ``mask`` is None. Grouped-query ``k``/``v``
    with a mask are repeated to the query heads on CUDA, where the
    memory-efficient kernel (the one that takes a mask) takes no
    ``enable_gqa``; a half-precision CUDA call no fused kernel takes is
    warned once (:func:`warn_math_once`)."""
    gqa = k.shape[1] != q.shape[1]
    if gqa and mask is not None and q.is_cuda:
        repeat = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), False
    if q.is_cuda and q.dtype in HALF_DTYPES:
        params = torch.backends.cuda.SDPAParams(q, k, v, mask, dropout, mask is None, gqa)
        fused = torch.backends.cuda.can_use_flash_attention(params)
        if not (fused or torch.backends.cuda.can_use_efficient_attention(params)):
            reason = f"head_dim={q.shape[-1]}, mask={mask is not None}, dropout={dropout}"
            warn_math_once(q, f"no flash or memory-efficient SDPA kernel takes {reason}")
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None,
        dropout_p=dropout,
        scale=scale,
        enable_gqa=gqa,
    )


HALF_DTYPES = (torch.bfloat16, torch.float16)
_WARNED: set[str] = set()


def warn_math_once(q: torch.Tensor, reason: str) -> bool:
    """Warn once per ``reason`` that a half-precision CUDA attention runs the
    math form (fp32 scores of each document or window chunk); nothing on CPU
    or in fp32, whose runs chose it. Returns whether it warned."""
    if not (q.is_cuda and q.dtype in HALF_DTYPES) or reason in _WARNED:
        return False
    _WARNED.add(reason)
    warnings.warn(
        f"context_parallel attention: a {q.dtype} run takes the math kernel on CUDA "
        f"({reason}): fp32 scores per document, slower and larger than flash",
        stacklevel=3,
    )
    return True


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    dropout: float,
) -> torch.Tensor:
    """Scores, soft-cap, mask, softmax (float32, with the sink column when
    given), dropout, weighted values: the order of transformers' Gemma 2 and
    gpt-oss eager functions, on one document (``mask``: its window; None:
    causal). ``[batch, seq, seq]`` scores per head are materialised."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = window_mask(q.shape[2], k.shape[2], 0, None, q.device)
    scores = scores.masked_fill(~mask, float("-inf")).float()
    if sinks is not None:
        sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = scores.softmax(dim=-1)[..., : k.shape[2]].to(v.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, v)


class ContextParallelAttention(nn.Module):
    """Base of an attention module whose kernel context parallelism may swap.

    Subclasses call ``self.attention_fn(q, k, v, position_ids=...)`` on
    ``[batch, heads, seq, head_dim]`` tensors; by default that is
    :func:`causal_attention`, and
    :func:`~ray_fsdp_backend.context_parallel.apply.apply_context_parallel`
    replaces it with Ulysses (or ring) attention over the cp group.
    """

    n_heads: int
    """Query heads (context parallelism's Ulysses splits them over cp)."""

    kv_heads: int | None = None
    """Key/value heads when fewer than ``n_heads`` (grouped-query attention),
    which torch's ring cannot run in fp32; None: as many as ``n_heads``."""

    attention_fn: Callable[..., torch.Tensor] = staticmethod(causal_attention)
