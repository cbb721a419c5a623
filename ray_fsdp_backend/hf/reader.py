"""Read Hugging Face safetensors checkpoints through ``pyarrow.fs``, by byte range.

``torch.distributed.checkpoint.HuggingFaceStorageReader`` (torch 2.13) plans
loads well but opens files with ``safetensors.safe_open`` on local paths
only, and lists the directory instead of reading the index. This module keeps
its planning (it subclasses it: same ``Metadata``/``_HFStorageInfo`` layout,
so DCP's planner hands each rank only its slices) and replaces the two parts
that touch storage:

- :func:`read_checkpoint_index`: which files hold which tensors, from
  ``model.safetensors.index.json`` (or the single file), and each file's
  header (:mod:`.safetensors_io`: a ranged read of its 8-byte length, one
  of the header), the files' headers fetched concurrently. File names
  leaving the checkpoint directory are refused.
- :meth:`SafetensorsReader.read_data`: the byte ranges of every slice a rank
  owns (a safetensors tensor is stored row-major, so the rows ``[a, b)`` of
  dim 0 are one contiguous range; inner dims are sliced in memory), merged
  where they touch, all fetched concurrently (a pool of
  :data:`READ_CONCURRENCY` ``read_at`` calls), so a rank waits for about
  one round trip, not one per slice. Works the same on a local disk, S3,
  GCS or any ``pyarrow.fs`` filesystem Ray hands the run.
"""

from __future__ import annotations

import bisect
import json
import math
import posixpath
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import pyarrow.fs as pafs
import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
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
from ray_fsdp_backend.hf.metadata import is_metadata_file  # noqa: F401 (re-exported)
from ray_fsdp_backend.hf.safetensors_io import (
    UnsupportedDtypeError,
    cast_as_numbers,
    parse_header,
    to_torch_dtype,
)
from ray_fsdp_backend.hf.shapes import INDEX_NAME, SINGLE_NAME  # noqa: F401 (re-exported)
from ray_fsdp_backend.storage.filesystem import compute_spans

READ_CONCURRENCY = 32  # requests in flight per rank (object storage: latency-bound)

KeyMap = Mapping[str, str] | Callable[[str], str | None]


class PretrainedCheckpointError(ValueError):
    """A pretrained checkpoint is missing, corrupt, or does not fit the model."""


def list_checkpoint_files(fs: pafs.FileSystem, path: str) -> list[str]:
    """The safetensors files of the checkpoint at ``path``: a directory with
    an index (its files), a directory with ``model.safetensors``, or one file.

    Raises:
        PretrainedCheckpointError: nothing there, no safetensors in it, or an
            index naming a file outside the directory.
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
        return [
            posixpath.join(path, _inside(name, index)) for name in sorted(set(weight_map.values()))
        ]
    single = posixpath.join(path, SINGLE_NAME)
    if fs.get_file_info(single).type == pafs.FileType.File:
        return [single]
    raise PretrainedCheckpointError(
        f"{path!r} holds neither {INDEX_NAME} nor {SINGLE_NAME}: not a Hugging Face checkpoint"
    )


def _inside(name: str, index: str) -> str:
    """``name`` if it stays inside the checkpoint directory."""
    norm = posixpath.normpath(str(name).replace("\\", "/"))
    if norm.startswith(("/", "../")) or norm in ("..", ".") or ":" in norm:
        raise PretrainedCheckpointError(
            f"{index!r} names file {name!r}, which is outside the checkpoint directory"
        )
    return norm


def read_file_header(fs: pafs.FileSystem, file: str) -> list[TensorEntry]:
    """The tensors one safetensors file holds, from its header alone.

    Raises:
        PretrainedCheckpointError: the file is missing, truncated or corrupt,
            or holds a dtype outside the safetensors table (the message names
            the file, and the key and dtype).
    """
    try:
        with fs.open_input_file(file) as f:
            size = f.size()
            raw = f.read_at(min(size, 8), 0)
            raw += f.read_at(min(size - 8, int.from_bytes(raw, "little")), 8) if size > 8 else b""
        header, data_start = parse_header(raw, file=file)
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
        try:
            dtype = to_torch_dtype(value["dtype"], file=file, key=key)
        except UnsupportedDtypeError as exc:
            raise PretrainedCheckpointError(str(exc)) from None
        begin, end = (data_start + o for o in value["data_offsets"])
        shape = tuple(value["shape"])
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
    """Checkpoint key -> :class:`TensorEntry` for every tensor of the
    checkpoint, the files' headers read concurrently.

    ``key_map`` renames checkpoint keys (a dict, or a callable that returns
    the new key, or None to skip the tensor)."""
    rename = _resolve_key_map(key_map)
    files = list_checkpoint_files(fs, path)
    with ThreadPoolExecutor(max_workers=min(READ_CONCURRENCY, len(files))) as pool:
        headers = list(pool.map(lambda file: read_file_header(fs, file), files))
    entries: dict[str, TensorEntry] = {}
    for header in headers:
        for entry in header:
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


@dataclass(frozen=True)
class _Rows:
    """Rows ``[first, first + count)`` of one checkpoint tensor."""

    entry: TensorEntry
    first: int
    count: int

    @property
    def row_bytes(self) -> int:
        return math.prod(self.entry.shape[1:]) * self.entry.dtype.itemsize

    @property
    def begin(self) -> int:
        return self.entry.begin + self.first * self.row_bytes

    @property
    def end(self) -> int:
        return self.begin + self.count * self.row_bytes

    def tensor(self, data: memoryview) -> torch.Tensor:
        e = self.entry
        if not data:
            return torch.empty((self.count, *e.shape[1:]), dtype=e.dtype)  # host: file bytes
        tensor = torch.frombuffer(bytearray(data), dtype=e.dtype)
        return tensor.reshape((self.count, *e.shape[1:]) if e.shape else ())


def _rows(entry: TensorEntry, first: int = 0, count: int | None = None) -> _Rows:
    if count is None:
        count = entry.shape[0] if entry.shape else 1
    return _Rows(entry, first, count)


class SafetensorsReader(HuggingFaceStorageReader):
    """A DCP ``StorageReader`` for the checkpoint described by ``entries``
    (model key -> entry) on ``fs``. Counts the bytes it reads in
    ``bytes_read``."""

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
        """Fetch the byte ranges of every slice of ``plan`` concurrently
        (merged where they touch); a slice is copied into its target, cast by
        value, as soon as its bytes are in, then its bytes are dropped."""
        needs = [self._rows_of(item) for item in plan.items]
        spans = _Spans([r for rows in needs for r in rows])
        uses = [{spans.index(r) for r in rows} for rows in needs]  # item -> its spans
        waiting: dict[int, list[int]] = {}  # span -> items that need it
        for i, mine in enumerate(uses):
            for s in mine:
                waiting.setdefault(s, []).append(i)
        left = [len(mine) for mine in uses]  # spans an item still waits for
        holders = {s: len(items) for s, items in waiting.items()}  # items not yet committed
        opened: list = []  # every handle, to close
        local = threading.local()  # a pool thread's handles
        try:
            with ThreadPoolExecutor(max(1, min(READ_CONCURRENCY, len(spans.all)))) as pool:
                futures = {
                    pool.submit(self._fetch, local, opened, *span): s
                    for s, span in enumerate(spans.all)
                }
                for future in as_completed(futures):
                    s = futures[future]
                    spans.data[s] = memoryview(future.result())
                    self.bytes_read += len(spans.data[s])
                    for i in waiting[s]:
                        left[i] -= 1
                        if left[i]:
                            continue
                        self._commit(plan.items[i], needs[i], spans, planner)
                        for used in uses[i]:  # drop bytes no other slice needs
                            holders[used] -= 1
                            if not holders[used]:
                                del spans.data[used]
        finally:
            for f in opened:
                f.close()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _fetch(self, local, opened: list, file: str, begin: int, end: int) -> bytes:
        # One handle per file and pool thread: handles of Python filesystems
        # (the retrying wrapper) serialise read_at behind one lock (pyarrow's
        # PythonFile), and opening costs a request (S3: HEAD).
        handles = local.__dict__.setdefault("handles", {})
        if file not in handles:
            handles[file] = self.arrow_fs.open_input_file(file)
            opened.append(handles[file])
        return handles[file].read_at(end - begin, begin)

    def _rows_of(self, item: ReadItem) -> list[_Rows]:
        """The checkpoint rows ``item`` covers (dim 0; per expert for fused
        experts)."""
        entry = self.entries[item.storage_index.fqn]
        first, count = (item.storage_offsets[0], item.lengths[0]) if entry.shape else (0, 1)
        if isinstance(entry, ExpertsEntry):
            return [_rows(e) for part in entry.parts[first : first + count] for e in part]
        return [_rows(entry, first, count)]

    def _commit(self, item: ReadItem, rows: list[_Rows], spans: _Spans, planner) -> None:
        entry = self.entries[item.storage_index.fqn]
        tensors = [r.tensor(spans.bytes_of(r)) for r in rows]
        if isinstance(entry, ExpertsEntry):
            per = len(entry.parts[0])
            value = torch.stack(
                [torch.cat(tensors[j : j + per]) for j in range(0, len(tensors), per)]
            )
        else:
            value = tensors[0]
        inner = tuple(
            slice(o, o + n) for o, n in zip(item.storage_offsets[1:], item.lengths[1:], strict=True)
        )
        value = value[(slice(None), *inner)] if inner else value
        target = planner.resolve_tensor(item).detach()
        key = rows[0].entry.key
        target.copy_(cast_as_numbers(value, target.dtype, file=entry.file, key=key))
        planner.commit_tensor(item, target)


class _Spans:
    """The merged byte ranges ``(file, begin, end)`` of a set of rows, and
    the bytes fetched for each (``data``: span index -> bytes)."""

    def __init__(self, rows: list[_Rows]):
        per_file: dict[str, list[tuple[int, int]]] = {}
        for r in rows:
            per_file.setdefault(r.entry.file, []).append((r.begin, r.end - r.begin))
        self.all = [(f, o, o + n) for f, rs in per_file.items() for o, n in compute_spans(rs)]
        self._starts = {}
        for s, (f, o, _) in enumerate(self.all):
            self._starts.setdefault(f, []).append((o, s))
        self.data: dict[int, memoryview] = {}

    def index(self, r: _Rows) -> int:
        starts = self._starts[r.entry.file]
        return starts[bisect.bisect_right(starts, (r.begin, len(self.all))) - 1][1]

    def bytes_of(self, r: _Rows) -> memoryview:
        s = self.index(r)
        begin = self.all[s][1]
        return self.data[s][r.begin - begin : r.end - begin]
