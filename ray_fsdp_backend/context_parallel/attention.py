"""Attention over whole (possibly packed) rows: causal, and never across documents.

The one kernel both the project's decoder and the Ulysses exchange call.
Unpacked rows take SDPA's ``is_causal`` path (no mask tensor; flash and
memory-efficient kernels stay eligible); packed rows get a boolean
``[batch, 1, seq, seq]`` mask, causal and same-document, built from
``position_ids`` (:func:`~ray_fsdp_backend.context_parallel.sequence.document_ids`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ray_fsdp_backend.context_parallel.sequence import document_ids


def document_causal_mask(
    position_ids: torch.Tensor, window: int | None = None
) -> torch.Tensor | None:
    """``[batch, 1, seq, seq]`` boolean mask (True: attend): causal, within
    each token's document, and (``window``) at most ``window - 1`` tokens
    back (transformers' ``sliding_window_overlay``: ``kv > q - window``).
    None when every row is one document and there is no window (plain
    causal attention suffices)."""
    docs = document_ids(position_ids)
    packed = bool((docs[:, -1] > docs[:, 0]).any())
    if not packed and window is None:
        return None
    seq = position_ids.shape[-1]
    index = torch.arange(seq, device=docs.device)
    back = index[:, None] - index[None, :]  # q - kv
    allowed = back >= 0
    if window is not None:
        allowed = allowed & (back < window)
    if not packed:
        return allowed.expand(docs.shape[0], 1, seq, seq)
    return (docs[:, :, None] == docs[:, None, :]).unsqueeze(1) & allowed


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
    takes no mask). Grouped-query ``k``/``v`` (fewer heads) are allowed."""
    mask = None
    if position_ids is not None and documents:
        mask = document_causal_mask(position_ids.expand(q.shape[0], -1))
    return masked_attention(q, k, v, mask, scale=scale)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention with a boolean ``mask`` from :func:`document_causal_mask`
    (None: plain causal). SDPA unless a logit ``softcap``
    (``softcap * tanh(s / softcap)``, Gemma 2) or attention ``sinks`` (one
    logit per query head that joins the softmax and is dropped after it,
    gpt-oss) ask for the explicit form (:func:`eager_attention`), which
    computes what transformers' eager functions do. ``dropout``: the
    probability applied to the attention weights (pass 0 in eval)."""
    gqa = k.shape[1] != q.shape[1]
    if softcap is not None or sinks is not None:
        return eager_attention(
            q, k, v, mask, scale=scale, softcap=softcap, sinks=sinks, dropout=dropout
        )
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
    gpt-oss eager functions. ``[batch, seq, seq]`` scores per head are
    materialised."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        seq = q.shape[2]
        mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
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

    attention_fn: Callable[..., torch.Tensor] = staticmethod(causal_attention)
