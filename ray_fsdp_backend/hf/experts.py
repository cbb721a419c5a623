"""Mixture-of-experts weights: one fused tensor in the model, one tensor per
expert in the checkpoint.

``transformers`` 5 keeps a MoE layer's experts as fused 3-D parameters
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj``
``[E, H, I]``) while checkpoints on the hub (and ``save_pretrained``) hold
``mlp.experts.{e}.gate_proj.weight`` etc. ``transformers`` converts them at
load time in full tensors (``conversion_mapping.py``); here the same rule is
a plan (pure: key names and shapes), so that the reader can read, per rank,
only the experts of the rows it owns. Covered: the Qwen2-MoE family
(``gate_proj``/``up_proj``/``down_proj``; Qwen3-MoE, DeepSeek, GLM-MoE ...)
and Mixtral (``block_sparse_moe.experts.{e}.w1/w3/w2``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ray_fsdp_backend.hf.entries import ExpertsEntry, TensorEntry

# fused model suffix -> per-expert checkpoint names concatenated along dim 0, per family
_FUSED = {
    "experts.gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "experts.down_proj": (("down_proj",), ("w2",)),
}
_MIXTRAL_PREFIX = re.compile(r"\.block_sparse_moe\.")


def fuse_experts(
    entries: Mapping[str, TensorEntry], model_keys: Mapping[str, tuple[int, ...]]
) -> dict[str, TensorEntry | ExpertsEntry]:
    """``entries`` with per-expert tensors replaced by the fused model keys
    that need them (only where the model has a fused key and the checkpoint
    does not). Untouched when nothing matches."""
    out: dict[str, TensorEntry | ExpertsEntry] = {}
    for key, entry in entries.items():
        out[key if key in model_keys else _MIXTRAL_PREFIX.sub(".mlp.", key)] = entry
    by_name = dict(out)
    for key in model_keys:
        suffix = next((s for s in _FUSED if key.endswith(s)), None)
        if suffix is None or key in entries:
            continue
        prefix = key[: -len(suffix)]
        for names in _FUSED[suffix]:
            parts = _expert_parts(by_name, prefix, names)
            if parts:
                out[key] = _fused_entry(parts)
                for e in range(len(parts)):
                    for name in names:
                        del out[f"{prefix}experts.{e}.{name}.weight"]
                break
    return out


def _expert_parts(by_name, prefix: str, names: tuple[str, ...]):
    parts = []
    while all(f"{prefix}experts.{len(parts)}.{n}.weight" in by_name for n in names):
        parts.append(tuple(by_name[f"{prefix}experts.{len(parts)}.{n}.weight"] for n in names))
    return tuple(parts)


def _fused_entry(parts) -> ExpertsEntry:
    first = parts[0]
    rows = sum(e.shape[0] for e in first)
    shape = (len(parts), rows, *first[0].shape[1:])
    return ExpertsEntry(parts=parts, dtype=first[0].dtype, shape=shape)
