"""Where a run's checkpoints live: a ``pyarrow.fs`` filesystem and a directory.

Ray Train describes storage this way (``RunConfig(storage_path=...)``: a local
or shared path, or a cloud URI). On a local (or NFS-mounted) filesystem ranks
write and read their shards in place; on any other filesystem they stage them
in a local temporary directory and copy it, as Ray's own upload does.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from ray_fsdp_backend.checkpoint.layout import MARKER_NAME, parse_seq


@dataclass(frozen=True)
class CheckpointStore:
    """A directory (``root``) on a filesystem that holds ``checkpoint_*`` dirs."""

    fs: pafs.FileSystem
    root: str

    @classmethod
    def local(cls, path: str | os.PathLike) -> CheckpointStore:
        """A store in a local (or shared, mounted) directory."""
        return cls(pafs.LocalFileSystem(), Path(path).resolve().as_posix())

    @property
    def in_place(self) -> bool:
        """Whether ranks can write and read checkpoint files at their paths."""
        return isinstance(self.fs, pafs.LocalFileSystem)

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
        """The text of a checkpoint's ``COMPLETE`` marker; None when it has none."""
        try:
            with self.fs.open_input_stream(f"{self.path(name)}/{MARKER_NAME}") as f:
                return f.read().decode()
        except (FileNotFoundError, OSError):
            return None

    def read_markers(self) -> dict[str, str | None]:
        """Every checkpoint directory's marker text (None: no marker)."""
        return {name: self.read_marker(name) for name in self.list_checkpoints()}

    def write_marker(self, name: str, text: str) -> None:
        """Write the marker so that it appears whole or not at all (a
        temporary file moved into place; on object stores a single put)."""
        final = f"{self.path(name)}/{MARKER_NAME}"
        if not self.in_place:
            with self.fs.open_output_stream(final) as f:
                f.write(text.encode())
            return
        tmp = f"{final}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)

    def delete(self, name: str) -> None:
        self.fs.delete_dir(self.path(name))


@contextlib.contextmanager
def writable_dir(store: CheckpointStore, name: str) -> Iterator[str]:
    """A local directory for this rank's files of checkpoint ``name``: the
    checkpoint directory itself when the store is local, else a staging
    directory copied into the store when the block ends without error."""
    if store.in_place:
        os.makedirs(store.path(name), exist_ok=True)
        yield store.path(name)
        return
    staging = tempfile.mkdtemp(prefix=f"rfb_{name}_")
    try:
        yield staging
        store.fs.create_dir(store.path(name))
        pafs.copy_files(
            staging,
            store.path(name),
            source_filesystem=pafs.LocalFileSystem(),
            destination_filesystem=store.fs,
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def readable_dir(store: CheckpointStore, name: str) -> Iterator[str]:
    """A local directory holding checkpoint ``name``: in place when the store
    is local, else a temporary download of it (every shard: resharding may
    need any of them)."""
    if store.in_place:
        yield store.path(name)
        return
    local = tempfile.mkdtemp(prefix=f"rfb_{name}_")
    try:
        pafs.copy_files(
            store.path(name),
            local,
            source_filesystem=store.fs,
            destination_filesystem=pafs.LocalFileSystem(),
        )
        yield local
    finally:
        shutil.rmtree(local, ignore_errors=True)
