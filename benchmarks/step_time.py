"""Comparisons 1 and 2: step time and memory per rank, ours vs hand-written FSDP2.

**A (ours)**: ``build_strategy(cfg)`` (what ``ctx`` delegates to), then
``strategy.wrap(model)``; accumulation micro-batches under
``strategy.no_sync(model)``; ``strategy.clip_grad_norm(model, max_norm,
optimizer=opt)``.

**B (hand-written)**: the same model and data with ``fully_shard`` on every
block then the root, ``model.set_requires_gradient_sync(False)`` for the
accumulation micro-batches and ``torch.nn.utils.clip_grad_norm_``.

Both models start from the same weights and see the same batches; the first
step's losses are compared (``same_loss``) to show that they do the same work.
``hybrid_shard`` uses ``fsdp_hsdp_replicate_size=2`` (a 2 x N/2 mesh), since
one node would make it a 1 x N mesh, i.e. ``full_shard``.

Memory: bytes of parameters, gradients and AdamW state each rank holds after
a step (local shards only; the largest rank), against the ideal total/N and
against DDP, which holds everything on every rank; and the ``ray-fsdp plan``
estimate for the same layout.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from benchmarks import _measure, _workload
from ray_fsdp_backend import FSDPSettings, ShardingStrategy, build_strategy
from ray_fsdp_backend.models.decoder import ModelConfig
from ray_fsdp_backend.planning.memory import ModelSize, estimate_memory

STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard")
CPU = torch.device("cpu")


def config_for(strategy: str | None, world: int) -> FSDPSettings:
    if strategy is None:
        return FSDPSettings(use_fsdp=False, use_mixed_precision=False)
    hybrid = ShardingStrategy(strategy).is_hybrid
    return FSDPSettings(
        use_fsdp=True,
        fsdp_sharding_strategy=strategy,
        use_mixed_precision=False,
        fsdp_hsdp_replicate_size=2 if hybrid and world % 2 == 0 else None,
    )


def _hand_written(model: torch.nn.Module, strategy: str, world: int) -> torch.nn.Module:
    """FSDP2 as its docstring shows it: every block, then the root."""
    if ShardingStrategy(strategy).is_hybrid:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    reshard = ShardingStrategy(strategy).reshard_after_forward
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)


def ours_step(strategy, model, opt, batches) -> float:
    opt.zero_grad()
    last = len(batches) - 1
    for i, (x, y) in enumerate(batches):
        sync = contextlib.nullcontext() if i == last else strategy.no_sync(model)
        with sync:
            loss = _workload.loss_fn(model, x, y) / len(batches)
            loss.backward()
    strategy.clip_grad_norm(model, _workload.MAX_NORM, optimizer=opt)
    opt.step()
    return float(loss.detach())


def _hand_step(model, opt, batches) -> float:
    opt.zero_grad()
    last = len(batches) - 1
    for i, (x, y) in enumerate(batches):
        model.set_requires_gradient_sync(i == last)
        loss = _workload.loss_fn(model, x, y) / len(batches)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), _workload.MAX_NORM)
    opt.step()
    return float(loss.detach())


def _plan_bytes(model: dict, strategy: str | None, shard_size: int) -> int:
    cfg = ModelConfig(**model)
    size = ModelSize(num_params=cfg.num_params(), largest_unit_params=cfg.block_params())
    est = estimate_memory(
        size,
        ShardingStrategy(strategy) if strategy else None,
        shard_size,
        mixed_precision=False,
    )
    return est.params + est.grads + est.optimizer


def _compare_one(rank, world, strategy, *, model, batch, accum, reps, steps) -> dict:
    batches = _workload.make_batches(model, batch, accum, rank)
    ours_strategy = build_strategy(config_for(strategy, world), device=CPU, local_rank=rank)
    ours = ours_strategy.wrap(_workload.build_model(model))
    hand = _hand_written(_workload.build_model(model), strategy, world)
    ours_opt, hand_opt = _workload.make_optimizer(ours), _workload.make_optimizer(hand)
    first = (ours_step(ours_strategy, ours, ours_opt, batches), _hand_step(hand, hand_opt, batches))
    times = _measure.alternate(
        {
            "ours": lambda: ours_step(ours_strategy, ours, ours_opt, batches),
            "hand": lambda: _hand_step(hand, hand_opt, batches),
        },
        reps=reps,
        steps=steps,
        warmup=0,
    )
    shard = world // 2 if ShardingStrategy(strategy).is_hybrid and world % 2 == 0 else world
    return {
        "strategy": strategy,
        "mesh": list(ours_strategy.mesh.mesh.shape),
        "same_loss": abs(first[0] - first[1]) <= 1e-5 * max(1.0, abs(first[1])),
        "time": _measure.compare(times["ours"], times["hand"]),
        "memory": {
            "ours": _measure.state_bytes(ours, ours_opt),
            "hand": _measure.state_bytes(hand, hand_opt),
            "shard_size": shard,
            "plan_estimate": _plan_bytes(model, strategy, shard),
        },
        "raw_s": times,
    }


def _ddp_memory(rank, world, *, model, batch, accum) -> dict:
    strategy = build_strategy(config_for(None, world), device=CPU, local_rank=rank)
    wrapped = strategy.wrap(_workload.build_model(model))
    opt = _workload.make_optimizer(wrapped)
    ours_step(strategy, wrapped, opt, _workload.make_batches(model, batch, accum, rank))
    return {
        "ours": _measure.state_bytes(wrapped, opt),
        "unsharded_param_bytes": _measure.full_param_bytes(wrapped),
        "plan_estimate": _plan_bytes(model, None, 1),
    }


def on_rank(
    rank: int,
    world: int,
    *,
    model: dict,
    batch: int,
    accum: int,
    reps: int,
    steps: int,
    strategies: tuple[str, ...] = STRATEGIES,
) -> dict:
    """Every strategy's A/B comparison and DDP's memory at this world size."""
    rows = [
        _compare_one(rank, world, s, model=model, batch=batch, accum=accum, reps=reps, steps=steps)
        for s in strategies
    ]
    ddp = _ddp_memory(rank, world, model=model, batch=batch, accum=accum)
    ddp_total = sum(ddp["ours"].values())
    for row in rows:
        mem = row["memory"]
        total = sum(mem["ours"].values())
        mem["total_per_rank"] = total
        mem["ideal_total_over_n"] = ddp_total / world
        mem["vs_ideal"] = total / (ddp_total / world)
        mem["vs_ddp"] = total / ddp_total
    return {
        "world_size": world,
        "model": model,
        "batch": batch,
        "accum": accum,
        "strategies": rows,
        "ddp": {**ddp, "total_per_rank": ddp_total},
    }
