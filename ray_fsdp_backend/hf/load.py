"""``load_pretrained``: Hugging Face safetensors weights into a wrapped model.

The model is built on the meta device and wrapped first (FSDP2, HSDP, DDP,
DMuon), so each rank holds only its own storage. Rank 0 reads the
checkpoint's headers (once per file) and broadcasts them; the keys are
mapped as ``transformers`` maps them (:mod:`.keys`) and checked against the
model's state dict before any weight is read; then DCP plans the load and
:class:`SafetensorsReader` reads, on each rank, only the byte ranges of the
slices that rank owns, concurrently. The context remembers where each model
was loaded from (:func:`loaded_from`), for the export.
"""

from __future__ import annotations

import os
import weakref
from collections import Counter
from dataclasses import dataclass

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

from ray_fsdp_backend.compat.peft import note_frozen_loaded, unwrap
from ray_fsdp_backend.distributed.collectives import broadcast_from_rank0
from ray_fsdp_backend.hf.entries import Entry
from ray_fsdp_backend.hf.experts import fuse_experts
from ray_fsdp_backend.hf.keys import KeyRules, key_rules_for, missing_rules, to_model_key
from ray_fsdp_backend.hf.peft import resolve_peft_load
from ray_fsdp_backend.hf.reader import (
    KeyMap,
    PretrainedCheckpointError,
    SafetensorsReader,
    read_checkpoint_index,
)
from ray_fsdp_backend.hf.safetensors_io import UnsupportedDtypeError, check_cast
from ray_fsdp_backend.storage.filesystem import resolve_filesystem

_SHOWN = 5


@dataclass(frozen=True)
class Source:
    """Where ``load_pretrained`` read a model's weights: the filesystem, the
    path on it, and the checkpoint's (most common) dtype."""

    filesystem: pafs.FileSystem
    path: str
    dtype: torch.dtype | None


_SOURCES: weakref.WeakKeyDictionary[nn.Module, Source] = weakref.WeakKeyDictionary()


def loaded_from(model: nn.Module) -> Source | None:
    """The checkpoint ``load_pretrained`` loaded into ``model``, or None
    (the export's default dtype and the tokenizer files it copies)."""
    return _SOURCES.get(unwrap(model))


def load_pretrained(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    filesystem: pafs.FileSystem | None = None,
    key_map: KeyMap | None = None,
    quantize: str | None = None,
) -> SafetensorsReader:
    """Load the safetensors checkpoint at ``path`` into ``model`` in place.

    ``path`` is a directory (``model.safetensors``, or shards with
    ``model.safetensors.index.json``), one ``.safetensors`` file, a URI
    (``s3://``, ``gs://``), or a path on ``filesystem``. Keys map as
    ``from_pretrained`` maps them (:mod:`.keys`: the base model's prefix
    added or stripped, keys the model ignores dropped), after ``key_map``.
    Values are cast to the parameters' dtype; tied weights stay tied (the
    checkpoint may hold either name). Buffers the checkpoint lacks keep the
    values the model's own initialisation gave them (rotary tables and other
    non-persistent buffers are never in a checkpoint). A PEFT model needs no
    ``key_map``: a base checkpoint fills everything but the adapters (which
    keep PEFT's initialisation), a PEFT adapter directory
    (``adapter_config.json``) fills the adapters (see :mod:`.peft`). Rank 0
    reads the files' headers and broadcasts them; each rank then reads its
    own byte ranges, concurrently; a pipeline stage (``ctx.wrap`` under
    ``pipeline_parallel_size > 1``) only its own stage's tensors, the other
    stages' checkpoint keys left to them. ``quantize="nf4"`` (QLoRA; needs
    ``torchao``) then turns every frozen ``nn.Linear`` weight but the output
    head into 4-bit NF4, each rank its own shard (:mod:`ray_fsdp_backend.ops.quantization`,
    docs/lora.md). Create the optimizer afterwards.
    Collective: every rank calls it. Returns the reader (``bytes_read`` says
    how much this rank read).

    Raises:
        PretrainedCheckpointError: the path does not exist, a file is corrupt,
            or keys/shapes do not fit the model; raised before any weight is read.
        ValueError: ``quantize`` is not ``"nf4"``, or a weight's shards do not
            divide into NF4 blocks (naming the shapes), before any weight is read.
    """
    nf4 = _nf4_targets(model, quantize)
    fs, root = resolve_filesystem(path, filesystem)
    state = get_model_state_dict(model)
    inner = unwrap(model)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    params = {n: id(p) for n, p in inner.named_parameters(remove_duplicate=False)}
    peft = resolve_peft_load(model, list(state), fs, root) if key_map is None else None
    if peft is not None:  # PEFT names: the base, or the adapters of an adapter directory
        root, key_map = peft.path, peft.key_map
        params = {n: i for n, i in params.items() if n in peft.required}
        state = {k: v for k, v in state.items() if k in peft.required}
    checkpoint = broadcast_from_rank0(lambda: read_checkpoint_index(fs, root, key_map))
    rules = key_rules_for(inner, checkpoint, state) if peft is None else missing_rules(inner)
    names = frozenset(state)
    mapped = {}
    for key, entry in checkpoint.items():
        name = to_model_key(key, rules, names)
        if name is not None:
            mapped[name] = entry
    entries = fuse_experts(mapped, shapes)
    if getattr(inner, "pipeline_plan", None) is not None:
        # A pipeline stage (pipeline/split.py keeps the original names): the
        # other stages' tensors are theirs, neither read nor "unexpected" here.
        entries = {k: e for k, e in entries.items() if k in state}
    to_load = check_fits(state, params, entries, where=os.fspath(path), rules=rules)
    for key in to_load:
        try:
            check_cast(entries[key].dtype, state[key].dtype, file=entries[key].file, key=key)
        except UnsupportedDtypeError as exc:
            raise PretrainedCheckpointError(str(exc)) from None
    reader = SafetensorsReader(fs, {k: entries[k] for k in to_load})
    load_state = {k: state[k] for k in to_load}
    dcp.load(load_state, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_model_state_dict(model, load_state, options=StateDictOptions(strict=False))
    if nf4 is not None:
        from ray_fsdp_backend.ops.quantization import apply_nf4

        apply_nf4(model, nf4)
    if peft is None or peft.fills_base:
        note_frozen_loaded(model)
        dtypes = Counter(entries[k].dtype for k in to_load)
        dtype = dtypes.most_common(1)[0][0] if dtypes else None
        _SOURCES[inner] = Source(fs, root, dtype)
    return reader


def _nf4_targets(model: nn.Module, quantize: str | None) -> list | None:
    """The weights ``quantize`` turns to NF4, checked (None: no quantisation)."""
    if quantize is None:
        return None
    from ray_fsdp_backend.ops.quantization import (
        check_fsdp_managed,
        check_nf4_shards,
        check_quantize,
        nf4_targets,
    )

    check_quantize(quantize)
    targets = nf4_targets(model)
    check_fsdp_managed(model, targets)
    check_nf4_shards(targets)
    return targets


def check_fits(
    state: dict,
    params: dict[str, int],
    entries: dict[str, Entry],
    *,
    where: str,
    rules: KeyRules | None = None,
) -> list[str]:
    """The model keys to load from the checkpoint.

    Every parameter (``params``: name -> identity, so tied weights share one)
    must be in the checkpoint under one of its names (unless ``rules`` lets
    it be missing), buffers may be absent;
    every checkpoint tensor must be a model key of the same shape.

    Raises:
        PretrainedCheckpointError: naming the first keys of each kind, their
            count and the checkpoint (or the file of a mismatched tensor).
    """
    names: dict[int, list[str]] = {}
    for name, ident in params.items():
        names.setdefault(ident, []).append(name)
    missing = [
        k
        for k in state
        if k in params
        and not any(a in entries for a in names[params[k]])
        and not (rules and rules.missing_ok(k))
    ]
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
