"""A checkpoint's small files (``config.json``, tokenizer files) and its
tokenizer, wherever the checkpoint lives.

Imports neither torch nor ``transformers`` at module level: the driver's
checks (``plan``, ``validate``) load the tokenizer through here, and pay
only for what ``AutoTokenizer`` itself imports (torch's core, through
transformers' ``configuration_utils``; none of torch.distributed).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import tempfile

import pyarrow.fs as pafs

from ray_fsdp_backend.storage.filesystem import is_local, resolve_filesystem

# Small files beside the weights: configs, tokenizer, chat template.
METADATA_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")


def is_metadata_file(name: str) -> bool:
    """Whether ``name`` is one of a checkpoint's small files (not weights)."""
    return name.endswith(METADATA_SUFFIXES)


@contextlib.contextmanager
def metadata_dir(path: str | os.PathLike, filesystem: pafs.FileSystem | None = None):
    """A local directory with the checkpoint's small files (``config.json``,
    tokenizer files), for the ``with`` block: ``path`` itself when local,
    else a temporary copy of those files only (never the weights), removed
    on exit. Under a process group rank 0 downloads them and broadcasts the
    bytes (collective): a store sees one download, not one per rank."""
    fs, root = resolve_filesystem(path, filesystem)
    if is_local(fs):
        yield root
        return
    from ray_fsdp_backend.distributed.collectives import broadcast_from_rank0  # torch.distributed

    files = broadcast_from_rank0(lambda: _read_metadata_files(fs, root))
    with tempfile.TemporaryDirectory(prefix="rfb-pretrained-") as local:
        for name, data in files.items():
            with open(os.path.join(local, name), "wb") as dst:
                dst.write(data)
        yield local


def _read_metadata_files(fs: pafs.FileSystem, root: str) -> dict[str, bytes]:
    files = {}
    for info in fs.get_file_info(pafs.FileSelector(root)):
        if info.type == pafs.FileType.File and is_metadata_file(info.path):
            with fs.open_input_stream(info.path) as src:
                files[posixpath.basename(info.path)] = src.read()
    return files


def load_tokenizer(path: str | os.PathLike, filesystem: pafs.FileSystem | None = None):
    """The tokenizer saved beside the checkpoint."""
    from transformers import AutoTokenizer

    with metadata_dir(path, filesystem) as local:
        return AutoTokenizer.from_pretrained(local)
