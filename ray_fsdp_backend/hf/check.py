"""Check a pretrained checkpoint before anything starts: :func:`check_pretrained`.

``ray-fsdp validate``, ``plan`` and ``train`` run it on the driver (through
the training spec's checks), before Ray starts; a library user calls it
before ``TorchTrainer.fit()``::

    from ray_fsdp_backend.hf.check import check_pretrained

    errors = check_pretrained("s3://bucket/llama-3-8b", lora_targets=["q_proj", "v_proj"])
    if errors:
        raise SystemExit("\\n".join(errors))

It reads ``config.json`` only (through ``pyarrow.fs``: a local directory or
an object store URI) and builds the model on the meta device: no weights. A
local checkpoint of a family :mod:`~ray_fsdp_backend.hf.shapes` covers is
checked from its ``config.json`` and safetensors headers instead, without
torch or ``transformers`` (``plan`` and ``validate`` in well under 2 s).
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pyarrow.fs as pafs

from ray_fsdp_backend.storage.filesystem import resolve_filesystem

if TYPE_CHECKING:
    from torch import nn


def check_pretrained(
    path: str | os.PathLike,
    *,
    lora_targets: Sequence[str] | None = None,
    filesystem: pafs.FileSystem | None = None,
    key: str = "model.pretrained",
) -> list[str]:
    """Every problem the workers would hit with this checkpoint, one message
    each (empty: none): the directory or its ``config.json`` not found, a
    ``config.json`` transformers cannot read, LoRA targets that match no
    linear layer of the model. ``key`` names the setting in the messages.

    The path must be visible from where this runs (the driver): a shared file
    system or an object store, as the workers see it.
    """
    text = os.fspath(path)
    try:
        fs, root = resolve_filesystem(text, filesystem)
        found = {p: fs.get_file_info(p).type for p in (root, posixpath.join(root, "config.json"))}
    except (ValueError, OSError) as exc:
        return [f"{key}={text!r}: cannot be read: {exc}"]
    if found[root] == pafs.FileType.NotFound:
        return [f"{key}={text!r}: directory not found"]
    if found[posixpath.join(root, "config.json")] != pafs.FileType.File:
        return [f"{key}={text!r}: config.json not found in it (a Hugging Face checkpoint has one)"]
    from ray_fsdp_backend.hf.shapes import read_local_shapes

    shapes = read_local_shapes(text) if filesystem is None else None
    if shapes is not None:  # a covered family: transformers knows its model_type
        return linear_name_errors(shapes.model_class, shapes.linear_names(), lora_targets or ())
    from ray_fsdp_backend.hf.models import build_causal_lm

    try:
        model = build_causal_lm(text, filesystem=filesystem)
    except (ValueError, OSError, KeyError) as exc:
        return [f"{key}={text!r}: transformers cannot build a model from its config.json: {exc}"]
    return lora_target_errors(model, lora_targets or ())


def export_target_errors(
    path: str | os.PathLike,
    *,
    overwrite: bool,
    filesystem: pafs.FileSystem | None = None,
    key: str = "model.export",
) -> list[str]:
    """The refusal :func:`~ray_fsdp_backend.hf.export.export_model` would raise
    at the end of the run, found before it starts: a non-empty target without
    ``overwrite`` (one message; empty: none). An unreadable target is left to
    the export, which checks it again on every rank."""
    from ray_fsdp_backend.hf.target import describe_entries, target_entries

    text = os.fspath(path)
    try:
        fs, root = resolve_filesystem(text, filesystem)
        names = target_entries(fs, root)
    except (ValueError, OSError):
        return []
    if not names or overwrite:
        return []
    return [
        f"{key}={text!r} is not empty ({describe_entries(names)}): the export would mix two "
        f"models' files; set {key}_overwrite: true to replace its weights, or choose an empty path"
    ]


def lora_target_errors(base: nn.Module, targets: Sequence[str]) -> list[str]:
    """One message when a LoRA target names no linear layer of ``base`` (the
    key ``model.lora.target_modules``, its value and the layers there are)."""
    linear = {name.rsplit(".", 1)[-1] for name, m in base.named_modules() if _is_linear(m)}
    return linear_name_errors(type(base).__name__, linear, targets)


def linear_name_errors(model: str, linear: set[str], targets: Sequence[str]) -> list[str]:
    """One message when a LoRA target is not among ``linear``, the last name
    parts of ``model``'s linear layers."""
    missing = [t for t in targets if t not in linear]
    if not missing:
        return []
    return [
        f"model.lora.target_modules={list(targets)!r}: {missing} match no linear layer of "
        f"{model}; its linear layers are {sorted(linear)}"
    ]


def _is_linear(module: nn.Module) -> bool:
    from torch import nn

    # transformers' GPT-2 uses Conv1D, a linear layer under another name.
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"
