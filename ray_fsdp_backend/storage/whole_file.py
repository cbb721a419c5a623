"""Files written whole or not at all: :class:`WholeFile`, what
:func:`ray_fsdp_backend.storage.retrying_fs.open_whole` returns, and its local kind,
:class:`LocalWholeFile` (``NAME.tmp``, fsynced and renamed into place,
removed if the block raises). The object-store kind, which puts a small
file whole and streams a large one, lives beside the retrying filesystem
whose handler it writes through (:mod:`ray_fsdp_backend.storage.retrying_fs`).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys


class WholeFile(io.RawIOBase):
    """A file written whole or not at all (see :func:`open_whole`):
    ``commit()`` publishes it, ``abort()`` drops it. ``close()`` aborts when
    an exception raised since the file was opened is being handled (the
    block that wrote it failed), and commits otherwise."""

    def __init__(self):
        super().__init__()
        self._context = sys.exception()  # one already being handled is not the block's

    def writable(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        (self.abort if exc is not None else self.commit)()
        return False

    def close(self):
        if self.closed:
            return
        failing = sys.exception()
        (self.abort if failing is not None and failing is not self._context else self.commit)()

    def commit(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


class LocalWholeFile(WholeFile):
    """A local file written as ``path.tmp``, fsynced and renamed on commit."""

    def __init__(self, path: str):
        super().__init__()
        self._path, self._tmp = path, f"{path}.tmp"
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed by commit or abort

    def write(self, data):
        return self._file.write(data)

    def tell(self):
        return self._file.tell()

    def fileno(self):
        return self._file.fileno()

    def flush(self):
        if not self._file.closed:
            self._file.flush()

    def commit(self) -> None:
        if self.closed:
            return
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self._path)
        finally:
            self.abort()  # after a failed rename: the temporary file goes

    def abort(self) -> None:
        if self.closed:
            return
        self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)
        io.RawIOBase.close(self)
