"""Export in Hugging Face layout: sharded safetensors, index, ``config.json``.

Every rank writes the slices it owns with DCP's ``HuggingFaceStorageWriter``
(``save_distributed``: one file per rank and output shard, no gather), then
``consolidate_safetensors_files_on_every_rank`` turns them into
``model-0000i-of-0000N.safetensors`` files, each rank assembling some of them
one tensor at a time, and rank 0 writes the index, ``config.json`` and
``generation_config.json``. A PEFT model is written merged (its adapters
added into the base weights: :mod:`.peft_export`). Peak host memory on a
rank: its own shard plus one full tensor. Both steps work on local paths only (torch 2.13), so the
path must be one every rank sees (a local disk in one node, a shared
filesystem across nodes).
"""

from __future__ import annotations

import copy
import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files_on_every_rank,
)
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from ray_fsdp_backend.hf.peft_export import merge_adapters
from ray_fsdp_backend.strategies.peft import is_peft_model

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_STAGING = ".rfb-sharded"


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or ``"5GB"``/``"500MiB"``/``"20KB"`` (as
    Hugging Face's ``max_shard_size``: GB = 10**9, GiB = 2**30).

    Raises:
        ValueError: naming the value and the accepted forms.
    """
    if isinstance(size, int) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if not match or match.group(2).upper() not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"max_shard_size={size!r} is not a positive size such as 5GB, 500MB or 2GiB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def plan_shard_files(sizes: dict[str, int], max_bytes: int) -> dict[str, int]:
    """Key -> file index (1-based), filling files in key order up to
    ``max_bytes`` (a tensor larger than that gets a file of its own)."""
    mapping, index, used = {}, 1, 0
    for key, nbytes in sizes.items():
        if used and used + nbytes > max_bytes:
            index, used = index + 1, 0
        mapping[key] = index
        used += nbytes
    return mapping


def export_hf(model: nn.Module, path: str, *, max_shard_size: int | str, dtype: torch.dtype) -> str:
    """Write ``model`` to directory ``path`` in HF layout (see the module
    docstring). Collective; returns ``path`` once every file is complete."""
    max_bytes = parse_size(max_shard_size)
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    state = get_model_state_dict(model)
    state = {k: v for k, v in state.items() if k in _unique_keys(inner, state)}
    if is_peft_model(inner):  # adapters merged into the base, under the base's names
        state = merge_adapters(inner, state)
    state = {k: v.detach().to(dtype) for k, v in state.items()}
    sizes = {k: v.numel() * v.element_size() for k, v in state.items()}
    mapping = plan_shard_files(sizes, max_bytes)
    staging = os.path.join(path, _STAGING)
    writer = HuggingFaceStorageWriter(staging, fqn_to_index_mapping=mapping, save_distributed=True)
    dcp.save(state, storage_writer=writer)
    _barrier()
    consolidate_safetensors_files_on_every_rank(staging, path, mapping)
    _barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        _save_hf_config(inner, path, dtype)
    _barrier()
    return path


def _unique_keys(model: nn.Module, state: dict) -> set[str]:
    """State keys without the second name of a tied parameter (HF keeps
    ``embed_tokens``, drops ``lm_head`` and ties it again on load)."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
    params = dict(model.named_parameters(remove_duplicate=False))
    return {k for k in state if k not in params or first[id(params[k])] == k}


def _save_hf_config(model: nn.Module, path: str, dtype: torch.dtype) -> None:
    """``config.json`` (with the exported dtype) and ``generation_config.json``
    of a ``transformers`` model; nothing for other modules."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "save_pretrained", None)):
        return
    config = copy.deepcopy(config)
    config.dtype = dtype
    config.save_pretrained(path)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(path)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
