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


def document_causal_mask(position_ids: torch.Tensor) -> torch.Tensor | None:
    """``[batch, 1, seq, seq]`` boolean mask (True: attend), or None when every
    row is one document (plain causal attention suffices)."""
    docs = document_ids(position_ids)
    if not bool((docs[:, -1] > docs[:, 0]).any()):
        return None
    seq = position_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=docs.device).tril()
    same_doc = docs[:, :, None] == docs[:, None, :]
    return (same_doc & causal).unsqueeze(1)


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
) -> torch.Tensor:
    """SDPA with a boolean ``mask`` from :func:`document_causal_mask`, or
    plain causal when it is None."""
    gqa = k.shape[1] != q.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


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
