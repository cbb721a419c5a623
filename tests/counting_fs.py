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

from ray_fsdp_backend.storage.filesystem import to_fsspec

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


class RoundTrips(pafs.FileSystemHandler):
    """A ``pyarrow.fs`` handler over ``fs`` that adds ``latency`` seconds to
    every request and records each one: ``calls`` (kind, path, offset,
    length) and ``intervals`` (start, end); ``bytes_written`` counts the
    bytes written through it. ``filesystem`` is the ``PyFileSystem`` to pass.
    ``sequential()`` is the longest chain of requests each starting after the
    previous ended: the round trips waited for one after another. Pickles
    (records stay per process)."""

    def __init__(self, fs: pafs.FileSystem, latency: float = 0.05):
        self.fs, self.latency = fs, latency
        self.calls: list[tuple] = []
        self.intervals: list[tuple[float, float]] = []
        self.bytes_written = 0
        self.filesystem = pafs.PyFileSystem(self)

    def __reduce__(self):
        return RoundTrips, (self.fs, self.latency)

    def __eq__(self, other):
        return other is self

    def __ne__(self, other):
        return other is not self

    def sequential(self) -> int:
        chain, last_end = 0, float("-inf")
        for start, end in sorted(self.intervals, key=lambda i: i[1]):
            if start >= last_end:
                chain, last_end = chain + 1, end
        return chain

    def request(self, kind, path, fn, offset=None, length=None):
        import time

        start = time.perf_counter()
        time.sleep(self.latency)
        try:
            return fn()
        finally:
            self.calls.append((kind, path, offset, length))
            self.intervals.append((start, time.perf_counter()))

    def get_type_name(self):
        return f"roundtrips+{self.fs.type_name}"

    def normalize_path(self, path):
        return self.fs.normalize_path(path)

    def get_file_info(self, paths):
        return self.request("info", str(paths), lambda: self.fs.get_file_info(paths))

    def get_file_info_selector(self, selector):
        return self.request("list", selector.base_dir, lambda: self.fs.get_file_info(selector))

    def create_dir(self, path, recursive):
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise NotImplementedError

    def delete_file(self, path):
        self.fs.delete_file(path)

    def move(self, src, dest):
        self.fs.move(src, dest)

    def copy_file(self, src, dest):
        self.fs.copy_file(src, dest)

    def open_input_stream(self, path):
        return self.open_input_file(path)

    def open_input_file(self, path):
        native = self.request("open", path, lambda: self.fs.open_input_file(path))
        return pa.PythonFile(_TimedFile(self, path, native), mode="r")

    def open_output_stream(self, path, metadata):
        return pa.PythonFile(_CountedOutput(self, self.fs.open_output_stream(path)), mode="w")

    def open_append_stream(self, path, metadata):
        raise NotImplementedError


class _TimedFile(io.RawIOBase):
    def __init__(self, owner: RoundTrips, path: str, native):
        self._owner, self._path, self._f = owner, path, native
        self._pos = 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=0):
        base = {0: 0, 1: self._pos, 2: self._f.size()}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self):
        return self._pos

    def read(self, n=-1):
        n = self._f.size() - self._pos if n is None or n < 0 else n
        pos = self._pos
        data = self._owner.request("read", self._path, lambda: self._f.read_at(n, pos), pos, n)
        self._pos += len(data)
        return data

    def readall(self):
        return self.read(-1)

    def readinto(self, buf):
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def close(self):
        self._f.close()
        super().close()


class _CountedOutput(io.RawIOBase):
    def __init__(self, owner: RoundTrips, out):
        self._owner, self._out = owner, out

    def writable(self):
        return True

    def write(self, data):
        n = memoryview(data).nbytes
        self._owner.bytes_written += n
        self._out.write(data)
        return n

    def close(self):
        if not self.closed:
            self._out.close()
        super().close()
