"""Comparison 6: how step time and memory per rank grow with the work.

The example decoder under our FSDP2 path (``full_shard``, 2 ranks), as the
width doubles at a fixed depth and as the number of layers doubles at a fixed
width. Each size is reported with its parameter count and training FLOPs per
step relative to the smallest size of its series, beside its step time and
bytes per rank relative to the same: linear growth means the time ratio
follows the FLOP ratio, and memory follows the parameter ratio. At the small
CPU sizes a fixed per-step cost (Python, collective latency) makes time grow
more slowly than FLOPs.
"""

from __future__ import annotations

import statistics

import torch

from benchmarks import _measure, _workload
from benchmarks.step_time import config_for, ours_step
from ray_fsdp_backend import build_strategy
from ray_fsdp_backend.models.decoder import ModelConfig


def _series(base: dict, key: str, values: tuple[int, ...]) -> list[dict]:
    return [{**base, key: v} for v in values]


def on_rank(
    rank: int,
    world: int,
    *,
    base: dict,
    widths: tuple[int, ...],
    layers: tuple[int, ...],
    batch: int,
    accum: int,
    reps: int,
    steps: int,
) -> dict:
    """Both series; every size's steps alternate with the others' (round robin)."""
    series = {"width": _series(base, "dim", widths), "layers": _series(base, "n_layers", layers)}
    out = {}
    for name, models in series.items():
        runs = {}
        for i, model in enumerate(models):
            strategy = build_strategy(config_for("full_shard", world), device=torch.device("cpu"),
                                      local_rank=rank)  # fmt: skip
            wrapped = strategy.wrap(_workload.build_model(model))
            opt = _workload.make_optimizer(wrapped)
            batches = _workload.make_batches(model, batch, accum, rank)
            runs[str(i)] = (model, strategy, wrapped, opt, batches)
        times = _measure.alternate(
            {k: (lambda r=r: ours_step(r[1], r[2], r[3], r[4])) for k, r in runs.items()},
            reps=reps,
            steps=steps,
        )
        out[name] = _rows(runs, times, batch * accum * world)
    return {"world_size": world, "strategy": "full_shard", "series": out}


def _rows(runs: dict, times: dict, tokens_per_step_over_seq: int) -> list[dict]:
    rows = []
    for key, (model, _, wrapped, opt, _) in runs.items():
        cfg = ModelConfig(**model)
        mem = _measure.state_bytes(wrapped, opt)
        rows.append(
            {
                "dim": cfg.dim,
                "n_layers": cfg.n_layers,
                "params": cfg.num_params(),
                "flops_per_step": cfg.flops_per_token() * cfg.seq_len * tokens_per_step_over_seq,
                "step_ms": 1e3 * statistics.median(times[key]),
                "bytes_per_rank": sum(mem.values()),
            }
        )
    first = rows[0]
    for row in rows:
        row["flops_ratio"] = row["flops_per_step"] / first["flops_per_step"]
        row["time_ratio"] = row["step_ms"] / first["step_ms"]
        row["params_ratio"] = row["params"] / first["params"]
        row["memory_ratio"] = row["bytes_per_rank"] / first["bytes_per_rank"]
    return rows
