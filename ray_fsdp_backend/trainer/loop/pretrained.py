"""``model: pretrained:`` on the worker: the Hugging Face causal LM built on
the meta device (with its LoRA adapters), wrapped, then loaded shard by shard.
The section itself is :mod:`ray_fsdp_backend.trainer.schema.pretrained`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ray_fsdp_backend.trainer.schema.pretrained import BASE_DTYPES, PretrainedModelConfig

if TYPE_CHECKING:
    from torch import nn


def build_pretrained(ctx, cfg: PretrainedModelConfig) -> nn.Module:
    """The pretrained model (with LoRA adapters under ``cfg.lora``), wrapped
    by ``ctx`` and loaded shard by shard."""
    import torch

    from ray_fsdp_backend.hf.models import build_causal_lm
    from ray_fsdp_backend.trainer.schema.lora import apply_lora

    dtype = getattr(torch, BASE_DTYPES[cfg.base_dtype][0])
    model = build_causal_lm(cfg.pretrained, dtype=dtype)
    if cfg.lora is not None:
        model = apply_lora(model, cfg.lora)  # adapters fp32 (peft's autocast_adapter_dtype)
    model = ctx.wrap(model)
    quantize = cfg.lora.base_quantization if cfg.lora is not None else None
    ctx.load_pretrained(model, cfg.pretrained, quantize=quantize)
    return model
