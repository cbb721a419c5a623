"""``model: pretrained:`` on the worker: the Hugging Face causal LM built on
the meta device (with its LoRA adapters), wrapped, then loaded shard by shard.
The section itself is :mod:`ray_fsdp_backend.trainer.schema.pretrained`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ray_fsdp_backend.trainer.schema.pretrained import BASE_DTYPES, PretrainedModelConfig

if TYPE_CHECKING:
    from torch import nn


def build_pretrained(ctx, cfg: PretrainedModelConfig, *, reward: bool = False) -> nn.Module:
    """The pretrained model (with LoRA adapters under ``cfg.lora``), wrapped
    by ``ctx`` and loaded shard by shard. ``reward``: the checkpoint's
    decoder with a scalar ``score`` head instead of its ``lm_head``
    (``train.objective: reward``;
    :func:`~ray_fsdp_backend.hf.models.build_sequence_classifier`).

    Under LoRA a reward model's ``score`` head trains whole, as a plain
    parameter beside the adapters: peft's ``task_type: SEQ_CLS`` would put it
    in ``modules_to_save`` (a trainable copy under names no export reads,
    refused by ``ctx.wrap``), and a fresh head has nothing to adapt. It keeps
    its name, so the merged export writes it as ``score.weight``."""
    import torch

    from ray_fsdp_backend.hf.models import SCORE_HEAD, build_causal_lm, build_sequence_classifier
    from ray_fsdp_backend.trainer.schema.lora import apply_lora

    dtype = getattr(torch, BASE_DTYPES[cfg.base_dtype][0])
    build = build_sequence_classifier if reward else build_causal_lm
    model = build(cfg.pretrained, dtype=dtype)
    if cfg.lora is not None:
        model = apply_lora(model, cfg.lora)  # adapters fp32 (peft's autocast_adapter_dtype)
        if reward:
            model.get_base_model().get_submodule(SCORE_HEAD).requires_grad_(True)
    model = ctx.wrap(model)
    quantize = cfg.lora.base_quantization if cfg.lora is not None else None
    ctx.load_pretrained(model, cfg.pretrained, quantize=quantize)
    return model


def build_frozen_base(ctx, cfg: PretrainedModelConfig) -> nn.Module:
    """A reference policy: the base (no adapters) built, sharded and loaded
    like the policy, in eval mode, never stepped (DPO's ``reference:
    frozen``; GRPO's KL reference in a full fine-tune)."""
    model = build_pretrained(ctx, dataclasses.replace(cfg, lora=None))
    model.requires_grad_(False)
    return model.eval()
