"""``load_pretrained``: Hugging Face safetensors weights into a wrapped model.

The model is built on the meta device and wrapped first (FSDP2, HSDP, DDP,
DMuon), so each rank holds only its own storage. The checkpoint's headers
are read and checked against the model's state dict before any weight is
read; then DCP plans the load and :class:`SafetensorsReader` reads, on each
rank, only the byte ranges of the slices that rank owns.
"""

from __future__ import annotations

import os
import weakref
from collections import Counter

import pyarrow.fs as pafs
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from ray_fsdp_backend.filesystem import resolve_filesystem
from ray_fsdp_backend.hf.entries import Entry
from ray_fsdp_backend.hf.experts import fuse_experts
from ray_fsdp_backend.hf.peft import resolve_peft_load
from ray_fsdp_backend.hf.reader import (
    KeyMap,
    PretrainedCheckpointError,
    SafetensorsReader,
    read_checkpoint_index,
)
from ray_fsdp_backend.strategies.peft import note_frozen_loaded

_SHOWN = 5
# The checkpoint dtype of each model loaded here: the default dtype of an HF export.
_LOADED_DTYPE: weakref.WeakKeyDictionary[nn.Module, torch.dtype] = weakref.WeakKeyDictionary()


def pretrained_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the weights ``load_pretrained`` loaded into ``model``
    (the most common one), or None."""
    return _LOADED_DTYPE.get(_unwrapped(model))


def load_pretrained(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    filesystem: pafs.FileSystem | None = None,
    key_map: KeyMap | None = None,
) -> SafetensorsReader:
    """Load the safetensors checkpoint at ``path`` into ``model`` in place.

    ``path`` is a directory (``model.safetensors``, or shards with
    ``model.safetensors.index.json``), one ``.safetensors`` file, a URI
    (``s3://``, ``gs://``), or a path on ``filesystem``. Values are cast to the
    parameters' dtype; tied weights stay tied (the checkpoint may hold either
    name). Buffers the checkpoint lacks keep the values the model's own
    initialisation gave them (rotary tables and other non-persistent buffers
    are never in a checkpoint). A PEFT model needs no ``key_map``: a base
    checkpoint fills everything but the adapters (which keep PEFT's
    initialisation), a PEFT adapter directory (``adapter_config.json``) fills
    the adapters (see :mod:`.peft`). Create the optimizer afterwards. Collective:
    every rank calls it. Returns the reader (``bytes_read`` says how much this
    rank read).

    Raises:
        PretrainedCheckpointError: the path does not exist, a file is corrupt,
            or keys/shapes do not fit the model; raised before any weight is read.
    """
    fs, root = resolve_filesystem(path, filesystem)
    state = get_model_state_dict(model)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    params = {n: id(p) for n, p in _unwrapped(model).named_parameters(remove_duplicate=False)}
    peft = resolve_peft_load(model, list(state), fs, root) if key_map is None else None
    if peft is not None:  # PEFT names: the base, or the adapters of an adapter directory
        root, key_map = peft.path, peft.key_map
        params = {n: i for n, i in params.items() if n in peft.required}
        state = {k: v for k, v in state.items() if k in peft.required}
    entries = fuse_experts(read_checkpoint_index(fs, root, key_map), shapes)
    to_load = check_fits(state, params, entries, where=os.fspath(path))
    reader = SafetensorsReader(fs, {k: entries[k] for k in to_load})
    load_state = {k: state[k] for k in to_load}
    dcp.load(load_state, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_model_state_dict(model, load_state, options=StateDictOptions(strict=False))
    if peft is None or peft.fills_base:
        note_frozen_loaded(model)
        dtypes = Counter(entries[k].dtype for k in to_load)
        if dtypes:
            _LOADED_DTYPE[_unwrapped(model)] = dtypes.most_common(1)[0][0]
    return reader


def _unwrapped(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def check_fits(
    state: dict, params: dict[str, int], entries: dict[str, Entry], *, where: str
) -> list[str]:
    """The model keys to load from the checkpoint.

    Every parameter (``params``: name -> identity, so tied weights share one)
    must be in the checkpoint under one of its names, buffers may be absent;
    every checkpoint tensor must be a model key of the same shape.

    Raises:
        PretrainedCheckpointError: naming the first keys of each kind, their
            count and the checkpoint (or the file of a mismatched tensor).
    """
    names: dict[int, list[str]] = {}
    for name, ident in params.items():
        names.setdefault(ident, []).append(name)
    missing = [k for k in state if k in params and not any(a in entries for a in names[params[k]])]
    unexpected = [k for k in entries if k not in state]
    shapes = [
        f"{k} (checkpoint {list(e.shape)} in {e.file}, model {list(state[k].shape)})"
        for k, e in entries.items()
        if k in state and tuple(state[k].shape) != e.shape
    ]
    problems = [
        _describe("missing from the checkpoint", missing),
        _describe("in the checkpoint but not in the model", unexpected),
        _describe("of another shape", shapes),
    ]
    problems = [p for p in problems if p]
    if problems:
        raise PretrainedCheckpointError(
            f"pretrained checkpoint {where!r} does not fit the model: "
            + "; ".join(problems)
            + " (pass key_map= to rename checkpoint keys)"
        )
    return [k for k in state if k in entries]


def _describe(what: str, keys: list[str]) -> str:
    if not keys:
        return ""
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return f"{len(keys)} keys {what}: {', '.join(keys[:_SHOWN])}{more}"
