"""Where SFT records come from and what a record must hold (no tokenizer here).

A source is a JSON-lines or parquet file, or a directory of them (read
recursively; names starting with ``.`` or ``_``, such as ``_SUCCESS``, are
skipped), on the local disk, behind a URI (``s3://``, ``gs://``) or on a
``pyarrow.fs`` filesystem the caller passes. One directory holds one kind:
``.jsonl`` / ``.json`` (JSON lines, one record a line) or ``.parquet``.
"""

from __future__ import annotations

import enum
import io
import json
import os
from dataclasses import dataclass

import pyarrow.fs as pafs

from ray_fsdp_backend.sft.templates import read_chat_template
from ray_fsdp_backend.storage.filesystem import resolve_filesystem

JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


class SFTDataError(ValueError):
    """A source or a record that cannot become training rows; the message names
    the file, the record (its 0-based line or row in the file) and the rule."""


class Format(enum.Enum):
    """How a record becomes a token document (``format=``)."""

    CHAT = "chat"
    """A list of ``{role, content}`` messages, rendered by the tokenizer's chat
    template; the loss on the assistant turns."""
    PROMPT_COMPLETION = "prompt_completion"
    """Two text fields; the loss on the completion."""
    TEXT = "text"
    """One text field; the loss on every token."""


@dataclass(frozen=True)
class SFTOptions:
    """The keyword arguments of :func:`~ray_fsdp_backend.sft.sft_dataset`, checked."""

    format: Format
    seq_len: int
    packing: bool = True
    train_on_prompt: bool = False
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    text_field: str = "text"
    chat_template: str | None = None
    """The template text replacing the tokenizer's (``build`` reads a file path)."""
    chat_template_kwargs: dict | None = None
    """Keyword arguments of every template call (``enable_thinking``, ...)."""

    @classmethod
    def build(cls, *, format: str | Format, seq_len: int, **kwargs) -> SFTOptions:
        """Options from user values. Raises ``ValueError`` naming the key and the rule."""
        allowed = ", ".join(f.value for f in Format)
        try:
            fmt = Format(format.value if isinstance(format, Format) else format)
        except ValueError:
            raise ValueError(f"format={format!r} is not one of {allowed}") from None
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len={seq_len!r} must be an int >= 2")
        if kwargs.get("chat_template") is not None:
            kwargs["chat_template"] = read_chat_template(kwargs["chat_template"])
        template_kwargs = kwargs.get("chat_template_kwargs")
        if template_kwargs is not None and not (
            isinstance(template_kwargs, dict) and all(isinstance(k, str) for k in template_kwargs)
        ):
            raise ValueError(
                f"chat_template_kwargs={template_kwargs!r} must map names to values "
                "(keyword arguments of the chat template, e.g. {enable_thinking: false})"
            )
        return cls(format=fmt, seq_len=seq_len, **kwargs)

    @property
    def fields(self) -> tuple[str, ...]:
        """The record fields this format reads."""
        if self.format is Format.CHAT:
            return (self.messages_field,)
        if self.format is Format.PROMPT_COMPLETION:
            return (self.prompt_field, self.completion_field)
        return (self.text_field,)


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


def read_head(source: Source, file: str, limit: int) -> list[dict]:
    """Up to ``limit`` first records of one file of ``source``, as dicts.

    Raises:
        SFTDataError: the file is not JSON lines (a line that does not parse,
            or a line that is not an object) or not parquet.
    """
    if source.kind == "parquet":
        return _parquet_head(source.filesystem, file, limit)
    return _json_head(source.filesystem, file, limit)


def _json_head(fs: pafs.FileSystem, file: str, limit: int) -> list[dict]:
    records = []
    with fs.open_input_stream(file) as raw:
        text = io.TextIOWrapper(io.BufferedReader(raw), encoding="utf-8", errors="replace")
        for line_no, line in enumerate(text):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SFTDataError(
                    f"{file!r} record {line_no} (line {line_no + 1}) is not JSON ({exc.msg}); "
                    "the data must be JSON lines, one object a line"
                ) from None
            if not isinstance(record, dict):
                raise SFTDataError(
                    f"{file!r} record {line_no} (line {line_no + 1}) is a JSON "
                    f"{type(record).__name__}, not an object; the data must be JSON lines, "
                    "one object a line"
                )
            records.append(record)
            if len(records) >= limit:
                break
    return records


def _parquet_head(fs: pafs.FileSystem, file: str, limit: int) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        with fs.open_input_file(file) as f:
            reader = pq.ParquetFile(f)
            batch = next(reader.iter_batches(batch_size=limit), None)
            return [] if batch is None else batch.to_pylist()
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends
        raise SFTDataError(f"{file!r} is not a parquet file: {exc}") from None


def record_fields(record: dict, options: SFTOptions, where: str) -> tuple:
    """The values ``options.format`` reads from ``record``, checked.

    ``where`` names the record in errors (``"'a.jsonl' record 3"``).

    Raises:
        SFTDataError: a missing or null field, a text field that is not a
            string, messages that are not a list of ``{role, content}``.
    """
    values = []
    for name in options.fields:
        value = record.get(name)
        if value is None:
            have = ", ".join(sorted(record)) or "none"
            raise SFTDataError(
                f"{where} has no field {name!r} (format {options.format.value!r}; "
                f"its fields: {have})"
            )
        values.append(value)
    if options.format is Format.CHAT:
        return (clean_messages(values[0], where),)
    for name, value in zip(options.fields, values, strict=True):
        if not isinstance(value, str):
            raise SFTDataError(f"{where} field {name!r} is a {type(value).__name__}, not a string")
    return tuple(values)


def clean_messages(messages, where: str) -> list[dict]:
    """``messages`` as a list of dicts without null keys (parquet and Arrow give
    every message every key seen in the column, null where absent)."""
    if not isinstance(messages, list | tuple) or not messages:
        raise SFTDataError(f"{where}: messages must be a non-empty list of {{role, content}}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise SFTDataError(f"{where} message {i} has no string 'role': {message!r:.120}")
        cleaned = {k: v for k, v in message.items() if v is not None}
        if message.get("content") is None:
            if not message.get("tool_calls"):
                raise SFTDataError(
                    f"{where} message {i} (role {message['role']!r}) has no 'content' "
                    "(null content needs tool_calls)"
                )
        out.append(cleaned)
    return out
