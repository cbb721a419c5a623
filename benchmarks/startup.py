"""Comparison 4: start-up, from ``fit()`` to the end of the first training step.

**A (ours)**: ``TorchTrainer(torch_config=FSDPConfig(...))``; the loop calls
``ctx.wrap(model)`` and runs one step.

**B (Ray's built-in)**: ``TorchTrainer(torch_config=TorchConfig(backend="gloo"))``;
the loop builds the mesh with ``init_device_mesh`` and calls ``fully_shard``
on every block and the root by hand, then runs the same step.

Each fit runs on one local Ray cluster shared by all of them, A and B
alternating; the time is measured by the driver's and the workers' wall
clocks (the same machine), from just before ``fit()`` to rank 0's end of the
first step. Both include starting the worker actors, which Ray does alike
for both; the difference is what our backend adds (topology, mesh, strategy).
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks import _workload


def _first_step(model: torch.nn.Module, cfg: dict) -> None:
    opt = _workload.make_optimizer(model)
    (x, y), *_ = _workload.make_batches(cfg["model"], cfg["batch"], 1, 0)
    _workload.loss_fn(model, x, y).backward()
    opt.step()


def _ours(cfg: dict) -> float:
    import ray_fsdp_backend as rfb

    ctx = rfb.get_context()
    model = ctx.wrap(_workload.build_model(cfg["model"]))
    _first_step(model, cfg)
    return time.time()


def _hand(cfg: dict) -> float:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    model = _workload.build_model(cfg["model"])
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _first_step(model, cfg)
    return time.time()


def _fit_seconds(loop, torch_config, cfg: dict, workers: int) -> float:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        loop,
        train_loop_config=cfg,
        torch_config=torch_config,
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(storage_path=cfg["storage"]),
    )
    start = time.time()
    return trainer.fit().return_value - start


def run(*, model: dict, batch: int, workers: int, reps: int, warmup: bool, storage: str) -> dict:
    """Seconds from ``fit()`` to the first step, ours and Ray's, alternating.

    With ``warmup`` one fit of each runs first and is not counted (the first
    fit on a new cluster also pays for cold caches). Needs a running Ray
    (``ray.init``) with ``workers`` CPUs free.
    """
    from ray.train.torch import TorchConfig

    from ray_fsdp_backend import FSDPConfig

    cfg = {"model": model, "batch": batch, "storage": storage}
    candidates = {
        "ours": (_ours, FSDPConfig(use_fsdp=True, use_mixed_precision=False)),
        "ray_torch_config": (_hand, TorchConfig(backend="gloo")),
    }
    if warmup:
        for loop, torch_config in candidates.values():
            _fit_seconds(loop, torch_config, cfg, workers)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for rep in range(reps):
        names = list(candidates) if rep % 2 == 0 else list(candidates)[::-1]
        for name in names:
            loop, torch_config = candidates[name]
            times[name].append(_fit_seconds(loop, torch_config, cfg, workers))
    ours, theirs = (statistics.median(times[n]) for n in candidates)
    return {
        "workers": workers,
        "reps": reps,
        "warmup": warmup,
        "ours_s": ours,
        "ray_torch_config_s": theirs,
        "extra_s": ours - theirs,
        "raw_s": times,
    }
