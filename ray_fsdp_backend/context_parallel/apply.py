"""Swap a model's attention for its context-parallel form, in place.

Two kinds of model are recognised:

- modules derived from
  :class:`~ray_fsdp_backend.context_parallel.attention.ContextParallelAttention`
  (the project's decoder): their ``attention_fn`` becomes Ulysses (or ring)
  attention over the cp group;
- transformers models: a Ulysses function is registered through
  ``AttentionInterface.register`` (no patching) and selected with
  ``set_attn_implementation``; the cache is turned off, because
  transformers builds a packed row's per-document mask from
  ``position_ids`` only without a cache, and ``use_cache`` defaults to True
  even in train mode (a packed row would attend across documents).
  A name that transformers has no mask function for makes it pass no mask:
  the Ulysses function finds the documents itself from the gathered
  ``position_ids`` and attends within each (no mask tensor). Inputs that
  would compute something else on a shard (``labels`` transformers would
  shift again, a left-padding mask, no ``position_ids``) are refused before
  the forward (:mod:`.inputs`).
"""

from __future__ import annotations

import functools
import sys
from enum import Enum

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ray_fsdp_backend.context_parallel.attention import ContextParallelAttention
from ray_fsdp_backend.context_parallel.inputs import install_input_checks
from ray_fsdp_backend.context_parallel.ring import ring_causal_attention
from ray_fsdp_backend.context_parallel.sequence import HF_SHIFTED_LABELS, count_valid_tokens
from ray_fsdp_backend.context_parallel.ulysses import UlyssesAttention

HF_ATTENTION_NAME = "ray_fsdp_ulysses"
"""The name the Ulysses kernel is registered under in transformers."""


class ContextParallelBackend(str, Enum):
    ULYSSES = "ulysses"
    RING = "ring"


REFUSED_HF_KWARGS = frozenset({"attention_chunk_size", "position_bias", "chunk_size"})
"""Attention-shaping arguments some transformers models pass that this
kernel does not compute. Any other tensor argument but ``position_ids`` is
refused too; plain flags (``output_router_logits``, ``use_cache``, ...)
flow through the model's ``**kwargs`` and change nothing here."""

PASSED_HF_KWARGS = frozenset({"position_ids", HF_SHIFTED_LABELS, "num_items_in_batch"})
"""Tensor arguments that reach the attention through a transformers model's
``**kwargs`` and are not the attention's: ``position_ids`` (read here),
and the loss's ``shift_labels`` / ``num_items_in_batch`` (ignored here)."""


def hf_ulysses_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    *,
    ulysses: UlyssesAttention,
    scaling=None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux=None,
    sinks=None,
    **kwargs,
):
    """transformers' attention-function signature (with ``ulysses`` bound):
    ``[b, heads, seq/cp, d]`` in, ``([b, seq/cp, heads, d], None)`` out.

    Every argument transformers 5.23's decoders pass is honoured: ``scaling``,
    ``dropout`` (nonzero in train mode only, as transformers passes it),
    ``sliding_window`` (per layer), ``softcap`` (Gemma 2), attention sinks
    (``s_aux`` from gpt-oss, ``sinks`` elsewhere), and the per-document
    mask of packed rows from ``position_ids``, combined with the window.
    ``attention_mask`` is None for this registered name (transformers builds
    no mask for it; the mask is built from the gathered positions instead);
    padding belongs at a row's end with label ``-100``, where causal
    attention never lets a real token see it (a mask that hides earlier
    tokens is refused before the forward: :mod:`.inputs`).

    Raises:
        ValueError: an argument this kernel does not compute (never dropped
            silently), or a non-causal call.
    """
    unknown = {
        k: v
        for k, v in kwargs.items()
        if v is not None
        and (k in REFUSED_HF_KWARGS or torch.is_tensor(v) and k not in PASSED_HF_KWARGS)
    }
    if kwargs.get("is_causal") is False:
        unknown["is_causal"] = False
    if attention_mask is not None:
        unknown["attention_mask"] = type(attention_mask).__name__
    if unknown:
        raise ValueError(
            f"context parallelism (Ulysses) got attention arguments it does not compute from "
            f"{type(module).__name__}: {sorted(unknown)}; it computes causal attention with "
            "scaling, dropout, sliding_window, softcap, sinks and packed-row documents"
        )
    out = ulysses(
        query,
        key,
        value,
        position_ids=kwargs.get("position_ids"),
        scale=scaling,
        window=sliding_window,
        softcap=softcap,
        sinks=_local(s_aux if s_aux is not None else sinks),
        dropout=dropout,
    )
    return out.transpose(1, 2).contiguous(), None


def _local(t):
    """A replicated DTensor (a tp-replicated parameter) as its local tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def _hf_models(model: nn.Module) -> list[nn.Module]:
    """transformers models inside ``model`` (none when transformers was never
    imported: then no module can be one)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return []
    return [m for m in model.modules() if isinstance(m, transformers.PreTrainedModel)]


def attention_heads(model: nn.Module) -> int:
    """Query heads of ``model``'s attention (the whole model's, before any
    tensor-parallel split).

    Raises:
        ValueError: no attention recognised (see :func:`apply_context_parallel`).
    """
    own = [m.n_heads for m in model.modules() if isinstance(m, ContextParallelAttention)]
    hf = [m.config.num_attention_heads for m in _hf_models(model)]
    if not own + hf:
        raise ValueError(
            f"context parallelism found no attention to replace in {type(model).__name__}: "
            "it supports transformers models and modules derived from "
            "ray_fsdp_backend.context_parallel.ContextParallelAttention"
        )
    return (own + hf)[0]


def disable_hf_cache(model: nn.Module) -> None:
    """Every transformers model in ``model`` runs with ``use_cache=False`` (a
    forward pre-hook), so packed rows get per-document masks from
    ``position_ids`` (see module docstring). Its config keeps the value it
    had: an exported ``config.json`` is the model's own. Idempotent:
    ``ctx.wrap`` and context parallelism both call it on one model."""
    for hf_model in _hf_models(model):
        if not hf_model.__dict__.get("_rfb_without_cache"):
            hf_model.register_forward_pre_hook(_without_cache, with_kwargs=True)
            hf_model._rfb_without_cache = True


def _without_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return args, {**kwargs, "use_cache": False}


def check_context_parallel(
    model: nn.Module,
    backend: ContextParallelBackend | str,
    compute_dtype: torch.dtype | None = None,
) -> ContextParallelBackend:
    """Refuse what ``backend`` cannot compute for ``model``, by name, before
    any weight moves (``ctx.wrap`` calls it first). Returns the backend.

    Ring is torch's ``context_parallel``: it turns plain causal SDPA into ring
    attention through the CUDA flash or memory-efficient kernel and computes
    no sliding window, soft-cap, attention sink, or mask (so no packed
    documents: ``ctx.shard_sequence`` refuses packed rows for ring). It is
    wired for the project's decoder (plain causal attention); a transformers
    model is refused with ring whatever its family, since every transformers
    decoder may pass any of these per layer. Grouped-query heads in float32
    (``compute_dtype``: what the attention computes in, e.g. FSDP's
    mixed-precision ``param_dtype``) are refused too: flash takes bf16/fp16
    only and the memory-efficient kernel no grouped-query heads, so SDPA
    falls to the math kernel, for which torch 2.13 raises "CP only supports
    flash attention and memory efficient attention now".

    Raises:
        ValueError: no recognised attention (see :func:`attention_heads`),
            ring for a transformers model, or ring with float32
            grouped-query attention.
    """
    attention_heads(model)
    backend = ContextParallelBackend(backend)
    if backend is ContextParallelBackend.RING:
        _check_ring(model, compute_dtype)
    return backend


def _check_ring(model: nn.Module, compute_dtype: torch.dtype | None) -> None:
    hf_models = _hf_models(model)
    if hf_models:
        raise ValueError(
            f"context_parallel_backend='ring' cannot run {type(hf_models[0]).__name__}: torch's "
            "ring attention computes plain causal SDPA only (no sliding_window, softcap, "
            "attention sinks or document masks, which transformers models pass per layer); "
            "it is wired for the project's decoder. Use 'ulysses' for transformers models"
        )
    grouped = [
        m
        for m in model.modules()
        if isinstance(m, ContextParallelAttention) and (m.kv_heads or m.n_heads) < m.n_heads
    ]
    if grouped and compute_dtype == torch.float32:
        m = grouped[0]
        raise ValueError(
            f"context_parallel_backend='ring' cannot run {type(m).__name__} with grouped-query "
            f"heads ({m.n_heads} query, {m.kv_heads} key/value) in float32: torch's ring takes "
            "the flash kernel (bf16/fp16 only) or the memory-efficient one (no grouped-query "
            "heads), and raises for the math kernel. Compute in bf16 "
            "(use_mixed_precision=true) or use 'ulysses'"
        )


def apply_context_parallel(
    model: nn.Module,
    group,
    backend: ContextParallelBackend | str = "ulysses",
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Make every attention of ``model`` context-parallel over ``group``.

    Call before FSDP wraps the model. Inputs then are this rank's shard of
    each row (``ctx.shard_sequence``) with its ``position_ids``.

    Raises:
        ValueError: ``model`` has no attention this module recognises, or
            what ring cannot run (:func:`check_context_parallel`).
    """
    backend = check_context_parallel(model, backend, compute_dtype)
    hf_models = _hf_models(model)
    ulysses = UlyssesAttention(group)
    kernel = ulysses if backend is ContextParallelBackend.ULYSSES else ring_causal_attention
    for module in model.modules():
        if isinstance(module, ContextParallelAttention):
            module.attention_fn = kernel
    if hf_models:
        from ray_fsdp_backend.compat.transformers import register_attention

        # transformers' registry is process-wide: the latest wrap's group wins.
        kernel_fn = functools.partial(hf_ulysses_attention, ulysses=ulysses)
        register_attention(HF_ATTENTION_NAME, kernel_fn)
        for hf_model in hf_models:
            hf_model.set_attn_implementation(HF_ATTENTION_NAME)
        disable_hf_cache(model)
        install_input_checks(hf_models, group)
    return model


def global_token_count(labels: torch.Tensor, group=None) -> torch.Tensor:
    """Valid targets of ``labels`` summed over ``group`` (one all-reduce);
    ``group=None``: no reduction (one process). The loss's divisor is
    ``ctx.global_token_count``, which also divides by the ranks the
    gradients are averaged over (docs/long-context.md, "The loss rule")."""
    count = count_valid_tokens(labels).to(torch.float32)
    if group is not None:
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return count
