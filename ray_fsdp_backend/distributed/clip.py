"""The one gradient-norm clipping every strategy uses.

One global norm (L2 by default; torch's ``norm_type``: 1, inf, any p) over
every gradient, whatever holds it: DTensors on any
mesh (FSDP2 shards, HSDP shards) and plain tensors (DDP, unsharded
parameters), then one clip coefficient for all of them. The seed clipped
DTensor and plain gradients separately, each to ``max_norm``, which let the
total reach ``sqrt(2) * max_norm``; ``torch.nn.utils.clip_grad_norm_`` cannot
mix DTensors from different meshes with plain tensors at all.

How the norm is reduced: a DTensor gradient contributes ``|g|_p^p`` of
its local shard (the max for inf), summed (max-reduced) over the mesh axes on
which it is ``Shard``-ed or ``_StridedShard``-ed (FSDP2 over TP) (not
over ``Replicate`` axes, where every rank holds the same values). Gradients
are bucketed by (mesh, sharded axes) so the number of collectives is the
number of such buckets (one for a plain FSDP model), never the number of
tensors; ``Partial`` gradients are summed first, one all-reduce per (mesh,
partial axes, dtype). Plain gradients are taken as replicated: DDP has
already all-reduced them, so every rank holds the same values. That is
checked on request (one all-reduce and a host sync), which the strategies
do on their first call: a parameter outside the wrapped model would
otherwise be clipped by a different norm on every rank.

The coefficient follows ``torch.nn.utils.clip_grad_norm_`` exactly:
``min(1, max_norm / (norm + eps))`` as a tensor, applied to every gradient
without a host synchronisation. A non-finite norm therefore gives a
coefficient of 0 (or NaN), as in torch: the step must not be taken;
:func:`ray_fsdp_backend.distributed.step_guard.step_if_finite` skips it on the device
(the example loop does).
``max_norm=None`` measures the norm and scales nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard


@dataclass(frozen=True)
class ClipStats:
    """What one clipping call saw and did."""

    total_norm: torch.Tensor
    """Global ``norm_type`` norm before clipping: a plain 0-d float32
    tensor, equal on every rank."""
    clip_coef: torch.Tensor
    """The 0-d factor every gradient was multiplied by (1.0: not clipped)."""
    num_tensors: int
    num_collectives: int

    @property
    def finite(self) -> bool:
        """Whether the norm was finite (a host sync: read it only when needed)."""
        return bool(torch.isfinite(self.total_norm))

    def as_dict(self) -> dict[str, float]:
        """Every field as a Python float (synchronises with the device)."""
        return {
            "total_norm": float(self.total_norm),
            "clip_coef": float(self.clip_coef),
            "finite": float(self.finite),
            "num_tensors": float(self.num_tensors),
            "num_collectives": float(self.num_collectives),
        }


def unique_grads(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients of ``parameters``, each once (tied weights appear twice)."""
    seen: set[int] = set()
    grads = []
    for p in parameters:
        if p.grad is not None and id(p) not in seen:
            seen.add(id(p))
            grads.append(p.grad)
    return grads


def _norm_entries(grads: list[torch.Tensor]) -> tuple[list[tuple], int]:
    """Per gradient: (reduction key, tensor whose local norm is summed, local
    tensor to scale); and the collectives issued. A ``Partial`` gradient's
    norm is not the sum of its local norms, so Partial gradients are summed
    first: flattened into one buffer per (mesh, partial axes, dtype), one
    all-reduce per partial axis, then read as views of that buffer."""
    entries: list[tuple] = []
    partial: dict[tuple, list[int]] = {}
    for i, grad in enumerate(grads):
        if not isinstance(grad, DTensor):
            entries.append(((None, ()), grad, grad))
            continue
        local = grad.to_local()
        sharded = tuple(a for a, p in enumerate(grad.placements) if _is_shard(p))
        entries.append(((grad.device_mesh, sharded), local, local))
        pending = tuple((a, p.reduce_op) for a, p in enumerate(grad.placements) if p.is_partial())
        if pending:
            partial.setdefault((grad.device_mesh, pending, local.dtype), []).append(i)
    collectives = 0
    for (mesh, pending, _), indices in sorted(partial.items(), key=_partial_order):
        locals_ = [entries[i][1] for i in indices]
        summed = torch.cat([t.reshape(-1) for t in locals_])
        for axis, reduce_op in pending:
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=mesh.get_group(axis))
            collectives += 1
            if reduce_op == "avg":
                summed /= mesh.size(axis)
        for i, view in zip(indices, summed.split([t.numel() for t in locals_]), strict=True):
            key, _, to_scale = entries[i]
            entries[i] = (key, view, to_scale)
    return entries, collectives


def _is_shard(placement) -> bool:
    """Whether the local tensors along this axis hold different elements.
    FSDP2 over a TP-split weight shards it ``_StridedShard``, which in torch
    2.13 is not a ``Shard`` and answers ``is_shard()`` False: counting only
    ``Shard`` would skip the dp axis and give each dp rank its own norm."""
    return placement.is_shard() or isinstance(placement, _StridedShard)


def _global_norm_power(
    entries: list[tuple], norm_type: float, device: torch.device, *, check_replicated: bool
) -> tuple[torch.Tensor, int]:
    """``sum |g|^p`` over every gradient element of every rank (``max |g|``
    for ``p = inf``), before the ``1/p`` root, on ``device``."""
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for key, local, _ in entries:
        buckets.setdefault(key, []).append(local)
    total = torch.zeros((), dtype=torch.float32, device=device)
    is_inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    collectives = 0
    # Sorted so that every rank reduces buckets in the same order.
    for (mesh, axes), tensors in sorted(buckets.items(), key=_bucket_order):
        # Accumulate in fp32 whatever the gradients' dtype (bf16 norms lose digits).
        part = _local_norm_power(tensors, norm_type, device)
        if mesh is None and check_replicated:
            collectives += _check_replicated(part, len(tensors))
        if mesh is not None:
            part = part.to(tensors[0].device)
            for axis in axes:
                dist.all_reduce(part, op=op, group=mesh.get_group(axis))
                collectives += 1
        total = torch.maximum(total, part.to(device)) if is_inf else total + part.to(device)
    return total, collectives


def _local_norm_power(tensors: list[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    """``sum |t|^p`` (``max |t|`` for inf) over this rank's ``tensors``. Empty
    local shards (fewer rows than ranks) are skipped: ``_foreach_norm`` has no
    inf norm of an empty tensor, and they add nothing to any norm."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(tensors, norm_type, dtype=torch.float32)
    norms = torch.stack([n.to(device) for n in norms])
    return norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()


def _check_replicated(sq: torch.Tensor, count: int) -> int:
    """Raise unless every rank's plain gradients have the same norm power
    (one all-reduce and a host sync: run once, not every step)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0
    extremes = torch.stack([sq, -sq])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    high, low = float(extremes[0]), -float(extremes[1])
    if high - low > 1e-5 * high:
        raise ValueError(
            f"the gradients of {count} plain (non-DTensor) parameters differ across ranks "
            f"(norm power {low:.6g} to {high:.6g}): nothing synchronises them. Clip only "
            "the wrapped model's parameters, or wrap the module that holds these."
        )
    return 1


def _partial_order(item) -> tuple:
    (mesh, pending, dtype), _ = item
    return (tuple(mesh.mesh.flatten().tolist()), pending, str(dtype))


def _bucket_order(item) -> tuple:
    (mesh, axes), _ = item
    if mesh is None:
        return (0, (), ())
    return (1, tuple(mesh.mesh.flatten().tolist()), axes)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float | None,
    *,
    norm_type: float = 2.0,
    eps: float = 1e-6,
    check_replicated: bool = False,
    across: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> ClipStats:
    """Scale all gradients in place so that their global ``norm_type`` norm
    (2, 1, ``inf`` or any positive p, as torch's keyword) is at most
    ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does on one process.

    ``max_norm=None`` (or ``inf``) only measures the norm. The coefficient
    stays a tensor: no host synchronisation. A non-finite norm scales the
    gradients by 0 or NaN, as torch does; skip the optimizer step then.

    The norm is computed and reduced on ``device`` (the rank's compute
    device; None: the first gradient's, else torch's default). A rank that holds no gradient (a
    frozen pipeline stage) still joins the reductions with a zero on
    ``device``: a host zero there crashed an NCCL group.

    Every rank passes the same parameters in the same order. With
    ``check_replicated`` it also verifies that plain gradients are equal on
    every rank (the strategies do on their first call).

    Raises:
        ValueError: ``max_norm`` is not None and not a positive number, a
            ``norm_type`` that is not positive, or ``check_replicated`` found
            plain gradients that differ across ranks.
    """
    if max_norm is not None and not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} must be positive, or None for no clipping")
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type={norm_type!r} must be positive or inf")
    grads = unique_grads(parameters)
    if device is None:
        device = grads[0].device if grads else torch.get_default_device()
    entries, reduced = _norm_entries(grads)
    power, collectives = _global_norm_power(
        entries, norm_type, device, check_replicated=check_replicated
    )
    if across is not None:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(power, op=op, group=across)
        collectives += 1
    total = power if math.isinf(norm_type) else power.pow(1.0 / norm_type)
    if max_norm is None or max_norm == float("inf"):
        coef = torch.ones((), dtype=torch.float32, device=total.device)
    else:
        coef = torch.clamp(max_norm / (total + eps), max=1.0)
        _scale_by(coef, [to_scale for _, _, to_scale in entries])
    return ClipStats(
        total_norm=total.detach(),
        clip_coef=coef,
        num_tensors=len(entries),
        num_collectives=reduced + collectives,
    )


def _scale_by(coef: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Multiply ``tensors`` by the 0-d ``coef``, one foreach call per device
    (gradients offloaded to the host and the norm on the GPU differ)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for device, group in by_device.items():
        torch._foreach_mul_(group, coef.to(device))
