"""Global-norm clipping over DTensors on two different meshes and plain tensors,
on 4 gloo ranks, against the norm of the full tensors computed in one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from ray_fsdp_backend.distributed.clip import clip_grad_norm_
from tests.dist.harness import run_ranks


def _param(full: torch.Tensor, mesh=None, placements=None) -> nn.Parameter:
    if mesh is None:
        p = nn.Parameter(torch.zeros_like(full))
        p.grad = full.clone()
    else:
        p = nn.Parameter(distribute_tensor(torch.zeros_like(full), mesh, placements))
        p.grad = distribute_tensor(full.clone(), mesh, placements)
    return p


def _full_grad(p) -> torch.Tensor:
    return p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad


def _setup(rank, world):
    flat = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("dp_shard",))
    hsdp = DeviceMesh(
        "cpu", torch.arange(world).reshape(2, -1), mesh_dim_names=("dp_replicate", "dp_shard")
    )
    g = torch.Generator().manual_seed(7)
    fulls = [
        torch.randn(8, 3, generator=g),
        torch.randn(6, 5, generator=g),
        torch.randn(7, generator=g),
        torch.randn(3, 2, generator=g),
    ]  # 3 rows on 4 ranks
    params = [
        _param(fulls[0], flat, [Shard(0)]),
        _param(fulls[1], hsdp, [Replicate(), Shard(0)]),
        _param(fulls[2]),  # plain: replicated on every rank, counted once
        _param(fulls[3], flat, [Shard(0)]),
    ]
    return flat, fulls, params


def _clip_checks(rank, world):
    flat, fulls, params = _setup(rank, world)
    ref = torch.stack([f.norm() for f in fulls]).norm()
    max_norm = float(ref) / 3
    stats = clip_grad_norm_(params, max_norm)

    torch.testing.assert_close(stats.total_norm, ref, atol=1e-6, rtol=1e-6)
    everyone = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(everyone, stats.total_norm)
    assert all(torch.equal(n, everyone[0]) for n in everyone), everyone
    # One coefficient for all: each gradient is its original times max_norm / ref.
    coef = max_norm / (float(ref) + 1e-6)
    for p, f in zip(params, fulls, strict=True):
        torch.testing.assert_close(_full_grad(p), f * coef, atol=1e-6, rtol=1e-5)
    after = torch.stack([_full_grad(p).norm() for p in params]).norm()
    assert after <= max_norm * (1 + 1e-5), (after, max_norm)
    # Two (mesh, sharded-axes) buckets: one collective each.
    assert stats.num_collectives == 2

    # A tied parameter listed twice is counted once.
    again = clip_grad_norm_(params + params[:1], 1e9)
    torch.testing.assert_close(again.total_norm, after, atol=1e-6, rtol=1e-5)

    # The collective count does not grow with the number of tensors.
    counts = []
    for n in (10, 100, 1000):
        many = [_param(torch.ones(4, 2), flat, [Shard(0)]) for _ in range(n)]
        s = clip_grad_norm_(many, 1.0)
        torch.testing.assert_close(s.total_norm, torch.tensor(float(8 * n) ** 0.5))
        counts.append(s.num_collectives)
    assert counts == [1, 1, 1], counts

    # A non-finite norm scales as torch.nn.utils does on the full tensors (by 0).
    _, fulls, params = _setup(rank, world)
    if rank == 0:  # a shard on the flat mesh: every rank's reduction sees it
        params[0].grad.to_local().fill_(float("inf"))
    reference = [torch.nn.Parameter(_full_grad(p).clone()) for p in params]
    for r in reference:
        r.grad = r.detach().clone()
    torch.nn.utils.clip_grad_norm_(reference, 1.0)
    bad = clip_grad_norm_(params, 1.0)
    assert not bad.finite and not torch.isfinite(bad.total_norm)
    for p, r in zip(params, reference, strict=True):
        torch.testing.assert_close(_full_grad(p), r.grad, equal_nan=True)
    return stats.as_dict()


def _partial(full: torch.Tensor, mesh, placements, weight: float) -> nn.Parameter:
    """A parameter whose gradient is ``Partial`` (sum) on the mesh's first
    axis: this rank holds ``weight`` times its part of ``full``."""
    shard = distribute_tensor(full, mesh, [Replicate(), *placements[1:]]).to_local()
    p = nn.Parameter(torch.zeros_like(full))
    p.grad = DTensor.from_local(shard * weight, mesh, placements, run_check=False)
    return p


def _partial_checks(rank, world):
    """Partial gradients are summed before their norm is taken, in one
    all-reduce per (mesh, partial axes, dtype) whatever their number."""
    flat, _, _ = _setup(rank, world)
    hsdp = DeviceMesh(
        "cpu", torch.arange(world).reshape(2, -1), mesh_dim_names=("dp_replicate", "dp_shard")
    )
    g = torch.Generator().manual_seed(11)
    fulls = [torch.randn(8, 3, generator=g), torch.randn(5, generator=g)]
    fulls += [torch.randn(6, 5, generator=g), torch.randn(7, generator=g)]
    # Unequal parts that sum to the full gradient over each partial axis.
    flat_weight = (rank + 1) / sum(range(1, world + 1))
    hsdp_weight = (0.25, 0.75)[hsdp.get_local_rank(0)]
    params = [
        _partial(fulls[0], flat, [Partial()], flat_weight),
        _partial(fulls[1], flat, [Partial()], flat_weight),
        _partial(fulls[2], hsdp, [Partial(), Shard(0)], hsdp_weight),
        _param(fulls[3]),
    ]
    ref = torch.stack([f.norm() for f in fulls]).norm()
    max_norm = float(ref) / 2
    stats = clip_grad_norm_(params, max_norm)
    torch.testing.assert_close(stats.total_norm, ref, atol=1e-5, rtol=1e-5)
    coef = max_norm / (float(ref) + 1e-6)
    for p, f in zip(params, fulls, strict=True):
        torch.testing.assert_close(_full_grad(p), f * coef, atol=1e-5, rtol=1e-5)
    # Partial sums: one per mesh (flat, hsdp's replicate axis); then hsdp's shard axis.
    many = [_partial(torch.ones(4, 2), flat, [Partial()], flat_weight) for _ in range(50)]
    return stats.num_collectives, clip_grad_norm_(many, 1.0).num_collectives


def _plain_checks(rank, world):
    """Plain gradients that differ across ranks fail the replication check
    on every rank; equal ones pass it for one more collective."""
    _, fulls, params = _setup(rank, world)
    plain = params[2]
    counts = [clip_grad_norm_(params, None, check_replicated=True).num_collectives]
    plain.grad.add_(rank)  # as a parameter outside the wrapped model would be
    try:
        clip_grad_norm_(params, None, check_replicated=True)
    except ValueError as exc:
        return counts, str(exc)
    return counts, None


def _norm_type_checks(rank, world):
    """1-D and HSDP DTensors and plain tensors: every norm type equals
    torch's on the full tensors, with one collective per bucket (MAX for inf)."""
    out = {}
    for norm_type in (1.0, 3.0, float("inf")):
        _, fulls, params = _setup(rank, world)
        ref = torch.nn.utils.get_total_norm(fulls, norm_type)
        stats = clip_grad_norm_(params, float(ref) / 2, norm_type=norm_type)
        torch.testing.assert_close(stats.total_norm, ref, atol=1e-5, rtol=1e-5)
        coef = float(ref) / 2 / (float(ref) + 1e-6)
        for p, f in zip(params, fulls, strict=True):
            torch.testing.assert_close(_full_grad(p), f * coef, atol=1e-5, rtol=1e-5)
        out[norm_type] = stats.num_collectives
    return out


def _all_checks(rank, world):
    return (
        _clip_checks(rank, world),
        _partial_checks(rank, world),
        _plain_checks(rank, world),
        _norm_type_checks(rank, world),
    )


@pytest.fixture(scope="module")
def checks():
    return run_ranks(_all_checks, 4)


def test_one_global_norm_over_mixed_meshes_and_plain_tensors(checks):
    stats, _, _, _ = checks
    assert stats["clip_coef"] < 1.0 and stats["finite"] == 1.0


def test_partial_gradients_are_summed_once_per_mesh_before_the_norm(checks):
    _, (mixed, many), _, _ = checks
    assert (mixed, many) == (3, 1)


def test_plain_gradients_that_differ_across_ranks_are_refused(checks):
    _, _, (counts, error), _ = checks
    assert counts == [3]  # the two buckets' collectives and the check
    assert error is not None and "plain (non-DTensor) parameters differ across ranks" in error


def test_norm_types_1_p_and_inf_equal_torch_on_the_full_tensors(checks):
    *_, collectives = checks
    assert collectives == {1.0: 2, 3.0: 2, float("inf"): 2}
