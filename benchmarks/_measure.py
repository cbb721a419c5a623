"""What every comparison shares: A/B timing and bytes per rank (collectives:
:mod:`benchmarks._collectives`).

Timing: candidates run in blocks of ``steps`` calls, in alternating order
(A B, B A, A B, ...), so that load drifting on a shared machine hits both
alike. A block's time is the slowest rank's; summaries are medians, and the
ratio is the median of the per-repetition ratios A/B (each from two adjacent
blocks).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def max_over_ranks(values: list[float]) -> list[float]:
    """Element-wise maximum over all ranks (the slowest rank sets the pace)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def one_thread(rank: int, world: int, fn, kwargs: dict) -> dict:
    """``fn(rank, world, **kwargs)`` with one intra-op thread: on a shared
    machine, OpenMP threads that wait for a busy core make timings meaningless."""
    torch.set_num_threads(1)
    return fn(rank, world, **kwargs)


def alternate(
    candidates: dict[str, Callable[[], object]], *, reps: int, steps: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds per call of each candidate, one value per repetition (slowest rank).

    Each candidate is called ``warmup`` times first; then for every repetition
    each runs ``steps`` calls in a row, the order reversed every repetition.
    Every rank must call this with the same candidates.
    """
    names = list(candidates)
    for name in names:
        for _ in range(warmup):
            candidates[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            barrier()
            start = time.perf_counter()
            for _ in range(steps):
                candidates[name]()
            barrier()
            times[name].append((time.perf_counter() - start) / steps)
    return {name: max_over_ranks(values) for name, values in times.items()}


def compare(a: list[float], b: list[float]) -> dict:
    """Medians (ms) of two alternated series and the median paired ratio a/b."""
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return {
        "a_ms": 1e3 * statistics.median(a),
        "b_ms": 1e3 * statistics.median(b),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "reps": len(ratios),
    }


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank stores for ``tensors`` (a DTensor's local shard only;
    an NF4 tensor's codes, scales and factors as stored)."""
    total = 0
    for t in tensors:
        local = t._local_tensor if isinstance(t, DTensor) else t
        inner = [getattr(local, n) for n in NF4_PARTS] if hasattr(local, "quantized_data") else []
        total += sum(x.numel() * x.element_size() for x in inner or [local])
    return total


NF4_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor")


def unique_params(model: nn.Module) -> list[nn.Parameter]:
    seen: set[int] = set()
    return [p for p in model.parameters() if not (id(p) in seen or seen.add(id(p)))]


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameters, gradients and optimizer state this rank holds (max over ranks)."""
    params = unique_params(model)
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    values = [
        local_bytes(params),
        local_bytes(p.grad for p in params if p.grad is not None),
        local_bytes(state),
    ]
    values = [int(v) for v in max_over_ranks([float(v) for v in values])]
    return dict(zip(("params", "grads", "optimizer"), values, strict=True))


def full_param_bytes(model: nn.Module) -> int:
    """Bytes of all (unsharded) parameters, each tied weight once."""
    return sum(p.numel() * p.element_size() for p in unique_params(model))


def run_sides(run_ranks, on_rank, world: int, path: str, sides, *args, one_spawn: bool = False):
    """``{side: on_rank(rank, world, path, side, *args)}`` (rank 0's result).

    One spawned job per side, so that each side's memory high-water mark is
    its own (a process's cannot be reset); with ``one_spawn`` (the ``--quick``
    smoke run) every side runs in one job, in order: a spawn per world size
    instead of one per side, its peaks no longer isolated (the smoke run
    checks what the tensors hold, never the peaks)."""
    if one_spawn:
        return run_ranks(_sides_on_rank, world, on_rank, path, tuple(sides), args)
    return {side: run_ranks(on_rank, world, path, side, *args) for side in sides}


def _sides_on_rank(rank: int, world: int, on_rank, path: str, sides: tuple, args: tuple) -> dict:
    return {side: on_rank(rank, world, path, side, *args) for side in sides}
