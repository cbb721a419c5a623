"""What a transformers mixture-of-experts family declares about itself,
read from transformers' own tables (5.23 to 5.25) rather than from
``model_type`` strings.

- :func:`router_class`: the class transformers records router logits from
  (``PreTrainedModel._can_record_outputs["router_logits"]``): Qwen's and
  Mixtral's ``mlp.gate``, gpt-oss's ``mlp.router``.
- :class:`CheckpointLayout`: the weight conversions that turn a family's
  checkpoint keys into its fused model keys at load time
  (``conversion_mapping.get_model_conversion_mapping``), reversed as
  ``save_pretrained`` reverses them: they say which layout the family's
  checkpoints hold.
"""

from __future__ import annotations

import torch
from torch import nn

from ray_fsdp_backend.compat import transformers as compat


def router_class(model: nn.Module) -> type[nn.Module] | None:
    """The router module class of ``model``'s transformers family (the
    target of its ``router_logits`` output recorder), or None."""
    for module in model.modules():
        recorders = getattr(type(module), "_can_record_outputs", None) or {}
        recorder = recorders.get("router_logits")
        target = getattr(recorder, "target_class", None)
        if isinstance(target, type):
            return target
    return None


def _pretrained(model: nn.Module):
    from transformers import PreTrainedModel

    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


class CheckpointLayout:
    """The reverse of ``model``'s load-time conversions, as ``save_pretrained``
    applies them (``core_model_loading.revert_weight_conversion``): renamed
    keys (Mixtral's ``mlp.`` -> ``block_sparse_moe.``) and converted ones
    (a fused ``gate_up_proj`` -> per-expert ``w1`` / ``w3``). A family
    without converters (gpt-oss keeps its fused, interleaved tensors) keeps
    every key."""

    def __init__(self, model: nn.Module):
        self._model = _pretrained(model)
        self._converters, self._renamings = compat.reverse_weight_conversions(self._model)

    def group(self, key: str) -> str | None:
        """The checkpoint target a converted ``key`` feeds (keys of one group
        are converted together), or None for a key that is only renamed."""
        return compat.converted_target(key, self._converters)

    def renamed(self, key: str) -> str:
        """The checkpoint name of a key that is not converted."""
        return compat.renamed_key(key, self._renamings)

    def convert(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of one group of converted keys, from their
        whole ``values``."""
        return compat.revert_weight_conversion(self._model, values)
