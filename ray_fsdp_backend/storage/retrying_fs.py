"""A ``pyarrow.fs`` filesystem that retries transient failures of another.

:func:`with_retries` wraps a run's object-store filesystem in a
``pyarrow.fs.PyFileSystem`` whose handler runs every operation through
:func:`ray_fsdp_backend.storage.retry.call_with_retries`, each within the budget
(``FSDPSettings.storage_retry_s``). Everything the backend does on a store
goes through it: DCP's reader and writer (via ``to_fsspec``), markers, the
listing that finds the newest checkpoint, deletions, pretrained loads and
Hugging Face exports. The wrapper pickles with its budget (spawned ranks and
Ray workers get it whole). See :mod:`ray_fsdp_backend.storage.retry` for why this is
our own layer and not the S3 client's retry strategy.

- Metadata operations (info, listing, create, delete, move) are retried as
  they are; a delete or a move (copy + delete on object stores) whose
  earlier attempt went through before its answer was lost (a client-side
  timeout, a dropped connection) finds its source gone, and is done.
- Reads: opening is retried; a failed read closes the underlying file and
  the retry reopens it and reads the same range (``read_at``), so a dropped
  connection in the middle of a ranged read costs that range only.
- Writes are whole or absent, in one of two ways by size. Up to
  :data:`STREAM_ABOVE_BYTES` the bytes stay in memory and are put whole
  when the write is committed, retried whole by our layer: an object store
  makes an object visible only when its upload completes, so it is whole
  or absent. A file that grows past that size is streamed: the bytes
  already written and every later write go straight into the client's own
  multipart upload at the final key, part by part (``pyarrow`` uploads a
  part in the background as it fills), with at most
  :data:`UPLOAD_WINDOW_BYTES` queued (a flush every window). Each part is
  retried on its own by the S3 client: we open the stream on a copy of the
  filesystem whose AWS SDK retry strategy spans about this layer's budget
  (:func:`sdk_retries`; pickling drops a filesystem's ``retry_strategy``,
  apache/arrow#47348, so the one a user set does not reach the workers). A
  part that fails past those retries makes the close fail before
  ``CompleteMultipartUpload``: the object stays absent (the write fails; a
  streamed file cannot be retried whole, its bytes are gone).
- A write whose block raised publishes nothing that stays:
  :func:`open_whole` commits on success and aborts on an exception; a plain
  ``with fs.open_output_stream(...)`` block does the same (its close sees
  the exception raised since the file was opened). An aborted small file
  uploads nothing. An aborted streamed file cannot be cancelled: ``pyarrow``
  26's stream has no ``abort()`` and completes the multipart upload when
  closed or collected, so the abort closes it and deletes the object
  (retried, within the budget). Between that close and that delete (one
  request, milliseconds) the torn object is visible at its key, and it stays
  if the process dies in between or the store refuses the delete for the
  whole budget. Nothing reads it there: a DCP checkpoint directory counts
  only once its marker is written after every file, a Hugging Face export
  only once its index is. Why not a temporary key moved into place:
  ``pyarrow``'s move on S3 is ``CopyObject`` then ``DeleteObject``, and S3
  refuses ``CopyObject`` above 5 GB (a 70B model's rank shard is 10+ GB);
  the copy would also cost a second pass over every byte server-side.
- Memory and local disk per open file: a small file's bytes (at most
  :data:`STREAM_ABOVE_BYTES`); a streamed file at most the window of queued
  parts (:data:`UPLOAD_WINDOW_BYTES`) plus the part being filled, and no
  local disk at all, for writes of any size: a write is handed on in pieces
  of :data:`WRITE_PIECE_BYTES` (one 192 MiB write: +94 MiB peak RSS, +410
  MiB when handed on whole; ``benchmarks/upload_peak.py``). One file is
  open per writer at a time (the Hugging Face exporter writes its files
  one after another, DCP one file per rank per save). The upload happens
  in the thread that writes: DCP's background thread for asynchronous
  saves. Why streaming and not the
  whole-file spool this replaced (memory up to 16 MiB, then a local
  temporary file, uploaded whole): the spool needed as much local disk as
  the rank's largest file and wrote every byte twice, and was not faster:
  ``benchmarks/upload_stream.py``, a 1 GiB shard to the moto server, took
  36 s spooled and 38 s streamed (medians of 3), 210 vs 187 MiB peak RSS,
  1 GiB of local disk vs none.

Local filesystems are returned unwrapped: their errors (a full disk, a
missing directory) are not transient. :func:`open_whole` writes a local file
as ``NAME.tmp``, fsynced and renamed into place, removed if the block raises
(:mod:`ray_fsdp_backend.storage.whole_file`).
"""

from __future__ import annotations

import contextlib
import io
import threading

import pyarrow as pa
import pyarrow.fs as pafs

from ray_fsdp_backend.storage.retry import RetryPolicy, call_with_retries, default_policy
from ray_fsdp_backend.storage.whole_file import LocalWholeFile, WholeFile

STREAM_ABOVE_BYTES = 8 * 1024 * 1024
"""A write to an object store is held in memory and put whole up to this
size, and streamed as a multipart upload once it grows past it."""
UPLOAD_WINDOW_BYTES = 64 * 1024 * 1024
"""At most this many bytes of a streamed upload are queued (parts in flight)."""
WRITE_PIECE_BYTES = 8 * 1024 * 1024
"""A write is handed to the client in pieces of at most this size (a part
of pyarrow's S3 stream is 10 MiB), so the window bounds memory for a write
of any size."""
_SDK_BASE_DELAY_S = 0.025  # the AWS SDK's DefaultRetryStrategy: 25 ms * 2**retry
_STREAMING: dict[tuple, pafs.FileSystem] = {}
_STREAMING_LOCK = threading.Lock()


def with_retries(fs: pafs.FileSystem, policy: RetryPolicy | None = None) -> pafs.FileSystem:
    """``fs`` with transient failures retried (``policy``: the process's
    :func:`~ray_fsdp_backend.storage.retry.default_policy`, i.e. ``storage_retry_s``).
    Local filesystems and already-wrapped ones are returned as they are."""
    if isinstance(fs, pafs.LocalFileSystem) or unwrap(fs) is not fs:
        return fs
    return pafs.PyFileSystem(RetryingHandler(fs, policy or default_policy()))


def open_whole(fs: pafs.FileSystem, path: str) -> WholeFile:
    """A new file at ``path`` on ``fs`` that appears whole or not at all.

    Use it as a context manager (the file is committed when the block
    completes and aborted when it raises) or call ``commit()`` / ``abort()``.
    On a local filesystem the bytes go to ``path.tmp``, fsynced and renamed
    into place on commit, deleted on abort; elsewhere a small file is put
    whole on commit and a large one streamed, deleted on abort (see the
    module's docstring), retried within the budget of ``fs``'s
    :func:`with_retries`."""
    if isinstance(fs, pafs.LocalFileSystem):
        return LocalWholeFile(path)
    return _ObjectOutput(with_retries(fs).handler, path, None)


def sdk_retries(budget_s: float) -> int:
    """How many times the AWS SDK's default strategy may retry one request
    (one part) so that its waits, 25 ms * 2**k before retry k, add up to at
    most ``budget_s`` (at least 3, ``pyarrow``'s default)."""
    retries = 3
    while _SDK_BASE_DELAY_S * (2 ** (retries + 2) - 2) <= budget_s:
        retries += 1
    return retries


def unwrap(fs: pafs.FileSystem) -> pafs.FileSystem:
    """The filesystem under :func:`with_retries` (``fs`` itself when unwrapped),
    for Ray's own calls and for messages naming the store."""
    if isinstance(fs, pafs.PyFileSystem) and isinstance(fs.handler, RetryingHandler):
        return fs.handler.fs
    return fs


class RetryingHandler(pafs.FileSystemHandler):
    """The ``PyFileSystem`` handler of :func:`with_retries`."""

    def __init__(self, fs: pafs.FileSystem, policy: RetryPolicy):
        self.fs, self.policy = fs, policy

    def __eq__(self, other):
        return isinstance(other, RetryingHandler) and self.fs.equals(other.fs)

    def __ne__(self, other):
        return not self == other

    def __reduce__(self):
        return RetryingHandler, (self.fs, self.policy)

    def retry(self, fn, what: str):
        return call_with_retries(fn, what=what, policy=self.policy)

    def _deleting(self, fn, what: str):
        """A delete, where a retry that finds the path gone is done."""
        tried = [False]

        def attempt():
            try:
                return fn()
            except FileNotFoundError:
                if not tried[0]:
                    raise
            finally:
                tried[0] = True

        return self.retry(attempt, what)

    def get_type_name(self) -> str:
        return f"retrying+{self.fs.type_name}"

    def normalize_path(self, path):
        return self.fs.normalize_path(path)

    def get_file_info(self, paths):
        return self.retry(lambda: self.fs.get_file_info(paths), f"getting info of {paths}")

    def get_file_info_selector(self, selector):
        return self.retry(lambda: self.fs.get_file_info(selector), f"listing {selector.base_dir}")

    def create_dir(self, path, recursive):
        self.retry(lambda: self.fs.create_dir(path, recursive=recursive), f"creating {path}")

    def delete_dir(self, path):
        self._deleting(lambda: self.fs.delete_dir(path), f"deleting {path}")

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self._deleting(
            lambda: self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok),
            f"deleting the contents of {path}",
        )

    def delete_root_dir_contents(self):
        self.retry(lambda: self.fs.delete_dir_contents("/", accept_root_dir=True), "emptying /")

    def delete_file(self, path):
        self._deleting(lambda: self.fs.delete_file(path), f"deleting {path}")

    def move(self, src, dest):
        tried = [False]

        def attempt():
            # On object stores a move is copy, delete, and re-creating the
            # parent's directory marker: an earlier attempt that failed on a
            # later step (or lost its answer) may have moved the object.
            if tried[0] and not self._exists(src) and self._exists(dest):
                return
            tried[0] = True
            self.fs.move(src, dest)

        self.retry(attempt, f"moving {src} to {dest}")

    def _exists(self, path) -> bool:
        return self.fs.get_file_info(path).type != pafs.FileType.NotFound

    def copy_file(self, src, dest):
        self.retry(lambda: self.fs.copy_file(src, dest), f"copying {src} to {dest}")

    def open_input_stream(self, path):
        return self.open_input_file(path)

    def open_input_file(self, path):
        file = self.retry(lambda: self.fs.open_input_file(path), f"opening {path}")
        return pa.PythonFile(_RetryingInput(self, path, file), mode="r")

    def open_output_stream(self, path, metadata):
        return pa.PythonFile(_ObjectOutput(self, path, metadata), mode="w")

    @property
    def streaming_fs(self) -> pafs.FileSystem:
        """``fs`` for streamed uploads: on S3 the same settings, rebuilt as
        ``pyarrow``'s pickling does, with the SDK retrying each request for
        about this layer's budget (:func:`sdk_retries`); one per store and
        budget in a process (a run builds a handler per save). Other stores'
        clients retry each request by their own settings."""
        if not isinstance(self.fs, pafs.S3FileSystem):
            return self.fs
        settings = self.fs.__reduce__()[1][0]
        key = (repr(sorted(settings.items())), sdk_retries(self.policy.budget_s))
        with _STREAMING_LOCK:
            if key not in _STREAMING:
                strategy = pafs.AwsDefaultS3RetryStrategy(key[1])
                _STREAMING[key] = pafs.S3FileSystem(**settings, retry_strategy=strategy)
            return _STREAMING[key]

    def open_append_stream(self, path, metadata):
        raise NotImplementedError("appending is not supported on object storage")


class _RetryingInput(io.RawIOBase):
    """A random-access file whose reads reopen the file and retry."""

    def __init__(self, handler: RetryingHandler, path: str, file):
        self._handler, self._path, self._file = handler, path, file
        self._size = file.size()
        self._pos = 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def read(self, n=-1):
        n = self._size - self._pos if n is None or n < 0 else min(n, self._size - self._pos)
        if n <= 0:
            return b""
        pos = self._pos
        data = self._handler.retry(lambda: self._read_at(n, pos), f"reading {self._path}")
        self._pos += len(data)
        return data

    def readall(self):
        return self.read(-1)

    def readinto(self, buf):
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def _read_at(self, n: int, pos: int) -> bytes:
        if self._file is None:
            self._file = self._handler.fs.open_input_file(self._path)
        try:
            return self._file.read_at(n, pos)
        except BaseException:
            self._drop_file()
            raise

    def _drop_file(self) -> None:
        file, self._file = self._file, None
        try:
            file.close()
        except OSError:
            pass  # the connection is what failed

    def close(self):
        if self._file is not None:
            self._drop_file()
        super().close()


class _ObjectOutput(WholeFile):
    """Bytes held in memory and put whole on commit, or, past
    :data:`STREAM_ABOVE_BYTES`, streamed as a multipart upload."""

    def __init__(self, handler: RetryingHandler, path: str, metadata):
        super().__init__()
        self._handler, self._path, self._metadata = handler, path, metadata
        self._buffer: io.BytesIO | None = io.BytesIO()
        self._stream = None
        self._written = self._pending = 0

    def write(self, data):
        # In pieces of at most a part: the client copies what it is given
        # before the window is checked, and a whole tensor in one write
        # would be copied whole (twice, through the small-file buffer).
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, WRITE_PIECE_BYTES):
            piece = view[start : start + WRITE_PIECE_BYTES]
            if self._stream is None:
                self._buffer.write(piece)
                if self._buffer.tell() > STREAM_ABOVE_BYTES:
                    self._start_stream()
            else:
                self._send(piece, piece.nbytes)
        self._written += view.nbytes
        return view.nbytes

    def tell(self):
        return self._written

    def _start_stream(self) -> None:
        fs = self._handler.streaming_fs
        self._stream = self._handler.retry(
            lambda: fs.open_output_stream(self._path, metadata=self._metadata),
            f"opening {self._path}",
        )
        held, self._buffer = self._buffer, None
        self._send(held.getbuffer(), held.tell())

    def _send(self, data, n: int) -> None:
        self._stream.write(data)
        self._pending += n
        if self._pending >= UPLOAD_WINDOW_BYTES:
            # pyarrow's S3 stream uploads parts in the background and queues
            # them without bound when the store is slower than the writer;
            # flush waits for them (and raises a part's failure).
            self._stream.flush()
            self._pending = 0

    def commit(self) -> None:
        if self.closed:
            return
        try:
            if self._stream is None:
                self._handler.retry(self._put, f"writing {self._path}")
            else:  # completes the upload, or fails before it when a part failed
                self._stream.close()
        finally:
            self.abort()

    def abort(self) -> None:
        if self.closed:
            return
        self._buffer = None
        stream, self._stream = self._stream, None
        io.RawIOBase.close(self)
        if stream is not None and not stream.closed:
            # No abort in pyarrow 26: closing publishes what was written
            # (unless a part failed), and the delete takes it away.
            with contextlib.suppress(OSError):
                stream.close()
            with contextlib.suppress(FileNotFoundError):
                self._handler.delete_file(self._path)

    def _put(self) -> None:
        with self._handler.fs.open_output_stream(self._path, metadata=self._metadata) as out:
            out.write(self._buffer.getbuffer())
