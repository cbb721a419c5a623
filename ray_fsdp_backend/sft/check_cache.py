"""The driver check's cache: a :class:`~ray_fsdp_backend.sft.check.RecordCheck`
kept per content hash of the files, the tokenizer and the options.

The key hashes every byte of every file (a changed record, even with the same
size and time, is a new key; within one process the files are read once
while their sizes and modification times stay: :func:`files_digest`), the
tokenizer's vocabulary, merges, special
tokens and chat template, and the options that change what a record becomes
(a ``chat_template`` file by its text, ``chat_template_kwargs``).
Entries are small JSON files under ``$RFB_CACHE_DIR`` (default
``~/.cache/ray_fsdp_backend``)/``sft_check``, written whole (a temporary
file renamed), so two processes never read half an entry.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ray_fsdp_backend.sft.records import Source

CACHE_VERSION = 3
"""Bumped when what the check computes changes."""


def cache_dir() -> Path:
    root = os.environ.get("RFB_CACHE_DIR") or Path.home() / ".cache" / "ray_fsdp_backend"
    return Path(root) / "sft_check"


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what makes the tokenizer tokenize and render as it does."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(tokenizer).encode())
    h.update(repr(getattr(tokenizer, "chat_template", None)).encode())
    h.update(repr(sorted(getattr(tokenizer, "special_tokens_map", {}).items())).encode())
    return h.hexdigest()


def check_key(source: Source, tokenizer, settings: dict) -> str:
    """The cache key: the files' bytes, the tokenizer, ``settings`` (options, split)."""
    h = hashlib.sha256(f"v{CACHE_VERSION}".encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    h.update(files_digest(source).encode())
    return h.hexdigest()


STATS = {"files_hashed": 0}
"""How many times this process read a source's files to hash them."""

_DIGESTS: dict[tuple, str] = {}
"""This process's digests of sources, by their files' (name, size, mtime)."""


def files_digest(source: Source) -> str:
    """A hash of every byte of ``source``'s files, read once per process while
    their sizes and modification times stay (``train`` checks the records on
    the driver, then builds the train and held-out datasets from them: three
    checks, one read). A file whose filesystem gives no modification time is
    read every time."""
    infos = source.filesystem.get_file_info(list(source.files))
    stamp = tuple((i.path, i.size, i.mtime_ns) for i in infos)
    known = all(i.mtime_ns is not None for i in infos)
    key = (source.filesystem.type_name, stamp)
    if known and key in _DIGESTS:
        return _DIGESTS[key]
    STATS["files_hashed"] += 1
    h = hashlib.sha256()
    for file in source.files:
        h.update(b"\0file\0" + file.encode())
        with source.filesystem.open_input_stream(file) as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    if known:
        _DIGESTS[key] = h.hexdigest()
    return h.hexdigest()


def load(key: str, cls):
    """The cached ``cls`` for ``key``, or None."""
    try:
        return cls(**json.loads((cache_dir() / f"{key}.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def store(key: str, value: dict) -> None:
    """Keep ``value`` (JSON) for ``key``; a cache that cannot be written is skipped."""
    path = cache_dir() / f"{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)
    except OSError:
        pass
