"""Sharded save and load with ``torch.distributed.checkpoint`` (no Ray here).

Model and optimizer go through ``torch.distributed.checkpoint.state_dict``
(keys are parameter FQNs without wrapper prefixes such as DDP's ``module.``),
so a checkpoint loads under another world size or strategy: DCP reshards.
Each rank also writes its own extra state (RNG generators and the caller's
step, data position, scheduler state). Rank 0 commits the checkpoint with a
``COMPLETE`` marker only after every rank finished writing.
"""

from __future__ import annotations

import io
import logging
import os
import random
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ray_fsdp_backend.checkpoint.layout import (
    compute_key_mismatch,
    encode_marker,
    extra_state_name,
    newest_complete,
    next_checkpoint_name,
    stale_partials,
)
from ray_fsdp_backend.checkpoint.store import CheckpointStore, readable_dir, writable_dir

_logger = logging.getLogger(__name__)

# Flattened-key prefixes compared before a load: parameters/buffers and
# per-parameter optimizer state (param_groups hold hyperparameters only).
_CHECKED_PREFIXES = ("model.", "optim.state.")


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model (or optimizer) it is loaded into."""


def save_sharded(
    store: CheckpointStore,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    extra_state: Mapping[str, Any] | None = None,
    strategy: str = "",
) -> str:
    """Write a new checkpoint into ``store`` and commit it; returns its name.

    Collective: every rank calls it. Each rank writes its DCP shard and its
    extra state; after a barrier rank 0 writes the ``COMPLETE`` marker and
    deletes partial checkpoints older than this one. When it returns on any
    rank, the checkpoint is complete.

    Raises:
        ValueError: ``extra_state`` holds objects that ``torch.load(...,
            weights_only=True)`` cannot read back (checked before writing).
    """
    rank = dist.get_rank()
    payload = encode_extra_state(extra_state)
    name = broadcast_from_rank0(lambda: next_checkpoint_name(store.list_checkpoints()))
    with writable_dir(store, name) as local:
        dcp.save(_state_to_save(model, optimizer), storage_writer=dcp.FileSystemWriter(local))
        _write_file(os.path.join(local, extra_state_name(rank)), payload)
    dist.barrier()
    if rank == 0:
        step = (extra_state or {}).get("step")
        marker = encode_marker(
            world_size=dist.get_world_size(),
            strategy=strategy,
            step=step if isinstance(step, int) else None,
        )
        commit_checkpoint(store, name, marker)
    dist.barrier()
    return name


def commit_checkpoint(store: CheckpointStore, name: str, marker: str) -> None:
    """Rank 0: mark ``name`` complete, then drop older partial checkpoints."""
    store.write_marker(name, marker)
    for partial in stale_partials(store.read_markers(), name):
        _logger.info("ray_fsdp_backend: deleting partial checkpoint %s", partial)
        store.delete(partial)


def load_sharded(
    store: CheckpointStore,
    name: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> dict[str, Any]:
    """Load checkpoint ``name`` into ``model`` and ``optimizer`` (resharding as
    needed) and restore this rank's RNG generators; returns the extra state
    this rank saved (rank 0's when this rank did not exist then).

    Collective: every rank calls it with the same ``name``.

    Raises:
        CheckpointMismatchError: keys missing from or extra in the checkpoint,
            or tensors of another shape; the message names them.
    """
    state = _state_to_load(model, optimizer)
    with readable_dir(store, name) as local:
        reader = dcp.FileSystemReader(local)
        check_fits(state, reader.read_metadata(), where=store.path(name))
        dcp.load(state, storage_reader=reader)
        extra, own = _read_extra(local, dist.get_rank())
    _set_state(model, optimizer, state)
    if own:
        restore_rng_state(extra["rng"])
    return dict(extra["user"])


def find_latest(store: CheckpointStore) -> str | None:
    """The newest complete checkpoint in ``store``; None when there is none."""
    return newest_complete(store.read_markers())


# -- model and optimizer state ------------------------------------------


def _state_to_save(model: nn.Module, optimizer) -> dict[str, Any]:
    optimizers = [optimizer] if optimizer is not None else []
    model_sd, optim_sd = get_state_dict(model, optimizers)
    return {"model": model_sd, "optim": optim_sd} if optimizers else {"model": model_sd}


# A fresh optimizer has no state yet; get_state_dict initialises it (a zero-lr
# step on zero gradients), so DCP has tensors to load the moments into.
_state_to_load = _state_to_save


def _set_state(model: nn.Module, optimizer, state: dict[str, Any]) -> None:
    optimizers = [optimizer] if optimizer is not None else []
    set_state_dict(
        model,
        optimizers,
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )


def flatten_shapes(state: Mapping[str, Any], prefix: str = "") -> dict[str, tuple | None]:
    """Flattened keys as DCP writes them (``model.layers.0.fc.weight``) ->
    global shape for tensors (DTensors: the full shape), None for other leaves.
    Lists (optimizer ``param_groups``) are skipped."""
    out: dict[str, tuple | None] = {}
    for key, value in state.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_shapes(value, f"{path}."))
        elif isinstance(value, torch.Tensor):
            out[path] = tuple(value.shape)
        elif not isinstance(value, (list, tuple)):
            out[path] = None
    return out


def stored_shapes(metadata: Metadata) -> dict[str, tuple | None]:
    """The checkpoint's flattened keys -> shape (None for non-tensor entries)."""
    return {
        key: tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
        for key, md in metadata.state_dict_metadata.items()
    }


def check_fits(state: Mapping[str, Any], metadata: Metadata, *, where: str) -> None:
    """Raise ``CheckpointMismatchError`` naming the keys when ``state`` and the
    checkpoint differ in keys or tensor shapes (DCP would ignore extra keys)."""
    mismatch = compute_key_mismatch(
        flatten_shapes(state), stored_shapes(metadata), _CHECKED_PREFIXES
    )
    if mismatch:
        raise CheckpointMismatchError(
            f"checkpoint {where} does not fit this model/optimizer: {mismatch.describe()}"
        )


# -- extra state and RNG ------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG generators: torch CPU, the current CUDA device's
    (when CUDA is in use), Python's ``random`` and NumPy's global one."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    # As a tensor: weights_only loading refuses NumPy arrays.
    state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Set the generators ``capture_rng_state`` recorded."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def encode_extra_state(extra_state: Mapping[str, Any] | None) -> bytes:
    """This rank's extra-state file: the caller's state and the RNG state.

    Raises:
        ValueError: it would not load with ``weights_only=True`` (only
            tensors, numbers, strings, None and lists/tuples/dicts of them).
    """
    buf = io.BytesIO()
    torch.save({"user": dict(extra_state or {}), "rng": capture_rng_state()}, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise ValueError(
            "extra_state must hold only tensors, numbers, strings, bools, None and "
            f"lists/tuples/dicts of them (it is loaded with weights_only=True): {exc}"
        ) from None
    return data


def _read_extra(local: str, rank: int) -> tuple[dict[str, Any], bool]:
    """This rank's extra state if it saved one, else rank 0's; and whether it
    was this rank's own (only then are its RNG generators restored)."""
    own = os.path.join(local, extra_state_name(rank))
    path = own if os.path.exists(own) else os.path.join(local, extra_state_name(0))
    with open(path, "rb") as f:
        return torch.load(f, weights_only=True), path == own


def _write_file(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def broadcast_from_rank0(compute):
    """``compute()`` on rank 0, its result on every rank (collective). An
    exception on rank 0 is raised on every rank, so none waits forever."""
    outcome = None
    if dist.get_rank() == 0:
        try:
            outcome = ("ok", compute())
        except Exception as exc:
            outcome = ("error", exc)
    box = [outcome]
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value
