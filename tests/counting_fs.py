"""A ``pyarrow.fs`` filesystem that counts the bytes read through it, for
checking how much a restore downloads from object storage.

``counting(fs)`` wraps any ``pyarrow.fs`` filesystem (e.g. the moto S3 one):
``pyarrow.fs.PyFileSystem`` over an ``FSSpecHandler`` whose input files count
every byte they return. It pickles (to spawned ranks and Ray workers); each
process counts in its own ``BYTES_READ``.
"""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.fs as pafs

from ray_fsdp_backend.filesystem import to_fsspec

BYTES_READ = [0]


class _CountingFile(io.RawIOBase):
    def __init__(self, f):
        self._f = f

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=0):
        return self._f.seek(offset, whence)

    def tell(self):
        return self._f.tell()

    def read(self, n=-1):
        data = self._f.read(n)
        BYTES_READ[0] += len(data)
        return data

    def readinto(self, buf):
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def close(self):
        self._f.close()
        super().close()


class CountingHandler(pafs.FSSpecHandler):
    def open_input_file(self, path):
        return pa.PythonFile(_CountingFile(self.fs.open(path, mode="rb")), mode="r")

    def open_input_stream(self, path):
        return self.open_input_file(path)


def counting(fs: pafs.FileSystem) -> pafs.FileSystem:
    return pafs.PyFileSystem(CountingHandler(to_fsspec(fs)))


def tree_size(fs: pafs.FileSystem, path: str) -> int:
    """Bytes of all files under ``path``."""
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    return sum(i.size for i in infos if i.type == pafs.FileType.File)


class CountingFileSystem:
    """A counting view of ``fs`` (default: the local disk): ``.filesystem`` to
    pass as ``filesystem=``; ``.bytes_read``: bytes this process read through
    any counting filesystem since this one was built."""

    def __init__(self, fs: pafs.FileSystem | None = None):
        self._start = BYTES_READ[0]
        self.filesystem = counting(fs or pafs.LocalFileSystem())

    @property
    def bytes_read(self) -> int:
        return BYTES_READ[0] - self._start
