"""Export a model's full weights: Hugging Face layout or one safetensors file.

``export_model`` resolves where to write (a local path, a URI, or a path on a
``pyarrow.fs`` filesystem, as ``load_pretrained`` reads) and the dtype, then
runs the exporter of the format from :data:`EXPORTERS` (format name ->
function ``(model, fs, root, *, max_shard_size, dtype) -> None``, collective).
The files are written by :mod:`.writer`: every rank streams its planned files
straight into the store.
"""

from __future__ import annotations

import copy
import json
import os
import posixpath
import tempfile
import uuid
from collections.abc import Callable

import pyarrow.fs as pafs
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import FSDPModule

from ray_fsdp_backend.compat.peft import is_peft_model, peft_base, unwrap
from ray_fsdp_backend.distributed.collectives import agreed, broadcast_from_rank0
from ray_fsdp_backend.hf.experts import split_experts
from ray_fsdp_backend.hf.holders import gather_holders, plan_group_files
from ray_fsdp_backend.hf.keys import export_keys
from ray_fsdp_backend.hf.load import loaded_from
from ray_fsdp_backend.hf.peft_export import export_peft, merge_adapters
from ray_fsdp_backend.hf.reader import INDEX_NAME, is_metadata_file
from ray_fsdp_backend.hf.target import (
    check_shared,
    check_target,
    remove_stale,
    target_entries,
    verify_files,
)
from ray_fsdp_backend.hf.writer import (
    FilePlan,
    barrier,
    export_dtype,
    file_header,
    tag_names,
    write_bytes,
    write_files,
)
from ray_fsdp_backend.ops.quantization import dequantize_state
from ray_fsdp_backend.settings.checks import parse_size
from ray_fsdp_backend.storage.filesystem import resolve_filesystem

Exporter = Callable[..., None]
# Written by the export itself, never copied from the source checkpoint.
_OURS = {INDEX_NAME, "config.json", "generation_config.json"}


def export_model(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    filesystem: pafs.FileSystem | None = None,
    format: str = "hf",
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> str:
    """Write the full weights of ``model`` (FSDP2, HSDP, DDP or plain) to ``path``.

    ``path`` is a local path, a URI (``s3://``, ``gs://``) or a path on
    ``filesystem`` (a ``pyarrow.fs.FileSystem``, as Ray's
    ``RunConfig(storage_filesystem=)``). ``format="hf"``: directory ``path``
    in Hugging Face layout, sharded safetensors of at most ``max_shard_size``,
    their index and, for a ``transformers`` model, ``config.json``,
    ``generation_config.json`` and the tokenizer and chat-template files of
    the checkpoint ``load_pretrained`` read: ``from_pretrained(path)`` and
    ``AutoTokenizer.from_pretrained(path)`` load it. Each rank writes its
    files straight into the store; the index and configs come last, so a
    reader never sees an index naming missing files. A PEFT model is written
    with its adapters merged into the base weights (:mod:`.peft_export`).
    ``format="peft"``: a PEFT model's adapters as
    ``PeftModel.from_pretrained`` reads them. ``dtype`` (floating-point
    tensors only) defaults to the dtype of the weights ``load_pretrained``
    read, else the parameters' dtype; under ``format="peft"`` to each
    adapter's own (trained) dtype, as peft's ``save_pretrained``.
    ``format="safetensors"`` (also chosen
    by a ``path`` ending in ``.safetensors``): one file written by rank 0,
    every state key under its own name (tied weights repeated); refused for
    a pipeline stage, whose rank 0 holds the first stage only.
    Collective: every rank calls it; returns ``path`` once complete.

    Whole or refused (:mod:`.target`): a non-empty target is refused unless
    ``overwrite=True``. An overwrite keeps the previous export loadable
    until the new one is whole: the new shards get names no old file has
    (an id of this export in them), the index is written last (the commit
    point: it replaces the old index in one put or rename), and only then
    are the old weight files (``*.safetensors``, ``*.bin``, ``*.index.json``)
    the new index does not name deleted. In HF layout a target that not
    every rank sees is refused before any weight is written, and every file
    is checked (one listing, sizes) before the index is written. Each file
    is whole or absent. Every step is agreed by all ranks
    (:func:`~ray_fsdp_backend.distributed.collectives.agreed`): a failure on one rank,
    a write or not (an out-of-memory in a gather), raises on every rank at
    the end of that step, naming the rank and its error, and no rank
    returns before every rank's part succeeded.

    Raises:
        ValueError: an unknown ``format``, a bad ``max_shard_size``, a URI
            whose scheme ``pyarrow`` does not know, or ``format="safetensors"``
            of a pipeline stage (before anything is written).
        ExportTargetError: the target is not empty (without ``overwrite``),
            not shared by every rank, or a written file is missing or short
            (named, with the rank that wrote it).
        RankFailedError: a step failed on some rank (named, with its error).
    """
    text = os.fspath(path)
    if format not in EXPORTERS:
        raise ValueError(f"export_model format={format!r} is not one of {', '.join(EXPORTERS)}")
    if format == "hf" and text.endswith(".safetensors"):
        format = "safetensors"
    if format == "safetensors" and getattr(model, "pipeline_plan", None) is not None:
        # One file from rank 0 would hold only the first stage's layers.
        raise ValueError(
            f"export_model format='safetensors' ({text!r}) writes one file from rank 0, which "
            "holds only its pipeline stage's layers under pipeline_parallel_size > 1: use "
            "format='hf' (each stage's ranks write its files, one index names them all)"
        )
    parse_size(max_shard_size)
    fs, root = resolve_filesystem(text, filesystem)
    dtype = default_export_dtype(model, format, dtype)
    check_target(fs, root, overwrite, text)
    EXPORTERS[format](model, fs, root, max_shard_size=max_shard_size, dtype=dtype, uri=text)
    return text


def default_export_dtype(model: nn.Module, format: str, dtype: torch.dtype | None):
    """``dtype`` when given; else, for ``format="peft"``, None: each adapter
    keeps the dtype it trained in, as peft's ``save_pretrained`` writes it
    (fp32 adapters over a bf16 base stay fp32); else the dtype of the weights
    ``load_pretrained`` read, else the parameters' dtype."""
    if dtype is not None or format == "peft":
        return dtype
    source = loaded_from(model)
    return source.dtype if source and source.dtype else next(model.parameters()).dtype


def export_hf(
    model: nn.Module,
    fs: pafs.FileSystem,
    root: str,
    *,
    max_shard_size,
    dtype: torch.dtype,
    uri: str | None = None,
) -> None:
    """Hugging Face layout in directory ``root`` of ``fs`` (see
    :func:`export_model`; ``uri`` names it in messages)."""
    uri = uri or root
    inner = unwrap(model)
    with agreed(f"preparing the export to {uri!r}"):
        # Pipeline stages hold different keys: each group of ranks writes its own.
        state, groups = gather_holders(export_state(model, inner))
        files = plan_group_files(_sizes(state, dtype), groups, parse_size(max_shard_size))
    files = _fresh_names(fs, root, files)
    with agreed(f"creating {uri!r}"):
        fs.create_dir(root, recursive=True)  # on object storage: a no-op or a marker
    check_shared(fs, root, uri)
    write_files(fs, root, state, files, dtype)
    verify_files(fs, root, _expected(state, files, dtype), uri)

    def publish() -> None:  # the index last: the commit point
        _copy_tokenizer_files(model, fs, root)
        _save_hf_config(inner, fs, root, dtype)
        write_bytes(fs, posixpath.join(root, INDEX_NAME), _index(state, files, dtype))

    broadcast_from_rank0(publish)
    remove_stale(fs, root, {f.name for f in files} | {INDEX_NAME})


def export_state(model: nn.Module, inner: nn.Module) -> dict[str, torch.Tensor]:
    """The state ``export_hf`` writes (and :func:`~ray_fsdp_backend.hf.stream.stream_weights`
    streams), under the names ``save_pretrained`` uses; sharded tensors stay sharded."""
    state = dequantize_state(get_model_state_dict(model))  # a QLoRA base: NF4 -> dense
    state = {k: state[k] for k in export_keys(inner, state)}
    if is_peft_model(inner):  # adapters merged into the base, under the base's names
        state = merge_adapters(inner, state)
    state = split_experts(state, inner)  # per-expert keys, as save_pretrained writes them
    return state


def _fresh_names(fs: pafs.FileSystem, root: str, files: list[FilePlan]) -> list[FilePlan]:
    """``files`` under names that no file in ``root`` has: the plan's own
    names, or, when one is taken (an overwrite), each with an id of this
    export, so that no new shard replaces a file the old index names."""

    def pick() -> str:
        taken = set(target_entries(fs, root))
        return "" if taken.isdisjoint(f.name for f in files) else uuid.uuid4().hex[:8]

    return tag_names(files, broadcast_from_rank0(pick))


def export_safetensors(
    model: nn.Module,
    fs: pafs.FileSystem,
    root: str,
    *,
    max_shard_size,
    dtype: torch.dtype,
    uri: str | None = None,
) -> None:
    """One safetensors file at ``root``, every state key (tied weights under
    each name), so ``model.load_state_dict(safetensors.torch.load_file(path))``
    works on the unwrapped model without this package and without unpickling."""
    state = get_model_state_dict(model)
    with agreed(f"creating the directory of {uri or root!r}"):
        if posixpath.dirname(root):
            fs.create_dir(posixpath.dirname(root), recursive=True)
    write_files(fs, "", state, [FilePlan(root, tuple(state), owner=0)], dtype)
    barrier()


EXPORTERS: dict[str, Exporter] = {
    "hf": export_hf,
    "safetensors": export_safetensors,
    "peft": export_peft,
}


def _sizes(state: dict, dtype: torch.dtype) -> dict[str, int]:
    """Key -> bytes as exported."""
    return {k: v.numel() * export_dtype(v, dtype).itemsize for k, v in state.items()}


def _expected(state: dict, files: list[FilePlan], dtype: torch.dtype) -> dict[str, tuple[int, int]]:
    """File name -> (bytes, writing rank) of the plan."""
    sizes = _sizes(state, dtype)
    return {
        f.name: (len(file_header(state, f, dtype)) + sum(sizes[k] for k in f.keys), f.owner)
        for f in files
    }


def _index(state: dict, files: list[FilePlan], dtype: torch.dtype) -> bytes:
    sizes = _sizes(state, dtype)
    weight_map = {k: f.name for f in files for k in f.keys}
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    return json.dumps(index, indent=2, sort_keys=True).encode()


def _copy_tokenizer_files(model: nn.Module, fs: pafs.FileSystem, root: str) -> None:
    """The tokenizer and chat-template files beside the weights
    ``load_pretrained`` read (top-level small files, never weights or configs)."""
    source = loaded_from(model)
    if source is None:
        return
    src_fs, src_root = source.filesystem, source.path
    if src_fs.get_file_info(src_root).type != pafs.FileType.Directory:
        return
    for info in src_fs.get_file_info(pafs.FileSelector(src_root)):
        name = posixpath.basename(info.path)
        if info.type == pafs.FileType.File and is_metadata_file(name) and name not in _OURS:
            with src_fs.open_input_stream(info.path) as src:
                write_bytes(fs, posixpath.join(root, name), src.read())


def _save_hf_config(model: nn.Module, fs: pafs.FileSystem, root: str, dtype: torch.dtype) -> None:
    """``config.json`` (with the exported dtype, and the model's class as its
    ``architectures``, as ``save_pretrained`` writes it: a reward model
    built from a causal LM's config exports as ``...ForSequenceClassification``)
    and ``generation_config.json`` of a ``transformers`` model; nothing for
    other modules."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "save_pretrained", None)):
        return
    config = copy.deepcopy(config)
    config.dtype = dtype
    # The model's own class (FSDP2 makes every sharded module an ``FSDP<class>``).
    own = next(c for c in type(peft_base(model)).__mro__ if not issubclass(c, FSDPModule))
    config.architectures = [own.__name__]
    with tempfile.TemporaryDirectory(prefix="rfb-export-") as local:
        config.save_pretrained(local)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(local)
        for name in sorted(os.listdir(local)):
            with open(os.path.join(local, name), "rb") as f:
                write_bytes(fs, posixpath.join(root, name), f.read())
