"""Where SFT records come from, and each record's text and place (no tokenizer here).

A source is a JSON-lines or parquet file, or a directory of them (read
recursively; names starting with ``.`` or ``_``, such as ``_SUCCESS``, are
skipped), on the local disk, behind a URI (``s3://``, ``gs://``) or on a
``pyarrow.fs`` filesystem the caller passes. One directory holds one kind:
``.jsonl`` / ``.json`` (JSON lines, one record a line) or ``.parquet``.

Every record is read as a :class:`RawRecord`: where it is (``FILE:LINE``, the
line counted from 1; ``FILE#ROW``, the row counted from 0) and its JSON text:
the line exactly as in the file, or the parquet row (its ``None`` values in
mappings removed: :func:`~ray_fsdp_backend.sft.conversation.remove_none`) as
JSON. The driver's check streams a file through :func:`file_records`; a Ray
Data worker runs the same function on the file's bytes, so both see the same
records, places and texts (Arrow's JSON reader is not used: it merges the
keys of nested objects across records and fills the gaps with ``null``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import pyarrow.fs as pafs

from ray_fsdp_backend.sft.conversation import record_fields, remove_none
from ray_fsdp_backend.sft.options import Format, SFTDataError, SFTOptions
from ray_fsdp_backend.storage.filesystem import resolve_filesystem

__all__ = [
    "Format",
    "RawRecord",
    "SFTDataError",
    "SFTOptions",
    "Source",
    "file_records",
    "is_held_out",
    "open_records",
    "parse_record",
    "record_fields",
    "resolve_source",
]

JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


@dataclass(frozen=True)
class Source:
    """A resolved source: its filesystem, its files, and their kind."""

    filesystem: pafs.FileSystem
    files: tuple[str, ...]
    kind: str  # "json" | "parquet"


def file_kind(path: str) -> str | None:
    """``"json"``, ``"parquet"`` or None, by the file's suffix."""
    lower = path.lower()
    if lower.endswith(JSON_SUFFIXES):
        return "json"
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def resolve_source(path: str | os.PathLike, filesystem: pafs.FileSystem | None = None) -> Source:
    """The files of ``path`` (a file or a directory) and their one kind.

    Raises:
        SFTDataError: nothing at ``path``, an empty directory, a file that is
            neither JSON lines nor parquet, or both kinds in one directory.
    """
    fs, root = resolve_filesystem(path, filesystem)
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise SFTDataError(f"data path {os.fspath(path)!r} does not exist")
    if info.type == pafs.FileType.Directory:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
        files = sorted(
            i.path
            for i in infos
            if i.type == pafs.FileType.File and not i.base_name.startswith((".", "_"))
        )
        if not files:
            raise SFTDataError(f"data path {os.fspath(path)!r} is an empty directory")
    else:
        files = [root]
    kinds = {}
    for f in files:
        kind = file_kind(f)
        if kind is None:
            raise SFTDataError(
                f"{f!r} is neither JSON lines ({', '.join(JSON_SUFFIXES)}) nor parquet "
                f"({', '.join(PARQUET_SUFFIXES)}) by its name"
            )
        kinds.setdefault(kind, f)
    if len(kinds) > 1:
        raise SFTDataError(
            f"data path {os.fspath(path)!r} mixes JSON lines ({kinds['json']!r}) and parquet "
            f"({kinds['parquet']!r}); keep one kind per directory"
        )
    return Source(fs, tuple(files), next(iter(kinds)))


@dataclass(frozen=True)
class RawRecord:
    """One record before parsing: where it is and its JSON text (see the module docstring)."""

    where: str
    text: str


def file_records(kind: str, file: str, stream: BinaryIO) -> Iterator[RawRecord]:
    """The records of one file, read from ``stream`` (binary), in order.

    Raises:
        SFTDataError: a parquet file that cannot be read (a JSON line that
            does not parse is a record; :func:`parse_record` refuses it).
    """
    if kind == "parquet":
        yield from _parquet_records(file, stream)
        return
    for line_no, line in enumerate(stream, start=1):
        text = line.decode("utf-8", errors="replace").strip()
        if text:
            yield RawRecord(f"{file}:{line_no}", text)


def _parquet_records(file: str, stream: BinaryIO) -> Iterator[RawRecord]:
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(stream).iter_batches(batch_size=1024)
        row = 0
        for batch in batches:
            for record in batch.to_pylist():
                text = json.dumps(remove_none(record), ensure_ascii=False, default=str)
                yield RawRecord(f"{file}#{row}", text)
                row += 1
    except SFTDataError:
        raise
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends
        raise SFTDataError(f"{file}: is not a parquet file: {exc}") from None


def open_records(source: Source, file: str) -> Iterator[RawRecord]:
    """:func:`file_records` of one file of ``source``, streamed from its filesystem."""
    if source.kind == "parquet":
        with source.filesystem.open_input_file(file) as f:
            yield from file_records("parquet", file, f)
        return
    with source.filesystem.open_input_stream(file) as raw:
        yield from file_records("json", file, io.BufferedReader(raw))


def parse_record(raw: RawRecord) -> dict:
    """The record as a dict. Raises SFTDataError: not JSON, or not an object."""
    try:
        record = json.loads(raw.text)
    except json.JSONDecodeError as exc:
        raise SFTDataError(
            f"{raw.where}: not JSON ({exc.msg} at column {exc.colno}); the data must be "
            "JSON lines, one object a line"
        ) from None
    if not isinstance(record, dict):
        raise SFTDataError(
            f"{raw.where}: a JSON {type(record).__name__}, not an object; the data must be "
            "JSON lines, one object a line"
        )
    return record


def is_held_out(raw: RawRecord, fraction: float | None, seed: int) -> bool:
    """PURE: whether a record is in the held-out set: a seeded hash of its
    text (the line's bytes as in the file), so the split is the same across
    epochs, restarts, template changes and worker counts."""
    if not fraction:
        return False
    digest = hashlib.blake2b(raw.text.encode("utf-8"), digest_size=8, key=_seed_key(seed))
    return int.from_bytes(digest.digest(), "little") < int(fraction * 2**64)


def _seed_key(seed: int) -> bytes:
    return int(seed).to_bytes(16, "little", signed=True)
