"""Where an export lands: refused when it would mix, verified before it is declared.

An export writes into a target that every rank must see, and publishes its
index only once every planned file is there. Four steps, each collective
(every rank calls it; a failure is raised on every rank):

- :func:`check_target`: a non-empty target is refused unless the caller
  passed ``overwrite=True``; with it, nothing is deleted yet: the new
  shards get names no old file has, and the old index keeps naming the old
  shards (the old export stays loadable) until the new index replaces it.
- :func:`check_shared`: each rank writes a marker into the target and rank 0
  looks for all of them; a rank whose marker rank 0 cannot see is writing
  somewhere else (a node-local directory on a multi-node cluster).
- :func:`verify_files`: after every rank has written, rank 0 lists the
  target once and checks each planned file's size; a missing or short one
  is named with the rank that wrote it, and no index is written.
- :func:`remove_stale`: with ``overwrite=True``, the weight files
  (``*.safetensors``, ``*.bin``, ``*.index.json``) the new export did not
  write are deleted after its index is published (the commit point): the
  index names only the new shards, and an old single ``model.safetensors``,
  which ``transformers`` prefers to an index, goes last of all.
"""

from __future__ import annotations

import posixpath

import pyarrow.fs as pafs

from ray_fsdp_backend.hf.shapes import SINGLE_NAME

_MARKER = ".export-rank-"
"""Prefix of the per-rank visibility markers (removed after the check)."""
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".index.json")


class ExportTargetError(RuntimeError):
    """The export target cannot take this export (see the module docstring)."""


def is_weight_file(name: str) -> bool:
    """Whether ``name`` holds weights or names them (an index)."""
    return name.endswith(_WEIGHT_SUFFIXES)


def check_target(fs: pafs.FileSystem, root: str, overwrite: bool, uri: str) -> None:
    """Refuse a non-empty ``root`` (a directory with entries, or an existing
    file) unless ``overwrite``. Nothing is deleted here (see the module
    docstring). ``uri`` names the target in messages."""

    def check() -> None:
        names = target_entries(fs, root)
        if names and not overwrite:
            raise ExportTargetError(
                f"export target {uri!r} is not empty ({describe_entries(names)}): exporting "
                "into it would mix two models' files; pass overwrite=True to replace its "
                "weights, or choose an empty path"
            )

    _on_rank0(check)


def target_entries(fs: pafs.FileSystem, root: str) -> list[str]:
    """What ``root`` already holds: its entries' names (a file: its own name;
    nothing there: none), rank markers left out."""
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        return []
    if info.type == pafs.FileType.Directory:
        names = sorted(
            posixpath.basename(i.path) for i in fs.get_file_info(pafs.FileSelector(root))
        )
    else:
        names = [info.base_name]
    return [n for n in names if not n.startswith(_MARKER)]


def describe_entries(names: list[str]) -> str:
    """The first few of ``names``, for a message."""
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def check_shared(fs: pafs.FileSystem, root: str, uri: str) -> None:
    """Refuse a ``root`` that not every rank sees: each rank writes a marker
    there, rank 0 lists ``root`` and looks for all of them. The markers are
    removed before returning."""
    import torch.distributed as dist

    from ray_fsdp_backend.distributed.collectives import raise_if_any_failed
    from ray_fsdp_backend.hf.writer import write_bytes

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    marker = posixpath.join(root, f"{_MARKER}{rank}")
    error = None
    try:
        write_bytes(fs, marker, b"")
    except Exception as exc:
        error = exc
    raise_if_any_failed(error, f"writing a marker into export target {uri!r}")

    def look() -> None:
        seen = set(_names(fs, root))
        unseen = [r for r in range(world) if f"{_MARKER}{r}" not in seen]
        if unseen:
            raise ExportTargetError(
                f"export target {uri!r} is not shared by every rank: rank 0 does not see "
                f"the files rank(s) {_ranks(unseen)} wrote there (a node-local directory?). "
                "Export to a filesystem every node mounts at the same path (NFS, a shared "
                "volume) or to an object-store URI (s3://..., gs://...)"
            )

    try:
        _on_rank0(look)
    finally:
        _remove(fs, marker)


def verify_files(
    fs: pafs.FileSystem, root: str, expected: dict[str, tuple[int, int]], uri: str
) -> None:
    """Check, with one listing of ``root`` on rank 0, that every file of
    ``expected`` (name -> (bytes, rank that wrote it)) is there at its size."""

    def verify() -> None:
        sizes = {posixpath.basename(i.path): i.size for i in _infos(fs, root)}
        bad = [
            f"{name} (rank {owner}: {_state(sizes.get(name), size)})"
            for name, (size, owner) in sorted(expected.items())
            if sizes.get(name) != size
        ]
        if bad:
            raise ExportTargetError(
                f"export to {uri!r} is incomplete; no index was written. Rank 0 does not "
                f"see {len(bad)} of {len(expected)} files as written: {', '.join(bad)}. "
                "If those ranks wrote to a disk of their own node, export to a shared "
                "filesystem or an object-store URI"
            )

    _on_rank0(verify)


def remove_stale(fs: pafs.FileSystem, root: str, keep: set[str]) -> None:
    """Delete (on rank 0) the weight files in ``root`` not in ``keep``, a
    single ``model.safetensors`` last (``transformers`` loads it before an
    index, so until it goes the old export is what loads)."""

    def remove() -> None:
        stale = [n for n in _names(fs, root) if is_weight_file(n) and n not in keep]
        for name in sorted(stale, key=lambda n: n == SINGLE_NAME):
            fs.delete_file(posixpath.join(root, name))

    _on_rank0(remove)


def _on_rank0(fn) -> None:
    """``fn`` on rank 0, its error raised on every rank
    (:func:`~ray_fsdp_backend.distributed.collectives.broadcast_from_rank0`, imported on
    use: ``plan`` reads :func:`target_entries` without torch)."""
    from ray_fsdp_backend.distributed.collectives import broadcast_from_rank0

    broadcast_from_rank0(fn)


def _infos(fs: pafs.FileSystem, root: str) -> list[pafs.FileInfo]:
    selector = pafs.FileSelector(root, allow_not_found=True)
    return [i for i in fs.get_file_info(selector) if i.type == pafs.FileType.File]


def _names(fs: pafs.FileSystem, root: str) -> list[str]:
    return sorted(posixpath.basename(i.path) for i in _infos(fs, root))


def _state(found: int | None, size: int) -> str:
    return "missing" if found is None else f"{found} of {size} bytes"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _remove(fs: pafs.FileSystem, path: str) -> None:
    try:
        fs.delete_file(path)
    except FileNotFoundError:
        pass
