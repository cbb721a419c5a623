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

:func:`split_experts` is the export direction: the fused tensors back to the
keys ``save_pretrained`` writes, by transformers' own conversion mapping.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch
from torch import nn

from ray_fsdp_backend.compat.transformers_moe import CheckpointLayout
from ray_fsdp_backend.distributed.collectives import full_tensor
from ray_fsdp_backend.hf.entries import ExpertsEntry, TensorEntry

# fused model suffix -> per-expert checkpoint names concatenated along dim 0, per family
_FUSED = {
    "experts.gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "experts.down_proj": (("down_proj",), ("w2",)),
}
_MIXTRAL_BLOCK = ".block_sparse_moe."
_MIXTRAL_PREFIX = re.compile(re.escape(_MIXTRAL_BLOCK))


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


def renamed_key_map(names: Mapping[str, str]) -> Callable[[str], str | None]:
    """Checkpoint key -> model key, for a model whose names are the
    checkpoint's under another prefix (PEFT's ``base_model.model.``):
    ``names`` maps the checkpoint form of every model key to the key. A
    per-expert checkpoint key (``...mlp.experts.3.gate_proj.weight``,
    Mixtral's ``...block_sparse_moe.experts.3.w1.weight``), which no model
    key names, gets the prefix of its layer's fused key, so that
    :func:`fuse_experts` finds it; Mixtral's ``block_sparse_moe.gate`` maps
    like ``mlp.gate``. Other keys: ``names`` or None."""
    layers: dict[str, str] = {}
    for ckpt, key in names.items():
        suffix = next((s for s in _FUSED if ckpt.endswith(s)), None)
        if suffix is not None:
            layers[ckpt[: -len(suffix)]] = key[: -len(suffix)]

    def key_map(key: str) -> str | None:
        plain = _MIXTRAL_PREFIX.sub(".mlp.", key)
        if plain in names:
            return names[plain]
        match = _PER_EXPERT.match(plain)
        if match is None or match.group(1) not in layers:
            return None
        return layers[match.group(1)] + plain[len(match.group(1)) :]

    return key_map


_PER_EXPERT = re.compile(r"(.*\.)experts\.\d+\.")


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


def split_experts(state: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``state`` under the key layout ``save_pretrained`` writes for
    ``model``'s family, read from transformers' own conversion mapping
    (:class:`~ray_fsdp_backend.compat.transformers_moe.CheckpointLayout`), not
    from ``model_type``: a fused experts tensor the family's checkpoints hold
    per expert is split (Qwen-MoE's ``mlp.experts.{e}.gate_proj.weight``;
    Mixtral and MiniMax's ``block_sparse_moe.experts.{e}.w1.weight``, their
    routers under ``block_sparse_moe.gate``); gpt-oss keeps its fused,
    interleaved tensors. Order is kept; other keys are renamed only. A
    converted DTensor (FSDP2, expert parallel) is gathered whole first:
    collective, every rank calls it, and each rank then holds the layer's
    experts in full while they are written."""
    layout = CheckpointLayout(model)
    groups: dict[str, list[str]] = {}
    for key in state:
        target = layout.group(key)
        if target is not None:
            groups.setdefault(target, []).append(key)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        target = layout.group(key)
        if target is None:
            out[layout.renamed(key)] = value
        elif groups[target][0] == key:  # one group at a time, whole while it is written
            out.update(layout.convert({k: full_tensor(state[k]).detach() for k in groups[target]}))
    return out
