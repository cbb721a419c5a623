"""``transformers`` helpers for pretrained causal LMs (the ``hf`` extra).

``transformers`` is imported inside each function, never at module import:
the core package works without it.
"""

from __future__ import annotations

import os

import pyarrow.fs as pafs
import torch
from torch import nn

from ray_fsdp_backend.hf.metadata import load_tokenizer, metadata_dir
from ray_fsdp_backend.hf.reader import read_checkpoint_index
from ray_fsdp_backend.storage.filesystem import resolve_filesystem

__all__ = ["build_causal_lm", "count_checkpoint_parameters", "load_tokenizer", "metadata_dir"]


def build_causal_lm(
    path: str | os.PathLike,
    *,
    filesystem: pafs.FileSystem | None = None,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """The checkpoint's causal LM (``AutoConfig`` + ``from_config``) built on
    the meta device in ``dtype``: no memory until a strategy wraps it; then
    :func:`~ray_fsdp_backend.hf.load_pretrained` fills it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ray_fsdp_backend.compat.transformers import check_transformers_version

    check_transformers_version()
    with metadata_dir(path, filesystem) as local:
        config = AutoConfig.from_pretrained(local)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def count_checkpoint_parameters(
    path: str | os.PathLike, filesystem: pafs.FileSystem | None = None
) -> int:
    """Number of weights in the checkpoint, from the safetensors headers
    alone (a few KB read per file, no weights)."""
    fs, root = resolve_filesystem(path, filesystem)
    entries = read_checkpoint_index(fs, root).values()
    return sum((e.end - e.begin) // e.dtype.itemsize for e in entries)
