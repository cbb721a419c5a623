"""Whether a checkpoint fits the model and optimizer it is loaded into: the
flattened keys and global shapes of the state against the checkpoint's DCP
metadata, compared before DCP reads a byte (DCP itself ignores extra keys and
fails late, per tensor, on a shape)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ray_fsdp_backend.checkpoint.layout import compute_key_mismatch
from ray_fsdp_backend.compat.peft import adapter_layout, describe_layout


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model (or optimizer) it is loaded into."""


# Flattened-key prefixes compared before a load: parameters/buffers and
# per-parameter optimizer state (param_groups hold hyperparameters only).
_CHECKED_PREFIXES = ("model.", "optim.state.")


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


def other_ranks_keys(state: Mapping[str, Any]) -> set[str]:
    """The flattened keys every other rank loads (collective): pipeline
    stages each load their own parameters, so a checkpoint key is extra only
    when no rank loads it."""
    keys = [None] * dist.get_world_size()
    dist.all_gather_object(keys, sorted(flatten_shapes(state)))
    return {k for part in keys for k in part}


def check_fits(
    state: Mapping[str, Any], metadata: Metadata, *, where: str, others: set[str] = frozenset()
) -> None:
    """Raise ``CheckpointMismatchError`` naming the keys when ``state`` and the
    checkpoint differ in keys or tensor shapes (DCP would ignore extra keys);
    keys in ``others`` (what other ranks load) are not extra."""
    mine, theirs = flatten_shapes(state), stored_shapes(metadata)
    theirs = {k: v for k, v in theirs.items() if k in mine or k not in others}
    mismatch = compute_key_mismatch(mine, theirs, _CHECKED_PREFIXES)
    if mismatch:
        adapters = ""
        ours, saved = adapter_layout(mine), adapter_layout(theirs)
        if ours != saved:
            adapters = (
                f"; its LoRA adapters are {describe_layout(saved)}, "
                f"the model's are {describe_layout(ours)}"
            )
        raise CheckpointMismatchError(
            f"checkpoint {where} does not fit this model/optimizer: {mismatch.describe()}"
            + adapters
        )
