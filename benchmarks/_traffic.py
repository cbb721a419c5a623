"""Bytes each rank sends, counted from the collectives actually issued, and
the model state it holds at its peak.

:class:`TrafficCounter` is a ``TorchDispatchMode``: every collective reaches
torch's dispatcher as a ``c10d`` op (FSDP2's all-gather and reduce-scatter,
``torch.distributed`` calls) or a ``_c10d_functional`` op (the autograd
all-to-all transformers' ``AllToAllEP`` issues, in forward and in backward),
so the mode sees each one with its real tensors and process group, whoever
calls it and however it was imported. Bytes *sent* by this rank, per
collective, as a ring or pairwise exchange moves them:

- all-gather: its input, to each of the ``n - 1`` others: ``input x (n - 1)``;
- reduce-scatter: ``input x (n - 1) / n`` (every chunk but its own);
- all-to-all: every row of its input but the rows it keeps (its own split);
- all-reduce: ``2 x bytes x (n - 1) / n``; broadcast: ``bytes x (n - 1) / n``.

Each is filed under its kind and the name of the process group it ran on
(mapped to a mesh axis name by the caller). The same mode samples, at every
op, the model state beyond the sharded steady state: parameters that are
not the sharded ones (FSDP2's unsharded parameters, with their gradients)
and the collective buffers still alive (all-gather outputs, reduce-scatter
inputs): :attr:`TrafficCounter.peak_transient`.
"""

from __future__ import annotations

import warnings
import weakref
from collections import defaultdict

import torch
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks._measure import local_bytes

KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "broadcast_": "broadcast",
}
"""Collective ops by their dispatcher name, filed under one kind each."""


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _group(bound: dict):
    """The op's process group (a c10d op's argument, or resolved from a
    functional op's group name)."""
    if "process_group" in bound:  # the dispatcher passes the TorchScript box
        group = bound["process_group"]
        return group if isinstance(group, c10d.ProcessGroup) else c10d.ProcessGroup.unbox(group)
    return c10d._resolve_process_group(bound["group_name"])


def _all_to_all_kept(tensor: torch.Tensor, splits, rank: int, size: int) -> int:
    """Bytes of the rows ``rank`` sends to itself."""
    rows = tensor.shape[0] if tensor.dim() else 0
    if not rows:
        return 0
    kept = splits[rank] if len(splits) else rows // size
    return int(kept) * tensor.numel() // rows * tensor.element_size()


SOURCE_ARGS = ("input_tensor", "input_tensors", "input", "inputs", "tensors")
"""The argument holding what a rank contributes, as each op's schema names it."""


def _source(bound: dict):
    return next(bound[name] for name in SOURCE_ARGS if name in bound)


def sent_bytes(kind: str, bound: dict, group) -> int:
    """What this rank sends for one collective (module docstring)."""
    n, rank, source = group.size(), group.rank(), _source(bound)
    if kind == "all_gather":
        return _nbytes(source) * (n - 1)
    if kind == "reduce_scatter":
        return _nbytes(source) * (n - 1) // n
    if kind == "all_to_all":
        return _nbytes(source) - _all_to_all_kept(source, bound["input_split_sizes"], rank, n)
    factor = 2 if kind == "all_reduce" else 1
    return factor * _nbytes(source) * (n - 1) // n


def _buffer(kind: str, bound: dict):
    """The buffer a c10d all-gather fills, or the one a reduce-scatter reads."""
    return bound.get("output_tensor") if kind == "all_gather" else _source(bound)


class TrafficCounter(TorchDispatchMode):
    """Counts the bytes this rank sends (``sent[(kind, group)]``) and the
    calls (``calls[(kind, group)]``) while active; ``group_names`` maps a
    process group's name to a label (a mesh axis), else its size is used.
    With ``model``, also tracks :attr:`peak_transient` (module docstring):
    build it while the model's parameters are all sharded (after wrapping,
    outside forward and backward)."""

    def __init__(self, group_names: dict[str, str], model: nn.Module | None = None):
        super().__init__()
        self.group_names = group_names
        self.sent: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.model = model
        self._sharded = {id(p) for p in model.parameters()} if model is not None else set()
        self._buffers: list[weakref.ref] = []
        self.peak_transient = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = KINDS.get(func._overloadpacket.__name__)
        if kind is not None:
            names = [a.name for a in func._schema.arguments]
            bound = {**dict(zip(names, args, strict=False)), **kwargs}
            group = _group(bound)
            label = self.group_names.get(group.group_name, f"size {group.size()}")
            self.sent[(kind, label)] += sent_bytes(kind, bound, group)
            self.calls[(kind, label)] += 1
        out = func(*args, **kwargs)
        if kind in ("all_gather", "reduce_scatter"):  # FSDP2's flat buffers, while alive
            buffer = out if kind == "all_gather" and "group_name" in bound else None
            for t in _tensors(buffer if buffer is not None else _buffer(kind, bound)):
                self._buffers.append(weakref.ref(t))
        if self.model is not None:
            self.peak_transient = max(self.peak_transient, self._transient())
        return out

    def _transient(self) -> int:
        """Unsharded parameters and their gradients now registered, and the
        collective buffers still alive."""
        params = [p for p in self.model.parameters() if id(p) not in self._sharded]
        with warnings.catch_warnings():  # FSDP2's unsharded parameters may be views
            warnings.simplefilter("ignore", UserWarning)
            grads = [p.grad for p in params if p.grad is not None]
        alive = [(ref, ref()) for ref in self._buffers]
        self._buffers = [ref for ref, t in alive if t is not None]
        buffers = [t for _, t in alive if t is not None]
        return local_bytes(params) + local_bytes(grads) + _nbytes(buffers)

    def by_kind(self, labels: tuple[str, ...] | None = None) -> dict[str, int]:
        """Bytes sent per kind, over ``labels`` (every group when None)."""
        out: dict[str, int] = defaultdict(int)
        for (kind, label), n in self.sent.items():
            if labels is None or label in labels:
                out[kind] += n
        return dict(out)
