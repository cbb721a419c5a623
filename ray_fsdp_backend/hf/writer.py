"""Write full weights as safetensors files on any ``pyarrow.fs`` filesystem.

The plan is pure and the same on every rank (:func:`plan_export`): the
tensors in state-dict order, cut into ``world`` groups of about equal bytes
(so that every rank has a part to write) and each group into files of at
most ``max_shard_size``, each file given to one rank, balancing bytes. Then every rank walks the
tensors in that order: a sharded tensor (``DTensor``) is gathered by
``collectives.full_tensor`` (a collective: every rank takes part, one tensor at a
time), and the rank that owns the tensor's file streams its bytes straight
into that file, its header first (known from the plan). Each file is
whole or absent: on object storage each rank streams its own files (a
multipart upload per large file, see :mod:`ray_fsdp_backend.storage.retrying_fs`)
with the credentials the filesystem already has; on a local disk a file is
written as ``NAME.tmp``, fsynced and renamed. After each tensor and each
file the ranks agree (one all-reduce) that it was written, so a failure on
one rank, a write or not, fails every rank at once. Peak host memory: one
full tensor (plus, on object storage, the upload's window of queued parts).

``torch.distributed.checkpoint``'s ``HuggingFaceStorageWriter`` and its
consolidation (torch 2.13) work on local paths only, hence this writer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pyarrow.fs as pafs
import torch
import torch.distributed as dist

from ray_fsdp_backend.distributed.collectives import agreed, full_tensor
from ray_fsdp_backend.hf.safetensors_io import build_header
from ray_fsdp_backend.storage.retrying_fs import open_whole


def plan_shard_files(sizes: dict[str, int], max_bytes: int) -> dict[str, int]:
    """Key -> file index (1-based), filling files in key order up to
    ``max_bytes`` (a tensor larger than that gets a file of its own)."""
    mapping, index, used = {}, 1, 0
    for key, nbytes in sizes.items():
        if used and used + nbytes > max_bytes:
            index, used = index + 1, 0
        mapping[key] = index
        used += nbytes
    return mapping


@dataclass(frozen=True)
class FilePlan:
    """One output file: its name (relative to the export root), the keys it
    holds in order, and the rank that writes it."""

    name: str
    keys: tuple[str, ...]
    owner: int


def plan_export(sizes: dict[str, int], max_bytes: int, world_size: int) -> list[FilePlan]:
    """Files ``model-0000i-of-0000N.safetensors`` for tensors of ``sizes``
    (key -> bytes, in write order): the keys cut into ``world_size``
    contiguous groups of about equal bytes, each group into files of at most
    ``max_bytes``; each file's owner is the rank with the fewest bytes so far
    (largest files first), so every rank writes about its share."""
    total = max(1, sum(sizes.values()))
    groups: list[dict[str, int]] = [{} for _ in range(world_size)]
    done = 0
    for key, nbytes in sizes.items():  # a key goes to the group its middle byte falls in
        groups[min(world_size - 1, (2 * done + nbytes) * world_size // (2 * total))][key] = nbytes
        done += nbytes
    keys: list[list[str]] = []
    for group in groups:
        mapping = plan_shard_files(group, max_bytes)
        start = len(keys)
        keys.extend([] for _ in set(mapping.values()))
        for key, index in mapping.items():
            keys[start + index - 1].append(key)
    count = len(keys)
    file_bytes = [sum(sizes[k] for k in ks) for ks in keys]
    owners, load = [0] * count, [0] * world_size
    for i in sorted(range(count), key=lambda i: -file_bytes[i]):
        owners[i] = min(range(world_size), key=lambda r: load[r])
        load[owners[i]] += file_bytes[i]
    return [
        FilePlan(f"model-{i + 1:05d}-of-{count:05d}.safetensors", tuple(ks), owners[i])
        for i, ks in enumerate(keys)
    ]


def tag_names(files: list[FilePlan], tag: str) -> list[FilePlan]:
    """``files`` renamed ``model-0000i-of-0000N-TAG.safetensors`` (``tag``
    empty: as they are)."""
    if not tag:
        return files
    return [
        replace(f, name=f"{f.name.removesuffix('.safetensors')}-{tag}.safetensors") for f in files
    ]


def export_dtype(value: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``value`` is written in: ``dtype`` for floating-point
    tensors, its own for integer and bool ones."""
    return dtype if dtype is not None and value.is_floating_point() else value.dtype


def write_files(
    fs: pafs.FileSystem,
    root: str,
    state: dict[str, torch.Tensor],
    files: list[FilePlan],
    dtype: torch.dtype | None,
) -> int:
    """Write ``files`` (every rank calls it with the same plan; see the module
    docstring). ``state`` values may be DTensors. Each file is whole or
    absent (:func:`~ray_fsdp_backend.storage.retrying_fs.open_whole`). Each step is
    a phase the ranks agree on (:func:`~ray_fsdp_backend.distributed.collectives.agreed`):
    opening a file, each tensor's gather and write, the commit. A failure on
    one rank, a write or not (a full disk, an out-of-memory in a gather or a
    conversion), makes every rank raise
    :class:`~ray_fsdp_backend.distributed.collectives.RankFailedError` naming that rank
    and its error at the end of that step, before the next collective.
    Returns the bytes this rank wrote."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    written = 0
    for plan in files:
        path = f"{root}/{plan.name}" if root else plan.name
        out = None
        try:
            with agreed(f"writing {path}"):
                if plan.owner == rank:
                    out = open_whole(fs, path)
                    out.write(file_header(state, plan, dtype))
            for key in plan.keys:
                with agreed(f"writing {path} (tensor {key!r})"):
                    # The step's one collective, over the ranks that hold the tensor
                    # (a meta tensor: another pipeline stage's, see hf/holders.py).
                    tensor = state[key]
                    full = None if tensor.is_meta else full_tensor(tensor.detach())
                    if out is not None:
                        data = full.to("cpu", export_dtype(full, dtype)).contiguous()
                        out.write(data.reshape(-1).view(torch.uint8).numpy())
                    del full
            with agreed(f"writing {path}"):
                if out is not None:
                    written += out.tell()
                    out.commit()
        finally:
            if out is not None:
                out.abort()  # after a failure or an interruption; a no-op once committed
    return written


def file_header(state: dict[str, torch.Tensor], plan: FilePlan, dtype: torch.dtype | None):
    """The safetensors header of ``plan``'s file."""
    return build_header(
        (k, export_dtype(state[k], dtype), tuple(state[k].shape)) for k in plan.keys
    )


def write_bytes(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """One small file (index, config, tokenizer, marker) written whole."""
    with open_whole(fs, path) as out:
        out.write(data)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
