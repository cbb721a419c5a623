"""PEFT's names and files: which model keys a checkpoint fills.

A ``PeftModel`` names its parameters ``base_model.model.`` + the base
model's names, with ``.base_layer`` inside every wrapped layer
(``...q_proj.base_layer.weight``) and the adapters under their adapter name
(``...q_proj.lora_A.default.weight``). A base checkpoint holds the base
names; a PEFT adapter directory (``adapter_config.json`` beside
``adapter_model.safetensors``) holds the adapters without the adapter name
(``...q_proj.lora_A.weight``). :func:`resolve_peft_load` says, for a model
and a path, which file to read, how its keys map onto the model's and which
parameters it must fill. ``peft`` itself is imported on use only.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow.fs as pafs
from torch import nn

from ray_fsdp_backend.compat.peft import peft_configs, tuner_layers, unwrap
from ray_fsdp_backend.hf.experts import renamed_key_map
from ray_fsdp_backend.hf.reader import PretrainedCheckpointError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# The config fields that decide the adapters' names and shapes.
_LAYOUT_FIELDS = ("peft_type", "r", "target_modules")


@dataclass(frozen=True)
class PeftNames:
    """A PEFT model's parameter names, sorted by what fills them."""

    base: dict[str, str]
    """Model key of each base parameter/buffer -> its base checkpoint name."""
    adapters: dict[str, tuple[str, str]]
    """Model key of each adapter parameter -> (adapter name, name in PEFT's file)."""


def peft_names(model: nn.Module, keys: list[str]) -> PeftNames:
    """Sort ``keys`` (the model's state-dict keys) into base and adapter names."""
    inner = unwrap(model)
    prefix = PEFT_PREFIX if _is_peft_model_class(inner) else ""
    adapter_dirs: dict[str, str] = {}  # "<layer>.<lora_A>." -> its base-name form
    wrapped: list[str] = []
    for name, layer in tuner_layers(inner):
        wrapped.append(f"{name}.")
        for attr in layer.adapter_layer_names:
            adapter_dirs[f"{name}.{attr}."] = attr
    base, adapters = {}, {}
    for key in keys:
        owner = next((d for d in adapter_dirs if key.startswith(d)), None)
        if owner is None:
            base[key] = _base_name(key, prefix, wrapped)
            continue
        adapter, _, rest = key[len(owner) :].partition(".")
        saved = f"{owner}{rest}" if rest else owner.rstrip(".")
        adapters[key] = (adapter, saved)
    return PeftNames(base, adapters)


def _base_name(key: str, prefix: str, wrapped: list[str]) -> str:
    for layer in wrapped:
        if key.startswith(f"{layer}base_layer."):
            key = layer + key[len(layer) + len("base_layer.") :]
            break
    return key[len(prefix) :] if prefix and key.startswith(prefix) else key


def _is_peft_model_class(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


@dataclass(frozen=True)
class PeftLoad:
    """What :func:`load_pretrained` reads for a PEFT model."""

    path: str
    """The safetensors file or checkpoint directory to read."""
    key_map: Callable[[str], str | None]
    """Checkpoint key -> model key (None: not this model's)."""
    required: set[str]
    """Model keys the checkpoint must hold."""
    fills_base: bool
    """Whether it loads the frozen base (else the adapters)."""


def resolve_peft_load(
    model: nn.Module, keys: list[str], fs: pafs.FileSystem, root: str
) -> PeftLoad | None:
    """How to load ``root`` into a PEFT ``model`` (None: not a PEFT model).

    A directory with ``adapter_config.json`` is an adapter directory: its
    config must match the model's adapter (type, rank, targets) and it fills
    the adapters; anything else is a base checkpoint, which fills every
    parameter but the adapters.

    Raises:
        PretrainedCheckpointError: the adapter config names another layout.
    """
    if not tuner_layers(unwrap(model)):
        return None
    names = peft_names(model, keys)
    config = posixpath.join(root, ADAPTER_CONFIG)
    if fs.get_file_info(config).type != pafs.FileType.File:
        base = {ckpt: key for key, ckpt in names.base.items()}
        return PeftLoad(root, renamed_key_map(base), set(names.base), fills_base=True)
    with fs.open_input_stream(config) as f:
        saved = json.loads(f.read())
    adapter = check_adapter_config(model, saved, where=root)
    by_saved = {s: k for k, (a, s) in names.adapters.items() if a == adapter}
    return PeftLoad(
        posixpath.join(root, ADAPTER_WEIGHTS), by_saved.get, set(by_saved.values()), False
    )


def check_adapter_config(model: nn.Module, saved: dict, *, where: str) -> str:
    """The model's adapter that ``saved`` (an ``adapter_config.json``) fits.

    Raises:
        PretrainedCheckpointError: naming the first field that differs, its
            value in the directory and in the model.
    """
    configs = peft_configs(model)
    if not configs:
        raise PretrainedCheckpointError(f"{where}: the model has no PEFT config to load into")
    adapter, config = next(iter(configs.items()))
    for field in _LAYOUT_FIELDS:
        mine, theirs = _normal(getattr(config, field, None)), _normal(saved.get(field))
        if mine != theirs:
            raise PretrainedCheckpointError(
                f"adapter {where!r} does not fit the model's adapter {adapter!r}: "
                f"{field}={saved.get(field)!r} in {ADAPTER_CONFIG}, "
                f"{field}={getattr(config, field, None)!r} in the model"
            )
    return adapter


def _normal(value):
    if isinstance(value, (set, list, tuple)):
        return sorted(value)
    return getattr(value, "value", value)  # PeftType is a str enum
