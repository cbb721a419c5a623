"""Comparison 7: step time with ``compile: true`` vs eager, FSDP2 full_shard.

**A (compiled)**: ``FSDPConfig(compile=True)``: every block goes through
``torch.compile`` (``Module.compile()``) before ``fully_shard``, as torchtitan
does. **B (eager)**: the same config with ``compile=False``. Same model,
weights and batches; the first step's losses are compared (``same_loss``,
fp32, 1e-5 relative). The first compiled step includes compilation (Inductor
C++ on CPU, Triton on GPU) and is reported apart as ``compile_s``; the timed
steps come after one warm-up step on each side.

On CPU, Inductor fuses the element-wise work between matmuls (RMSNorm,
rotary, SwiGLU); the matmuls themselves stay in the same kernels, so the
gain depends on how much of the step is element-wise.
"""

from __future__ import annotations

import time

import torch

from benchmarks import _measure, _workload
from benchmarks.step_time import ours_step
from ray_fsdp_backend import FSDPSettings, build_strategy

CPU = torch.device("cpu")


def on_rank(rank: int, world: int, *, model: dict, batch: int, accum: int, reps: int, steps: int):
    batches = _workload.make_batches(model, batch, accum, rank)
    runs, first, compile_s = {}, {}, None
    for name, compiled in (("compiled", True), ("eager", False)):
        cfg = FSDPSettings(use_fsdp=True, use_mixed_precision=False, compile=compiled)
        strategy = build_strategy(cfg, device=CPU, local_rank=rank)
        wrapped = strategy.wrap(_workload.build_model(model))
        opt = _workload.make_optimizer(wrapped)
        start = time.perf_counter()
        first[name] = ours_step(strategy, wrapped, opt, batches)
        if compiled:
            compile_s = _measure.max_over_ranks([time.perf_counter() - start])[0]
        runs[name] = (strategy, wrapped, opt)
    times = _measure.alternate(
        {name: (lambda r=r: ours_step(r[0], r[1], r[2], batches)) for name, r in runs.items()},
        reps=reps,
        steps=steps,
    )
    return {
        "world_size": world,
        "model": model,
        "time": _measure.compare(times["compiled"], times["eager"]),
        "compile_s": compile_s,
        "same_loss": abs(first["compiled"] - first["eager"]) <= 1e-5 * abs(first["eager"]),
    }
