"""Read Hugging Face safetensors checkpoints through ``pyarrow.fs``, by byte range.

``torch.distributed.checkpoint.HuggingFaceStorageReader`` (torch 2.13) plans
loads well but opens files with ``safetensors.safe_open`` on local paths
only, and lists the directory instead of reading the index. This module keeps
its planning (it subclasses it: same ``Metadata``/``_HFStorageInfo`` layout,
so DCP's planner hands each rank only its slices) and replaces the two parts
that touch storage:

- :func:`read_checkpoint_index`: which files hold which tensors, from
  ``model.safetensors.index.json`` (or the single file), and each file's
  header. The header is read with torch's own
  ``_get_safetensors_file_metadata`` over a ``pyarrow`` input file: 8 bytes
  of length, then a small JSON; no tensor bytes are read for it.
- :meth:`SafetensorsReader.read_data`: for each slice a rank owns, one
  ``read_at`` of the rows it covers (a safetensors tensor is stored
  row-major, so the rows ``[a, b)`` of dim 0 are one contiguous range);
  inner dims are sliced in memory. Works the same on a local disk, S3, GCS
  or any ``pyarrow.fs`` filesystem Ray hands the run.
"""

from __future__ import annotations

import json
import math
import posixpath
from collections.abc import Callable, Mapping

import pyarrow.fs as pafs
import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint._hf_utils import (
    _get_dtype,
    _get_safetensors_file_metadata,
    _HFStorageInfo,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ray_fsdp_backend.hf.entries import Entry, ExpertsEntry, TensorEntry

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

KeyMap = Mapping[str, str] | Callable[[str], str | None]


class PretrainedCheckpointError(ValueError):
    """A pretrained checkpoint is missing, corrupt, or does not fit the model."""


def list_checkpoint_files(fs: pafs.FileSystem, path: str) -> list[str]:
    """The safetensors files of the checkpoint at ``path``: a directory with
    an index (its files), a directory with ``model.safetensors``, or one file.

    Raises:
        PretrainedCheckpointError: nothing there, or no safetensors in it.
    """
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return [path]
    if info.type != pafs.FileType.Directory:
        raise PretrainedCheckpointError(f"pretrained checkpoint {path!r} does not exist")
    index = posixpath.join(path, INDEX_NAME)
    if fs.get_file_info(index).type == pafs.FileType.File:
        with fs.open_input_stream(index) as f:
            weight_map = json.loads(f.read())["weight_map"]
        return [posixpath.join(path, name) for name in sorted(set(weight_map.values()))]
    single = posixpath.join(path, SINGLE_NAME)
    if fs.get_file_info(single).type == pafs.FileType.File:
        return [single]
    raise PretrainedCheckpointError(
        f"{path!r} holds neither {INDEX_NAME} nor {SINGLE_NAME}: not a Hugging Face checkpoint"
    )


def read_file_header(fs: pafs.FileSystem, file: str) -> list[TensorEntry]:
    """The tensors one safetensors file holds, from its header alone.

    Raises:
        PretrainedCheckpointError: the file is missing, truncated or corrupt
            (the message names it).
    """
    try:
        with fs.open_input_file(file) as f:
            size = f.size()
            header, data_start = _get_safetensors_file_metadata(f)
    except FileNotFoundError as exc:
        raise PretrainedCheckpointError(f"{file!r} (listed in the index) is missing") from exc
    except Exception as exc:  # struct, JSON, unicode, arrow I/O: all mean "unreadable"
        raise PretrainedCheckpointError(
            f"{file!r} is not a readable safetensors file: {exc}"
        ) from exc
    entries = []
    for key, value in header.items():
        if key == "__metadata__":
            continue
        begin, end = (data_start + o for o in value["data_offsets"])
        shape = tuple(value["shape"])
        dtype = _get_dtype(value["dtype"])
        if end > size or end - begin != math.prod(shape) * dtype.itemsize:
            raise PretrainedCheckpointError(
                f"{file!r} is truncated or corrupt: tensor {key!r} needs bytes "
                f"{begin}-{end} of a {size}-byte file"
            )
        entries.append(TensorEntry(file, key, dtype, shape, begin, end))
    return entries


def read_checkpoint_index(
    fs: pafs.FileSystem, path: str, key_map: KeyMap | None = None
) -> dict[str, TensorEntry]:
    """Model key -> :class:`TensorEntry` for every tensor of the checkpoint.

    ``key_map`` renames checkpoint keys to model keys (a dict, or a callable
    that returns the new key, or None to skip the tensor)."""
    rename = _resolve_key_map(key_map)
    entries: dict[str, TensorEntry] = {}
    for file in list_checkpoint_files(fs, path):
        for entry in read_file_header(fs, file):
            name = rename(entry.key)
            if name is not None:
                entries[name] = entry
    return entries


def _resolve_key_map(key_map: KeyMap | None) -> Callable[[str], str | None]:
    if key_map is None:
        return lambda key: key
    if callable(key_map):
        return key_map
    return lambda key: key_map.get(key, key)


class SafetensorsReader(HuggingFaceStorageReader):
    """A DCP ``StorageReader`` for the checkpoint described by ``entries``
    (from :func:`read_checkpoint_index`) on ``fs``. Counts the bytes it reads
    in ``bytes_read``."""

    def __init__(self, fs: pafs.FileSystem, entries: Mapping[str, Entry]):
        super().__init__(path=".")
        self.arrow_fs = fs
        self.entries = dict(entries)
        self.bytes_read = 0

    def read_metadata(self) -> Metadata:
        state, storage = {}, {}
        for name, e in self.entries.items():
            offsets = torch.Size([0] * len(e.shape))
            state[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=e.dtype),
                size=torch.Size(e.shape),
                chunks=[ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(e.shape))],
            )
            storage[MetadataIndex(fqn=name, offset=offsets)] = _HFStorageInfo(
                relative_path=e.file, shape=torch.Size(e.shape), dtype=e.dtype
            )
        metadata = Metadata(state_dict_metadata=state, storage_data=storage)
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        files: dict[str, object] = {}  # opened on first use, one handle per file
        try:
            for item in sorted(plan.items, key=lambda i: self.entries[i.storage_index.fqn].file):
                target = planner.resolve_tensor(item).detach()
                target.copy_(self._read_slice(files, item))
                planner.commit_tensor(item, target)
        finally:
            for f in files.values():
                f.close()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_slice(self, files: dict, item: ReadItem) -> torch.Tensor:
        """The slice ``item`` asks for: the dim-0 rows it covers, read as one
        range per tensor (per expert for fused experts), then inner dims."""
        entry = self.entries[item.storage_index.fqn]
        first, count = (item.storage_offsets[0], item.lengths[0]) if entry.shape else (0, 1)
        if isinstance(entry, ExpertsEntry):
            experts = entry.parts[first : first + count]
            rows = torch.stack([torch.cat([self._read_rows(files, e) for e in p]) for p in experts])
        else:
            rows = self._read_rows(files, entry, first, count)
        inner = tuple(
            slice(o, o + n) for o, n in zip(item.storage_offsets[1:], item.lengths[1:], strict=True)
        )
        return rows[(slice(None), *inner)] if inner else rows

    def _read_rows(self, files: dict, e: TensorEntry, first: int = 0, count: int | None = None):
        """Rows ``[first, first + count)`` of ``e`` (all of them by default)."""
        if e.file not in files:
            files[e.file] = self.arrow_fs.open_input_file(e.file)
        if count is None:
            count = e.shape[0] if e.shape else 1
        row_shape = e.shape[1:]
        row_bytes = math.prod(row_shape) * e.dtype.itemsize
        data = files[e.file].read_at(count * row_bytes, e.begin + first * row_bytes)
        self.bytes_read += len(data)
        if not data:
            return torch.empty((count, *row_shape), dtype=e.dtype)
        tensor = torch.frombuffer(bytearray(data), dtype=e.dtype)
        return tensor.reshape((count, *row_shape) if e.shape else ())
