"""``transformers`` helpers for pretrained causal LMs (the ``hf`` extra).

``transformers`` is imported inside each function, never at module import:
the core package works without it.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import tempfile

import pyarrow.fs as pafs
import torch
from torch import nn

from ray_fsdp_backend.collectives import broadcast_from_rank0
from ray_fsdp_backend.filesystem import is_local, resolve_filesystem
from ray_fsdp_backend.hf.reader import is_metadata_file, read_checkpoint_index


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


def build_causal_lm(
    path: str | os.PathLike,
    *,
    filesystem: pafs.FileSystem | None = None,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """The checkpoint's causal LM (``AutoConfig`` + ``from_config``) built on
    the meta device in ``dtype``: no memory until a strategy wraps it; then
    :func:`~ray_fsdp_backend.hf.load_pretrained` fills it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ray_fsdp_backend.hf.compat import check_transformers_version

    check_transformers_version()
    with metadata_dir(path, filesystem) as local:
        config = AutoConfig.from_pretrained(local)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def load_tokenizer(path: str | os.PathLike, filesystem: pafs.FileSystem | None = None):
    """The tokenizer saved beside the checkpoint."""
    from transformers import AutoTokenizer

    with metadata_dir(path, filesystem) as local:
        return AutoTokenizer.from_pretrained(local)


def count_checkpoint_parameters(
    path: str | os.PathLike, filesystem: pafs.FileSystem | None = None
) -> int:
    """Number of weights in the checkpoint, from the safetensors headers
    alone (a few KB read per file, no weights)."""
    fs, root = resolve_filesystem(path, filesystem)
    entries = read_checkpoint_index(fs, root).values()
    return sum((e.end - e.begin) // e.dtype.itemsize for e in entries)
