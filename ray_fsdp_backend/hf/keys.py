"""Checkpoint keys to model keys (and back) as ``transformers`` maps them.

``from_pretrained`` (transformers 5, ``modeling_utils.py``) accepts a
checkpoint saved from the base model (``LlamaModel``: ``layers.0...``) into a
head model (``LlamaForCausalLM``: ``model.layers.0...``) by adding the
model's ``base_model_prefix``, and the reverse by stripping it; it drops
checkpoint keys matching ``_keys_to_ignore_on_load_unexpected`` (plus legacy
``rotary_emb.inv_freq`` and ``position_ids`` tensors when the model has such
buffers) and tolerates missing keys matching
``_keys_to_ignore_on_load_missing``. :class:`KeyRules` is that decision, made
once from key names (pure); :func:`to_model_key` applies it to one key.
:func:`export_keys` is the other direction: the state keys
``save_pretrained`` writes (tied duplicates and ``_keys_to_ignore_on_save``
left out).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class KeyRules:
    """How checkpoint keys become model keys: ``add``/``strip`` the prefix
    (``"model."``, ``"transformer."``; empty: neither), and the regexes of
    unexpected keys to drop and of missing keys to tolerate."""

    add: str = ""
    strip: str = ""
    ignore_unexpected: re.Pattern | None = None
    ignore_missing: re.Pattern | None = None

    def missing_ok(self, model_key: str) -> bool:
        return self.ignore_missing is not None and self.ignore_missing.search(model_key) is not None


def resolve_key_rules(
    checkpoint_keys: Iterable[str],
    model_keys: Iterable[str],
    *,
    prefix: str = "",
    buffers: Iterable[str] = (),
    ignore_unexpected: Iterable[str] = (),
    ignore_missing: Iterable[str] = (),
) -> KeyRules:
    """The :class:`KeyRules` for these keys (``prefix``: the model class's
    ``base_model_prefix``; ``buffers``: the model's buffer names)."""
    checkpoint_keys, model_keys = set(checkpoint_keys), set(model_keys)
    add = strip = ""
    if prefix:
        dotted = f"{prefix}."
        has = any(k.startswith(dotted) for k in checkpoint_keys)
        expects = any(k.startswith(dotted) for k in model_keys)
        if expects and not has:
            add = dotted
        elif has and not expects:
            strip = dotted
    patterns = set(ignore_unexpected)
    buffers = list(buffers)
    if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(b.endswith("position_ids") for b in buffers):
        patterns.add(r"(^|\.)position_ids$")
    return KeyRules(add, strip, _union(patterns), _union(set(ignore_missing)))


def key_rules_for(model: nn.Module, checkpoint_keys: Iterable[str], model_keys: Iterable[str]):
    """:func:`resolve_key_rules` with the rules a ``transformers`` model
    declares (a plain module declares none: keys are taken as they are)."""
    return resolve_key_rules(
        checkpoint_keys,
        model_keys,
        prefix=getattr(model, "base_model_prefix", "") or "",
        buffers=[name for name, _ in model.named_buffers()],
        ignore_unexpected=_declared(model, "_keys_to_ignore_on_load_unexpected"),
        ignore_missing=_declared(model, "_keys_to_ignore_on_load_missing"),
    )


def missing_rules(model: nn.Module) -> KeyRules:
    """Only the missing keys ``model`` tolerates (its
    ``_keys_to_ignore_on_load_missing``): the rules of a PEFT model, whose
    keys its own map renames (a PeftModel reads the attribute off its base)."""
    return KeyRules(ignore_missing=_union(set(_declared(model, "_keys_to_ignore_on_load_missing"))))


def _declared(model: nn.Module, name: str) -> list[str]:
    return list(getattr(model, name, None) or ())


def to_model_key(key: str, rules: KeyRules, model_keys: set[str] | frozenset[str]) -> str | None:
    """The model key of checkpoint ``key``, or None to skip it: a head's key
    when loading into the base model (``lm_head.weight``), or a key the
    model ignores. ``model_keys`` decides nothing when the key fits as is."""
    if key in model_keys:
        return key
    if rules.add:
        key = rules.add + key
    elif rules.strip:
        if not key.startswith(rules.strip):
            return None  # the head of a head model: the base model has none
        key = key[len(rules.strip) :]
    if key not in model_keys and rules.ignore_unexpected is not None:
        if rules.ignore_unexpected.search(key):
            return None
    return key


def export_keys(model: nn.Module, state: dict) -> list[str]:
    """State keys ``save_pretrained`` writes: the first name of each tied
    parameter (``embed_tokens``, not ``lm_head``: tied again on load), none
    matching ``_keys_to_ignore_on_save``. Linear in the number of keys."""
    first: dict[int, str] = {}
    second: set[str] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            second.add(name)
    second |= set(getattr(model, "_keys_to_ignore_on_save", None) or ())  # exact names
    return [k for k in state if k not in second]


def _union(patterns: set[str]) -> re.Pattern | None:
    if not patterns:
        return None
    return re.compile("|".join(f"({p})" for p in sorted(patterns)))
