"""What :class:`~ray_fsdp_backend.dmuon.optimizer.Muon` checks and resolves
when it is built: its hyperparameters, its two named parameter groups, where
Newton–Schulz runs, and whether this rank's shards hold the plan's rows.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ray_fsdp_backend.dmuon.exchange import ShardGroup
from ray_fsdp_backend.dmuon.plan import OwnershipPlan, row_range

MUON_GROUP = "muon"
ADAMW_GROUP = "adamw"
_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def param_groups(model, dedicated, muon_hyper: dict, adamw) -> list[dict]:
    """The named groups: "muon" (dedicated matrices, in plan order) and
    "adamw" (with every key torch's AdamW reads), each only when non-empty."""
    groups = [dict(name=MUON_GROUP, params=[p for _, p in dedicated], **muon_hyper)]
    groups = groups if dedicated else []
    if adamw is not None:
        groups.append(dict(adamw.param_groups[0], name=ADAMW_GROUP))
    if not groups:
        raise ValueError(f"{type(model).__name__} has no trainable parameters")
    return groups


def resolve_ns_device(shard_device: torch.device, mesh_device_type: str) -> torch.device:
    """Where Newton–Schulz runs: the shard's device, unless the mesh computes
    on another (CPU offload keeps shards on the host while the mesh is on the
    GPU): then the mesh's device type, i.e. this rank's current accelerator."""
    if shard_device.type == mesh_device_type:
        return shard_device
    return torch.device(mesh_device_type)


def ns_device(param: torch.Tensor) -> torch.device:
    """:func:`resolve_ns_device` for a dedicated parameter (a DTensor's mesh)."""
    mesh_type = param.device_mesh.device_type if isinstance(param, DTensor) else None
    return resolve_ns_device(
        local_tensor(param).device, mesh_type or local_tensor(param).device.type
    )


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def shard_rows_error(
    dedicated: list[tuple[str, nn.Parameter]], plan: OwnershipPlan, shard: ShardGroup
) -> str | None:
    """Why this rank's shards do not match the plan's ``torch.chunk`` rows, or
    None. Checked collectively so that a mismatch on one rank fails all."""
    for (name, p), spec in zip(dedicated, plan.matrices, strict=True):
        start, stop = row_range(spec.shape[0], plan.num_ranks, shard.rank)
        expected = (stop - start, spec.shape[1])
        if tuple(local_tensor(p).shape) != expected:
            return (
                f"dedicated parameter {name!r}: local shard has shape "
                f"{tuple(local_tensor(p).shape)}, expected {expected} (torch.chunk rows of "
                f"{spec.shape} over {plan.num_ranks} ranks)"
            )
    return None


def check_muon_args(lr, momentum, weight_decay, ns_steps, adjust_lr_fn, ns_dtype) -> None:
    """Raise ``ValueError`` naming the first hyperparameter out of its range."""
    checks = [
        ("lr", lr, lr >= 0, "must be >= 0"),
        ("momentum", momentum, momentum >= 0, "must be >= 0"),
        ("weight_decay", weight_decay, weight_decay >= 0, "must be >= 0"),
        (
            "ns_steps",
            ns_steps,
            isinstance(ns_steps, int) and 0 < ns_steps < 100,
            "must be an int in [1, 99]",
        ),
        (
            "adjust_lr_fn",
            adjust_lr_fn,
            adjust_lr_fn in _ADJUST_LR_FNS,
            f"must be one of {_ADJUST_LR_FNS}",
        ),
        (
            "ns_dtype",
            ns_dtype,
            ns_dtype in (torch.bfloat16, torch.float16, torch.float32),
            "must be torch.bfloat16, torch.float16 or torch.float32",
        ),
    ]
    for name, value, ok, rule in checks:
        if not ok:
            raise ValueError(f"{name}={value!r} {rule}")
