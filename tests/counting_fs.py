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


class RoundTrips:
    """A filesystem wrapper (duck-typed: the calls the Hugging Face reader
    and writer make) that adds ``latency`` seconds to every request to
    ``fs`` and records each one: ``calls`` (kind, path, offset, length) and
    ``intervals`` (start, end). ``sequential()`` is the longest chain of
    requests each starting after the previous ended: the round trips a rank
    waited for one after another. Pickles (per-process records)."""

    def __init__(self, fs: pafs.FileSystem, latency: float = 0.05):
        self.fs, self.latency = fs, latency
        self.calls: list[tuple] = []
        self.intervals: list[tuple[float, float]] = []
        self.bytes_written = 0

    def __getstate__(self):
        return {"fs": self.fs, "latency": self.latency}

    def __setstate__(self, state):
        self.__init__(state["fs"], state["latency"])

    def reset(self) -> None:
        self.calls, self.intervals = [], []

    def _request(self, kind, path, fn, offset=None, length=None):
        import time

        start = time.perf_counter()
        time.sleep(self.latency)
        try:
            return fn()
        finally:
            self.calls.append((kind, path, offset, length))
            self.intervals.append((start, time.perf_counter()))

    def sequential(self) -> int:
        chain, last_end = 0, float("-inf")
        for start, end in sorted(self.intervals, key=lambda i: i[1]):
            if start >= last_end:
                chain, last_end = chain + 1, end
        return chain

    def get_file_info(self, what):
        return self._request("info", str(what), lambda: self.fs.get_file_info(what))

    def open_input_stream(self, path):
        return self._request("stream", path, lambda: self.fs.open_input_stream(path))

    def open_input_file(self, path):
        return _TimedFile(
            self, path, self._request("open", path, lambda: self.fs.open_input_file(path))
        )

    def open_output_stream(self, path):
        return _CountedOutput(self, self.fs.open_output_stream(path))

    def create_dir(self, path, recursive=True):
        return self.fs.create_dir(path, recursive=recursive)

    def move(self, src, dst):
        return self.fs.move(src, dst)


class _TimedFile:
    def __init__(self, owner: RoundTrips, path: str, f):
        self._owner, self._path, self._f = owner, path, f

    def size(self):
        return self._f.size()

    def read_at(self, nbytes, offset):
        read = lambda: self._f.read_at(nbytes, offset)  # noqa: E731
        return self._owner._request("read", self._path, read, offset, nbytes)

    def close(self):
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _CountedOutput:
    def __init__(self, owner: RoundTrips, out):
        self._owner, self._out = owner, out

    def write(self, data):
        self._owner.bytes_written += memoryview(data).nbytes
        return self._out.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._out.close()
