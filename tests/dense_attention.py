"""The dense attention the context-parallel kernel replaced, kept as the
reference the tests compare against: a boolean ``[batch, 1, seq, seq]`` mask
(causal, same document, within a window) and SDPA or the explicit form over
whole rows. Its mask equals transformers' (tests/unit/test_cp_attention_args.py);
the memory watch must catch it (tests/dist/test_context_parallel.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ray_fsdp_backend.context_parallel.attention import eager_attention
from ray_fsdp_backend.context_parallel.sequence import document_ids


def document_causal_mask(position_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """``[batch, 1, seq, seq]`` boolean mask (True: attend): causal, within
    each token's document, and (``window``) at most ``window - 1`` tokens back."""
    docs = document_ids(position_ids)
    index = torch.arange(position_ids.shape[-1])
    back = index[:, None] - index[None, :]  # q - kv
    allowed = back >= 0
    if window is not None:
        allowed = allowed & (back < window)
    return (docs[:, :, None] == docs[:, None, :]).unsqueeze(1) & allowed


def dense_attention(q, k, v, mask, *, scale=None, softcap=None, sinks=None, dropout=0.0):
    """Attention of whole rows under ``mask``: SDPA, or the explicit form
    for a soft-cap or sinks."""
    if softcap is not None or sinks is not None:
        options = dict(scale=scale, softcap=softcap, sinks=sinks, dropout=dropout)
        return eager_attention(q, k, v, mask, **options)
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=gqa
    )
