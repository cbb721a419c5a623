"""Where a run's checkpoints live: a ``pyarrow.fs`` filesystem and a directory.

Ray Train describes storage this way (``RunConfig(storage_path=...)``: a local
or shared path, or a cloud URI). Every rank reads and writes its own files
straight on that filesystem, with no local copy of the checkpoint:

- on a local (or NFS-mounted) filesystem through DCP's ``FileSystemWriter`` /
  ``FileSystemReader`` (files fsynced);
- on any other (object storage) through DCP's fsspec writer and reader over
  :func:`ray_fsdp_backend.storage.filesystem.to_fsspec` of the run's filesystem, so the
  credentials and endpoint are exactly the ones the user gave Ray. Reads are
  ranged: the reader fetches the byte ranges of the items this rank loads,
  merged into contiguous spans (one request per span, nothing around them),
  so a restore reads about the checkpoint's size over all ranks, not
  world-size times it.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from ray_fsdp_backend.checkpoint.layout import MARKER_NAME, parse_seq
from ray_fsdp_backend.storage.filesystem import compute_spans, to_fsspec
from ray_fsdp_backend.storage.retrying_fs import open_whole, unwrap, with_retries


class TornObjectError(ValueError):
    """A checkpoint file is shorter than what it must hold (written in part:
    a streamed upload closed by a dying process, a copy cut short); the
    message names the file, its size and, where known, the size expected."""


def torn_object(path: str, size: int, expected: int | None, cause: str = "") -> TornObjectError:
    """The error for ``path`` of ``size`` bytes that should hold ``expected``
    (None: unknown; ``cause``: what reading it raised)."""
    if expected is not None:
        what = f"is torn: it holds {size} bytes where its checkpoint needs at least {expected}"
    else:
        what = f"is torn or corrupt: it holds {size} bytes and does not load ({cause})"
    return TornObjectError(
        f"checkpoint file {path} {what}; it was written in part or changed since: "
        "load another checkpoint"
    )


@dataclass(frozen=True)
class CheckpointStore:
    """A directory (``root``) on a filesystem that holds ``checkpoint_*`` dirs."""

    fs: pafs.FileSystem
    root: str

    @classmethod
    def retrying(cls, fs: pafs.FileSystem, root: str) -> CheckpointStore:
        """A store on ``fs`` whose transient failures are retried within this
        process's ``storage_retry_s`` (see :mod:`ray_fsdp_backend.storage.retrying_fs`)."""
        return cls(with_retries(fs), root)

    @classmethod
    def local(cls, path: str | os.PathLike) -> CheckpointStore:
        """A store in a local (or shared, mounted) directory."""
        return cls(pafs.LocalFileSystem(), Path(path).resolve().as_posix())

    @property
    def in_place(self) -> bool:
        """Whether ranks can write and read checkpoint files at their paths."""
        return isinstance(self.fs, pafs.LocalFileSystem)

    def describe(self) -> str:
        """The store for messages: filesystem kind and path (never credentials)."""
        return f"{unwrap(self.fs).type_name}://{self.root.lstrip('/')}"

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def list_checkpoints(self) -> list[str]:
        """Names of the checkpoint directories in the store, complete or not."""
        selector = pafs.FileSelector(self.root, allow_not_found=True)
        infos = self.fs.get_file_info(selector)
        return sorted(
            Path(i.path).name
            for i in infos
            if i.type == pafs.FileType.Directory and parse_seq(Path(i.path).name) is not None
        )

    def read_marker(self, name: str) -> str | None:
        """The text of a checkpoint's ``COMPLETE`` marker; None when it has none.

        Any other failure (the store unreachable) raises: taking a complete
        checkpoint for a partial one would get it deleted."""
        try:
            return self.read_file(f"{name}/{MARKER_NAME}").decode()
        except FileNotFoundError:
            return None

    def read_markers(self) -> dict[str, str | None]:
        """Every checkpoint directory's marker text (None: no marker)."""
        return {name: self.read_marker(name) for name in self.list_checkpoints()}

    def read_text(self, relative: str) -> str | None:
        """A small file under ``root`` as text; None when it does not exist."""
        try:
            return self.read_file(relative).decode()
        except FileNotFoundError:
            return None

    def write_marker(self, name: str, text: str) -> None:
        """Write the marker so that it appears whole or not at all (a
        temporary file moved into place; on object stores a single put)."""
        self.write_file(f"{name}/{MARKER_NAME}", text.encode())

    def write_file(self, relative: str, data: bytes) -> None:
        """Write ``data`` at ``root/relative``, durably and whole: locally a
        fsynced temporary file renamed into place, on object storage one put
        (:func:`~ray_fsdp_backend.storage.retrying_fs.open_whole`)."""
        final = f"{self.root}/{relative}"
        if self.in_place:
            os.makedirs(os.path.dirname(final), exist_ok=True)
        else:
            self.fs.create_dir(final.rsplit("/", 1)[0])  # hierarchical filesystems need it
        with open_whole(self.fs, final) as f:
            f.write(data)

    def read_file(self, relative: str) -> bytes:
        """The bytes at ``root/relative`` (FileNotFoundError when absent)."""
        with self.fs.open_input_stream(f"{self.root}/{relative}") as f:
            return f.read()

    def exists(self, relative: str) -> bool:
        info = self.fs.get_file_info(f"{self.root}/{relative}")
        return info.type != pafs.FileType.NotFound

    def delete(self, name: str) -> None:
        """Delete checkpoint ``name``; one already gone is no error (Ray may
        be deleting a checkpoint it drops while rank 0 lists the store, and
        then sees it without its marker, as if partial)."""
        try:
            self.fs.delete_dir(self.path(name))
        except FileNotFoundError:
            pass


def dcp_writer(store: CheckpointStore, name: str):
    """A DCP storage writer that puts this rank's files straight into
    checkpoint ``name`` of ``store``, each file whole or absent
    (:func:`~ray_fsdp_backend.storage.retrying_fs.open_whole`): a write that raises
    leaves neither a partial object nor a temporary file."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    if store.in_place:
        os.makedirs(store.path(name), exist_ok=True)
        writer = FileSystemWriter(store.path(name))
        writer.fs = _whole_writes(type(writer.fs), pafs.LocalFileSystem())()
        return writer
    # fsync does not exist on object storage; a closed upload is durable.
    writer = FsspecWriter(store.path(name), sync_files=False)
    writer.fs = _fsspec_view(store)
    return writer


def _whole_writes(base: type, fs: pafs.FileSystem) -> type:
    """DCP's filesystem adapter ``base`` whose streams opened for writing
    are :func:`~ray_fsdp_backend.storage.retrying_fs.open_whole` files of ``fs``
    (DCP's own open a file in place, or upload what was written when the
    block raised)."""

    class WholeWrites(base):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with open_whole(fs, os.fspath(path)) as stream:
                yield stream

    return WholeWrites


def dcp_reader(store: CheckpointStore, name: str):
    """A DCP storage reader of checkpoint ``name`` that reads only the byte
    ranges this rank loads (and the small ``.metadata``)."""
    from torch.distributed.checkpoint import FileSystemReader

    if store.in_place:
        return FileSystemReader(store.path(name))
    reader = _ranged_reader_class()(store.path(name))
    reader.fs = _fsspec_view(store)
    return reader


def _fsspec_view(store: CheckpointStore):
    """DCP's fsspec ``FileSystem`` adapter bound to the store's filesystem
    (instead of one built from a URL, which would need s3fs and its own
    credentials)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    view = _whole_writes(FileSystem, store.fs)()
    view.fs = to_fsspec(store.fs)
    return view


def _ranged_reader_class():
    """``FsspecReader`` that fetches this rank's items in few exact ranged reads.

    DCP's reader opens each file and hands ``torch.load`` a view over it:
    every small read in that view would be a request, and fsspec caches may
    read ahead into other ranks' bytes. Before DCP's ``read_data`` runs, this
    one reads, per file (files in parallel), the plan's items merged into
    contiguous spans: one ranged GET per span, exactly the bytes needed. The
    items are then served from those buffers. The ``.metadata`` file is read
    in one request and kept (DCP's ``pickle.load`` on the remote stream would
    issue a request per small read, and the load reads it twice)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class RangedReader(FsspecReader):
        _metadata = None

        def read_metadata(self, *args, **kwargs):
            if self._metadata is None:
                path = self._get_metadata_path(kwargs.get("rank"))
                with self.fs.create_stream(path, "rb") as f:
                    data = f.read()
                try:
                    metadata = pickle.loads(data)  # as DCP's reader, from one request
                except (EOFError, pickle.UnpicklingError) as exc:
                    raise torn_object(path, len(data), None, str(exc)) from exc
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                self._metadata = metadata
            return self._metadata

        def read_data(self, plan, planner):
            infos = [self.storage_data[item.storage_index] for item in plan.items]
            self._spans = _fetch_spans(self.fs, self.path, infos)
            try:
                return super().read_data(plan, planner)
            finally:
                self._spans = {}

        def _slice_file(self, file, sinfo):
            for start, data in getattr(self, "_spans", {}).get(sinfo.relative_path, ()):
                offset = sinfo.offset - start
                if 0 <= offset and offset + sinfo.length <= len(data):
                    return io.BytesIO(data[offset : offset + sinfo.length])
            file.seek(sinfo.offset)
            return io.BytesIO(file.read(sinfo.length))

    return RangedReader


def _fetch_spans(fs, root, infos) -> dict[str, list[tuple[int, bytes]]]:
    """Per relative file path, ``(start, bytes)`` of each merged span."""
    from concurrent.futures import ThreadPoolExecutor

    per_file: dict[str, list[tuple[int, int]]] = {}
    for info in infos:
        per_file.setdefault(info.relative_path, []).append((info.offset, info.length))

    def fetch(relative: str) -> list[tuple[int, bytes]]:
        out = []
        with fs.create_stream(fs.concat_path(root, relative), "rb") as stream:
            for start, length in compute_spans(per_file[relative]):
                stream.seek(start)
                data = stream.read(length)
                if len(data) != length:  # the object ends before the span does
                    stream.seek(0, io.SEEK_END)
                    path = fs.concat_path(root, relative)
                    raise torn_object(path, stream.tell(), start + length)
                out.append((start, data))
        return out

    with ThreadPoolExecutor(max_workers=min(8, max(1, len(per_file)))) as pool:
        return dict(zip(per_file, pool.map(fetch, per_file), strict=True))
