"""What every comparison shares: A/B timing, collective counting, bytes per rank.

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
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


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


class CollectiveCounter:
    """Counts collectives issued while active, in this process only.

    Patches the ``torch.distributed`` calls (what our code issues) and the
    functional collectives DTensor issues when it redistributes (what
    ``torch.nn.utils.clip_grad_norm_`` issues on DTensors). A collective
    called from inside another counted one is not counted twice.
    """

    _C10D = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
             "broadcast", "all_to_all_single", "all_reduce_coalesced")  # fmt: skip
    _FUNCOL = ("all_reduce", "all_reduce_coalesced", "all_gather_single", "all_gather_tensor",
               "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all_single",
               "broadcast")  # fmt: skip

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._depth = 0
        self._saved: list[tuple[object, str, Callable]] = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def counted(*args, **kwargs):
            if self._depth == 0:
                self.counts[name] = self.counts.get(name, 0) + 1
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def __enter__(self) -> CollectiveCounter:
        for module, names in ((dist, self._C10D), (c10d, self._C10D), (funcol, self._FUNCOL)):
            for name in names:
                fn = getattr(module, name, None)
                if fn is not None:
                    self._saved.append((module, name, fn))
                    setattr(module, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()


class FunctionalCollectiveLog(TorchDispatchMode):
    """Records the functional collectives issued while active (DTensor's,
    i.e. tensor parallelism's; FSDP2's own c10d calls are not seen): each as
    ``(phase, kind, group ranks, input bytes)``, ``phase`` being whatever
    :attr:`phase` was set to when it was issued. A group is known by its
    ranks: two meshes over the same ranks may name their groups apart."""

    KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter"}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.seen: list[tuple[str, str, tuple[int, ...], int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = self.KINDS.get(func._overloadpacket.__name__)
        if func.namespace == "_c10d_functional" and kind is not None:
            group = args[-1]  # each takes its group (a name, torch 2.13) last
            if isinstance(group, str):
                group = c10d._resolve_process_group(group)
            ranks = tuple(dist.get_process_group_ranks(group))
            self.seen.append((self.phase, kind, ranks, args[0].nbytes))
        return func(*args, **(kwargs or {}))

    @staticmethod
    def ring_bytes(kind: str, group_size: int, input_bytes: int) -> float:
        """Bytes one rank sends for one collective in a ring: ``(T - 1) / T``
        of the whole tensor per all-gather (whose input is one rank's shard)
        or reduce-scatter, twice that per all-reduce."""
        share = (group_size - 1) / group_size
        whole = input_bytes * group_size if kind == "all_gather" else input_bytes
        return whole * share * (2 if kind == "all_reduce" else 1)

    def sent(self, ranks: tuple[int, ...] | None = None) -> float:
        """Bytes this rank sent (ring), over the group of ``ranks`` only if given."""
        return sum(
            self.ring_bytes(kind, len(group), nbytes)
            for _, kind, group, nbytes in self.seen
            if ranks is None or group == ranks
        )


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
