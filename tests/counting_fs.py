"""A local ``pyarrow.fs`` filesystem that counts the bytes read through it."""

from __future__ import annotations

import io

import fsspec
import pyarrow as pa
import pyarrow.fs as pafs
from pyarrow.fs import FSSpecHandler


class _CountingFile(io.RawIOBase):
    def __init__(self, raw, counter):
        self.raw, self.counter = raw, counter

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=0):
        return self.raw.seek(offset, whence)

    def tell(self):
        return self.raw.tell()

    def read(self, size=-1):
        data = self.raw.read(size)
        self.counter.bytes_read += len(data)
        return data

    def close(self):
        self.raw.close()
        super().close()


class _CountingHandler(FSSpecHandler):
    def __init__(self, counter):
        super().__init__(fsspec.filesystem("file"))
        self.counter = counter

    def open_input_file(self, path):
        return pa.PythonFile(_CountingFile(self.fs.open(path, "rb"), self.counter), mode="r")

    def open_input_stream(self, path):
        return self.open_input_file(path)


class CountingFileSystem:
    """``.filesystem``: a ``pyarrow.fs.PyFileSystem`` over the local disk;
    ``.bytes_read``: every byte read through it."""

    def __init__(self):
        self.bytes_read = 0
        self.filesystem = pafs.PyFileSystem(_CountingHandler(self))
