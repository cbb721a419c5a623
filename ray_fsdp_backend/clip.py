"""The one gradient-norm clipping every strategy uses.

One global L2 norm over every gradient, whatever holds it: DTensors on any
mesh (FSDP2 shards, HSDP shards) and plain tensors (DDP, unsharded
parameters), then one clip coefficient for all of them. The seed clipped
DTensor and plain gradients separately, each to ``max_norm``, which let the
total reach ``sqrt(2) * max_norm``; ``torch.nn.utils.clip_grad_norm_`` cannot
mix DTensors from different meshes with plain tensors at all.

How the norm is reduced: a DTensor gradient contributes the squared norm of
its local shard, summed over the mesh axes on which it is ``Shard``-ed (not
over ``Replicate`` axes, where every rank holds the same values). Gradients
are bucketed by (mesh, sharded axes) so the number of collectives is the
number of such buckets (one for a plain FSDP model), never the number of
tensors. Plain gradients are taken as replicated: DDP has already
all-reduced them, so every rank holds the same values.

The coefficient follows ``torch.nn.utils.clip_grad_norm_`` exactly:
``min(1, max_norm / (norm + eps))`` as a tensor, applied to every gradient
without a host synchronisation. A non-finite norm therefore gives a
coefficient of 0 (or NaN), as in torch: the step must not be taken, and the
caller checks ``torch.isfinite(norm)`` to skip it (the example loop does).
``max_norm=None`` measures the norm and scales nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


@dataclass(frozen=True)
class ClipStats:
    """What one clipping call saw and did."""

    total_norm: torch.Tensor
    """Global L2 norm before clipping: a plain 0-d float32 tensor, equal on
    every rank."""
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


def _norm_input(grad: torch.Tensor) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """(reduction key, tensor whose local norm is summed, local tensor to scale)."""
    if not isinstance(grad, DTensor):
        return (None, ()), grad, grad
    to_scale = grad.to_local()
    if any(p.is_partial() for p in grad.placements):
        # A Partial gradient's norm is not the sum of local norms: reduce first.
        placements = [Replicate() if p.is_partial() else p for p in grad.placements]
        grad = grad.redistribute(grad.device_mesh, placements)
    axes = tuple(i for i, p in enumerate(grad.placements) if p.is_shard())
    return (grad.device_mesh, axes), grad.to_local(), to_scale


@torch.no_grad()  # also makes DTensor.to_local() ~40x cheaper (no autograd node)
def compute_global_sq_norm(grads: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Sum of squares of all ``grads`` across all ranks, and collectives issued.

    Every rank must call this with gradients of the same parameters (in any
    order), so that all ranks issue the same collectives.
    """
    return _global_sq_norm([_norm_input(g) for g in grads])


def _global_sq_norm(entries: list[tuple]) -> tuple[torch.Tensor, int]:
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for key, local, _ in entries:
        buckets.setdefault(key, []).append(local)
    device = entries[0][1].device if entries else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    collectives = 0
    # Sorted so that every rank reduces buckets in the same order.
    for (mesh, axes), tensors in sorted(buckets.items(), key=_bucket_order):
        # Accumulate in fp32 whatever the gradients' dtype (bf16 norms lose digits).
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
        sq = torch.stack([n.to(device) for n in norms]).pow(2).sum()
        if mesh is not None:
            sq = sq.to(tensors[0].device)
            for axis in axes:
                dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=mesh.get_group(axis))
                collectives += 1
        total = total + sq.to(device)
    return total, collectives


def _bucket_order(item) -> tuple:
    (mesh, axes), _ = item
    if mesh is None:
        return (0, (), ())
    return (1, tuple(mesh.mesh.flatten().tolist()), axes)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float | None, *, eps: float = 1e-6
) -> ClipStats:
    """Scale all gradients in place so that their global L2 norm is at most
    ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does on one process.

    ``max_norm=None`` (or ``inf``) only measures the norm. The coefficient
    stays a tensor: no host synchronisation. A non-finite norm scales the
    gradients by 0 or NaN, as torch does; skip the optimizer step then.

    Raises:
        ValueError: ``max_norm`` is not None and not a positive number.
    """
    if max_norm is not None and not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} must be positive, or None for no clipping")
    entries = [_norm_input(g) for g in unique_grads(parameters)]
    sq, collectives = _global_sq_norm(entries)
    total = sq.sqrt()
    if max_norm is None or max_norm == float("inf"):
        coef = torch.ones((), dtype=torch.float32, device=total.device)
    else:
        coef = torch.clamp(max_norm / (total + eps), max=1.0)
        _scale_by(coef, [to_scale for _, _, to_scale in entries])
    return ClipStats(
        total_norm=total.detach(),
        clip_coef=coef,
        num_tensors=len(entries),
        num_collectives=collectives,
    )


def _scale_by(coef: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Multiply ``tensors`` by the 0-d ``coef``, one foreach call per device
    (gradients offloaded to the host and the norm on the GPU differ)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for device, group in by_device.items():
        torch._foreach_mul_(group, coef.to(device))
