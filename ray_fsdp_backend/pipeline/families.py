"""What a transformers decoder stage does per family: the families the
pipeline split supports, the checks it makes before cutting, and the parts of
``model.forward`` / ``*ForCausalLM.forward`` a stage must reproduce.

All supported families share one shape: embed, rotary angles, per-layer-type
masks from ``position_ids``, decoder layers, final norm, head. What differs:

- Gemma (1, 2, 3): the embedding's ``sqrt(hidden)`` scale lives in the
  embedding module itself (``Gemma*TextScaledWordEmbedding`` in transformers
  5.25), so it runs on the first stage with the embedding; Gemma 2 and 3 cap
  the final logits (``final_logit_softcapping``, in ``*ForCausalLM.forward``:
  applied on the last stage after the head); Gemma 3's rotary angles differ
  per layer type (local and global bases).
- Mixture-of-experts families (Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss):
  their decoder layers route and run the experts inside the layer; a stage
  calls them as the whole model does. A stage collects no router logits, so
  the auxiliary load-balancing loss is neither added nor logged under pp
  (the step's loss is ``loss_fn`` on the last stage's logits; without pp the
  trainer logs it and does not add it either).
- gpt-oss builds its masks without ``position_ids`` (packed rows are not
  split into documents by its own forward), and a stage does the same.
"""

from __future__ import annotations

import torch

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss")
HF_FAMILIES = DENSE_FAMILIES + MOE_FAMILIES
"""transformers ``model_type`` values a pipeline stage reproduces."""

ROTARY_PER_LAYER_TYPE = ("gemma3_text",)
"""Families whose ``rotary_emb`` takes the layer type (one basis each)."""

MASK_WITHOUT_POSITIONS = ("gpt_oss",)
"""Families whose own forward builds masks without ``position_ids``."""


def check_family(model) -> None:
    """Raise ValueError for a supported family's variant a stage cannot
    reproduce: Gemma 3's bidirectional attention (its masks do not come from
    the causal builders)."""
    config = model.config
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(
            f"{type(model).__name__} with use_bidirectional_attention=True: a pipeline stage "
            "builds causal masks only; pipeline_parallel_size > 1 needs it False"
        )


def layer_type(config, index: int) -> str:
    """Layer ``index``'s attention: ``config.layer_types`` (Qwen2/3, Gemma 2/3,
    Qwen2-MoE, gpt-oss), else sliding when ``config.sliding_window`` is set
    (Mistral, Mixtral, Qwen3-MoE), else full (Llama, Gemma)."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def stage_masks(config, kinds: set[str], x: torch.Tensor, positions: torch.Tensor) -> dict:
    """The attention mask of each layer type in ``kinds``, as the family's
    forward builds it (``position_ids`` split packed documents, except for
    :data:`MASK_WITHOUT_POSITIONS`)."""
    from ray_fsdp_backend.compat.transformers import (
        create_causal_mask,
        create_sliding_window_causal_mask,
    )

    own = None if config.model_type in MASK_WITHOUT_POSITIONS else positions
    masks = {}
    for kind in kinds:
        build = create_causal_mask
        if kind == "sliding_attention":
            build = create_sliding_window_causal_mask
        masks[kind] = build(config, x, position_ids=own)
    return masks


def stage_rotary(inner, config, kinds: set[str], x: torch.Tensor, positions: torch.Tensor):
    """The rotary ``(cos, sin)`` of each layer type in ``kinds``."""
    if config.model_type in ROTARY_PER_LAYER_TYPE:
        return {kind: inner.rotary_emb(x, positions, kind) for kind in kinds}
    angles = inner.rotary_emb(x, position_ids=positions)
    return dict.fromkeys(kinds, angles)


def final_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """The head's logits, soft-capped as Gemma 2/3's ``*ForCausalLM`` does
    (``cap * tanh(logits / cap)``) when ``final_logit_softcapping`` is set."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap
