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

__all__ = [
    "build_causal_lm",
    "build_sequence_classifier",
    "count_checkpoint_parameters",
    "load_tokenizer",
    "metadata_dir",
]

SCORE_HEAD = "score"
"""The scalar head of transformers' ``*ForSequenceClassification`` decoders
(Llama, Qwen, Mistral, ...: ``GenericForSequenceClassification``)."""


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


def build_sequence_classifier(
    path: str | os.PathLike,
    *,
    filesystem: pafs.FileSystem | None = None,
    dtype: torch.dtype = torch.float32,
    num_labels: int = 1,
) -> nn.Module:
    """The checkpoint's decoder with a linear head of ``num_labels`` outputs
    (``AutoModelForSequenceClassification``, the head named ``score``; 1: a
    reward model), built on the meta device in ``dtype`` like
    :func:`build_causal_lm`, from a causal LM's checkpoint or a classifier's.

    The model declares what ``from_pretrained`` tolerates when it builds a
    classifier from a causal LM: the checkpoint's ``lm_head`` is not loaded
    and a missing ``score`` keeps the initialisation ``ctx.wrap`` gives it
    (transformers' ``_init_weights``: normal, ``initializer_range``, drawn
    from the run's seed), through the key rules :func:`load_pretrained`
    honours. ``pad_token_id`` (which the exported classifier needs for
    batches of several rows) is the config's, else the tokenizer's pad
    token, else its end of sequence, as TRL's ``RewardTrainer`` sets it."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from ray_fsdp_backend.compat.transformers import check_transformers_version

    check_transformers_version()
    with metadata_dir(path, filesystem) as local:
        config = AutoConfig.from_pretrained(local, num_labels=num_labels)
        if config.pad_token_id is None:
            config.pad_token_id = _pad_token_id(local, config)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    # Instance-level, as the class attributes transformers reads (hf/keys.py).
    model._keys_to_ignore_on_load_unexpected = [r"^lm_head\."]
    model._keys_to_ignore_on_load_missing = [rf"(^|\.){SCORE_HEAD}\."]
    return model


def _pad_token_id(local: str, config) -> int | None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(local)
        tokens = (tokenizer.pad_token_id, tokenizer.eos_token_id)
    except (OSError, ValueError):  # a checkpoint saved without its tokenizer
        tokens = ()
    for candidate in (*tokens, config.eos_token_id):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return candidate
    return None


def count_checkpoint_parameters(
    path: str | os.PathLike, filesystem: pafs.FileSystem | None = None
) -> int:
    """Number of weights in the checkpoint, from the safetensors headers
    alone (a few KB read per file, no weights)."""
    fs, root = resolve_filesystem(path, filesystem)
    entries = read_checkpoint_index(fs, root).values()
    return sum((e.end - e.begin) // e.dtype.itemsize for e in entries)
