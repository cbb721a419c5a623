"""The one place that reaches into transformers beyond its public model API.

The package and its tests call a few of transformers' internals: the mask
builders of ``masking_utils``, the attention registry, the expert-parallel
plan applier, a family's eager attention function. Their signatures move
between releases, so every such call goes through a function here, written to
work across the range ``pyproject.toml`` declares (``transformers>=5.23``;
``.ci/run``'s lower-bound job runs the unit layer and the zoo on 5.23):

- the checkpoint key layout of a family (``conversion_mapping``,
  ``core_model_loading``), which the export writes back (``hf/transformers_moe.py``).
- ``create_causal_mask`` / ``create_sliding_window_causal_mask``: 5.25 renamed
  the fourth parameter ``past_key_values`` to ``cache`` (the old keyword still
  accepted); 5.23 only knows ``past_key_values``. Passed by position here.

transformers is imported inside each function: importing this module costs
nothing and needs no transformers (the core never imports it).
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import version

#: The oldest transformers release the package is tested on (``.ci/run``).
TRANSFORMERS_MIN = (5, 23)


def _release(text: str) -> tuple[int, ...]:
    """``"5.23.0.dev0"`` -> ``(5, 23, 0)``: the leading numeric parts."""
    parts = []
    for part in text.split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def check_transformers_version(installed: str | None = None) -> None:
    """Raise ``ImportError`` naming the installed and the oldest supported
    transformers when the installed one is older than :data:`TRANSFORMERS_MIN`."""
    installed = installed or version("transformers")
    if _release(installed) < TRANSFORMERS_MIN:
        oldest = ".".join(map(str, TRANSFORMERS_MIN))
        raise ImportError(
            f"transformers=={installed} is older than {oldest}, the oldest this package "
            f"supports: pip install 'transformers>={oldest}'"
        )


def _mask_args(config, inputs_embeds, attention_mask, cache, position_ids) -> tuple:
    # Positional: the fourth parameter is ``cache`` from 5.25, ``past_key_values`` before.
    return (config, inputs_embeds, attention_mask, cache, position_ids)


def create_causal_mask(config, inputs_embeds, attention_mask=None, cache=None, position_ids=None):
    """transformers' causal mask for ``config`` (``masking_utils``), as its
    models build it: ``position_ids`` restarting at 0 split packed documents."""
    from transformers import masking_utils

    args = _mask_args(config, inputs_embeds, attention_mask, cache, position_ids)
    return masking_utils.create_causal_mask(*args)


def create_sliding_window_causal_mask(
    config, inputs_embeds, attention_mask=None, cache=None, position_ids=None
):
    """transformers' sliding-window causal mask (``config.sliding_window``)."""
    from transformers import masking_utils

    args = _mask_args(config, inputs_embeds, attention_mask, cache, position_ids)
    return masking_utils.create_sliding_window_causal_mask(*args)


def register_attention(name: str, fn) -> None:
    """Register ``fn`` process-wide under ``name``, selectable with
    ``model.set_attn_implementation(name)``."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)


def apply_expert_parallelism(model, ep_mesh, tp_mesh, plan: dict[str, str], implementation: str):
    """transformers' expert parallelism (``distributed/expert_parallel.py``):
    split the experts ``plan`` names over ``ep_mesh``, install the dispatch."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism as apply

    apply(model, ep_mesh, tp_mesh, plan, implementation)


def eager_attention_forward(family: str):
    """The eager attention function of a transformers model family
    (``"gemma2"``, ``"gpt_oss"``, ...), the reference the cp kernels match."""
    return import_module(f"transformers.models.{family}.modeling_{family}").eager_attention_forward


# -- checkpoint key layout (conversion_mapping, core_model_loading; 5.23 to 5.25) --


def reverse_weight_conversions(model) -> tuple[list, list]:
    """The reverse of ``model``'s load-time weight conversions, as
    ``save_pretrained`` applies them, split into ``(converters, renamings)``:
    transforms that convert tensors (a fused ``gate_up_proj`` -> per-expert
    ``w1`` / ``w3``) and ones that only rename keys. Prefix changes are left
    out, as ``revert_weight_conversion`` leaves them for a model not built by
    ``from_pretrained``."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter

    forward = get_model_conversion_mapping(model, add_legacy=False) if model is not None else []
    forward = [t for t in forward if not isinstance(t, PrefixChange)]
    reverse = [t.reverse_transform() for t in forward[::-1]]
    converters = [t for t in reverse if isinstance(t, WeightConverter)]
    return converters, [t for t in reverse if not isinstance(t, WeightConverter)]


def converted_target(key: str, converters: list) -> str | None:
    """The checkpoint key a converted ``key`` feeds, or None if no converter matches."""
    from transformers.core_model_loading import apply_converters

    target, pattern = apply_converters(key, converters)
    return target if pattern is not None else None


def renamed_key(key: str, renamings: list) -> str:
    """``key`` under the renamings (``apply_renamings``)."""
    from transformers.core_model_loading import apply_renamings

    return apply_renamings(key, renamings)


def revert_weight_conversion(model, values: dict) -> dict:
    """The checkpoint tensors of one converted group, from their whole model ``values``."""
    from transformers.core_model_loading import revert_weight_conversion as revert

    return dict(revert(model, values))
