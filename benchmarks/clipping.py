"""Comparison 3: gradient clipping, ours vs ``torch.nn.utils.clip_grad_norm_``.

Both clip the same DTensor gradients (``Shard(0)`` over all ranks, as FSDP2
leaves them) at 10, 100 and 1000 parameter tensors; each call clips (the
norm always exceeds ``max_norm``), so both also scale every gradient.
Collectives are counted as they reach torch's dispatcher, ``torch.distributed``
calls and the functional collectives DTensor uses alike, in the benchmark
process only (:class:`benchmarks._collectives.CollectiveLog`); ours also
reports its own count in ``ClipStats.num_collectives``.

One more row shows what torch's function cannot do: FSDP-sharded and plain
(unsharded) gradients together, which our clip handles in the same call.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from benchmarks import _measure
from benchmarks._collectives import CollectiveLog
from ray_fsdp_backend.distributed.clip import clip_grad_norm_

MAX_NORM = 1e-3
TENSOR_COUNTS = (10, 100, 1000)


def _sharded_params(n: int, shape: tuple[int, int], mesh) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(n)
    params = []
    for _ in range(n):
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.randn(shape, generator=g), mesh, [Shard(0)])
        params.append(p)
    return params


def _count(fn) -> int:
    with CollectiveLog() as log:
        fn()
    return len(log.records)


def _torch_on_mixed(mesh, shape) -> str:
    """Whether ``torch.nn.utils.clip_grad_norm_`` takes sharded + plain grads."""
    params = _sharded_params(2, shape, mesh)
    plain = torch.nn.Parameter(torch.zeros(shape))
    plain.grad = torch.ones(shape)
    try:
        torch.nn.utils.clip_grad_norm_([*params, plain], MAX_NORM)
    except Exception as exc:  # what a user would see
        return f"raises {type(exc).__name__}"
    return "ok"


def on_rank(
    rank: int,
    world: int,
    *,
    counts: tuple[int, ...] = TENSOR_COUNTS,
    rows: int = 32,
    cols: int = 32,
    reps: int = 5,
    steps: int = 3,
) -> dict:
    """Time (ms, slowest rank) and collectives per clip at each tensor count."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    shape = (rows * world, cols)
    out = []
    for n in counts:
        params = _sharded_params(n, shape, mesh)

        def ours(params=params):
            return clip_grad_norm_(params, MAX_NORM)

        def theirs(params=params):
            return torch.nn.utils.clip_grad_norm_(params, MAX_NORM)

        times = _measure.alternate({"ours": ours, "torch": theirs}, reps=reps, steps=steps)
        out.append(
            {
                "tensors": n,
                "time": _measure.compare(times["ours"], times["torch"]),
                "ours_collectives": _count(ours),
                "ours_reported_collectives": ours().num_collectives,
                "torch_collectives": _count(theirs),
            }
        )
    return {
        "world_size": world,
        "tensor_shape": list(shape),
        "rows": out,
        "mixed_sharded_and_plain": {
            "ours": f"ok, {clip_grad_norm_(_mixed(mesh, shape), MAX_NORM).num_collectives} "
            "collective(s)",
            "torch": _torch_on_mixed(mesh, shape),
        },
    }


def _mixed(mesh, shape) -> list[torch.nn.Parameter]:
    plain = torch.nn.Parameter(torch.zeros(shape))
    plain.grad = torch.ones(shape)
    return [*_sharded_params(2, shape, mesh), plain]
