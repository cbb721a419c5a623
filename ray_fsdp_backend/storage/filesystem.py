"""Where files live: a local path, a URI, or a path on a ``pyarrow.fs`` filesystem.

Ray Train describes storage as a ``pyarrow.fs.FileSystem`` plus a path
(``RunConfig(storage_path=..., storage_filesystem=...)``), so that is the one
currency here: a URI (``s3://bucket/x``, ``gs://...``, ``file:///...``)
resolves through ``pyarrow.fs.FileSystem.from_uri``, which reads credentials
and endpoints from the environment as Ray does; a filesystem object the user
built is used as given. :func:`to_fsspec` wraps it for the readers and writers
of ``torch.distributed.checkpoint`` that speak fsspec, so no second set of
credentials (s3fs, gcsfs) is ever needed. Object-store filesystems come back
wrapped by :func:`ray_fsdp_backend.storage.retrying_fs.with_retries`: transient
failures (throttling, dropped connections) are retried within
``storage_retry_s``.
"""

from __future__ import annotations

import os

import pyarrow.fs as pafs

from ray_fsdp_backend.storage.retrying_fs import with_retries


def resolve_filesystem(
    path: str | os.PathLike, filesystem: pafs.FileSystem | None = None
) -> tuple[pafs.FileSystem, str]:
    """``(filesystem, path on it)`` for ``path``.

    With ``filesystem`` given, ``path`` is a path on it (a URI's scheme is
    dropped, as ``pyarrow`` paths have none). Without it, a URI picks its
    filesystem and a plain path is a local one, made absolute.

    Raises:
        ValueError: a URI whose scheme ``pyarrow`` does not know.
    """
    text = os.fspath(path)
    if filesystem is not None:
        return with_retries(filesystem), text.split("://", 1)[-1]
    if "://" not in text:
        return pafs.LocalFileSystem(), os.path.abspath(text)
    try:
        fs, fs_path = pafs.FileSystem.from_uri(text)
    except (ValueError, OSError) as exc:  # pyarrow's message names the URI, never a secret
        raise ValueError(f"cannot open {text!r}: {exc}") from exc
    return with_retries(fs), fs_path


def is_local(filesystem: pafs.FileSystem) -> bool:
    """Whether paths on ``filesystem`` are paths of this machine."""
    return isinstance(filesystem, pafs.LocalFileSystem)


def to_fsspec(filesystem: pafs.FileSystem):
    """``filesystem`` as an fsspec filesystem (``ArrowFSWrapper``), for DCP's
    ``FsspecReader``/``FsspecWriter`` and anything else that speaks fsspec."""
    from fsspec.implementations.arrow import ArrowFSWrapper

    return ArrowFSWrapper(filesystem)


def compute_spans(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, length)`` ranges merged where they touch or overlap, sorted."""
    spans: list[list[int]] = []
    for offset, length in sorted(ranges):
        if spans and offset <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], offset + length)
        else:
            spans.append([offset, offset + length])
    return [(start, end - start) for start, end in spans]
