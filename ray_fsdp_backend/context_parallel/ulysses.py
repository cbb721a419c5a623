"""Ulysses sequence parallelism: all-to-all from sequence shards to head
shards around the attention kernel, and back.

Each cp rank holds ``seq / cp`` tokens of every head. Before attention one
``all_to_all_single`` per tensor gives each rank the *whole* sequence for
``heads / cp`` heads; any attention kernel then runs unchanged (masks,
packed documents, grouped-query heads), and a second all-to-all returns the
output to sequence shards. Backward is the same exchange in reverse, so the
exchange is a ``torch.autograd.Function`` whose backward calls the opposite
direction (DeepSpeed-Ulysses, arXiv:2309.14509).

Written here rather than taken from a library: torch has no Ulysses (its
``context_parallel`` is ring attention, CUDA only and without masks,
pytorch#147793), and DeepSpeed's ``DistributedAttention`` pulls in
DeepSpeed. ``all_to_all_single`` is the one collective used because gloo
lacks the list form.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ray_fsdp_backend.context_parallel.attention import (
    DocumentSpans,
    SpanCache,
    document_attention,
    document_spans,
)


def _exchange(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` into ``cp`` chunks along ``scatter_dim``, send chunk ``j``
    to rank ``j``, and concatenate what arrives along ``gather_dim`` (rank order)."""
    cp = dist.get_world_size(group)
    chunks = x.chunk(cp, dim=scatter_dim)
    send = torch.stack(chunks).contiguous()  # [cp, ...] : chunk j goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad.contiguous(), ctx.group, gather_dim, scatter_dim), None, None, None


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[batch, heads, seq/cp, d]`` (this rank's tokens, all heads) to
    ``[batch, heads/cp, seq, d]`` (every token, this rank's heads)."""
    return _AllToAll.apply(x, group, 1, 2)


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`sequence_to_heads`."""
    return _AllToAll.apply(x, group, 2, 1)


def kv_repeat_factor(n_heads: int, kv_heads: int, cp_size: int) -> int:
    """PURE: how many times to repeat each key/value head so the kv heads split
    evenly over ``cp_size`` ranks and stay aligned with their query groups
    (1 when ``kv_heads`` already divides; at most ``n_heads / kv_heads``).

    Raises:
        ValueError: ``n_heads`` is not divisible by ``cp_size``.
    """
    if n_heads % cp_size:
        raise ValueError(
            f"{n_heads} attention heads (per tensor-parallel rank) are not divisible by "
            f"context_parallel_size={cp_size}; Ulysses splits heads over the cp ranks"
        )
    group = n_heads // kv_heads
    return next(r for r in range(1, group + 1) if group % r == 0 and (kv_heads * r) % cp_size == 0)


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """All cp ranks' ``[batch, seq/cp]`` shards concatenated along dim 1 (no grad)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


class UlyssesAttention:
    """Causal (document-masked, optionally windowed) attention of
    sequence-sharded ``[batch, heads, seq/cp, d]`` tensors over the whole
    sequence of the cp ``group``; returns ``[batch, heads, seq/cp, d]``.
    ``position_ids`` are this rank's ``[batch or 1, seq/cp]`` positions
    (contiguous split,
    :func:`~ray_fsdp_backend.context_parallel.sequence.shard_sequence`).
    A per-head ``sinks`` tensor covers the whole model's heads; each rank
    takes the slice of the heads it holds after the exchange.

    The whole rows' documents are found from the gathered positions
    (:func:`~ray_fsdp_backend.context_parallel.attention.document_spans`):
    ``seq`` integers gathered and a list of spans, never a ``seq x seq``
    mask. One instance serves every layer of a model: it keeps the spans of
    the forward in flight (:class:`~ray_fsdp_backend.context_parallel.attention.SpanCache`,
    keyed on the local ``position_ids`` tensor and its version counter), so
    the gather and its one host transfer run once per forward, not once per
    layer.
    """

    def __init__(self, group) -> None:
        self.group = group
        self.document_spans = SpanCache(self._gathered_spans)

    def _gathered_spans(self, local: torch.Tensor, rows: int) -> DocumentSpans | None:
        """The whole rows' documents (None: one document per row)."""
        return document_spans(gather_sequence(local, self.group), rows)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        dropout: float = 0.0,
    ) -> torch.Tensor:
        cp = dist.get_world_size(self.group)
        repeat = kv_repeat_factor(q.shape[1], k.shape[1], cp)
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if sinks is not None:
            sinks = sinks.chunk(cp)[dist.get_rank(self.group)]
        q, k, v = (sequence_to_heads(t, self.group) for t in (q, k, v))
        spans = None if position_ids is None else self.document_spans(position_ids, q.shape[0])
        out = document_attention(
            q,
            k,
            v,
            spans,
            scale=scale,
            window=window,
            softcap=softcap,
            sinks=sinks,
            dropout=dropout,
        )
        return heads_to_sequence(out, self.group)
