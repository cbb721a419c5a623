"""The collectives a rank issues, recorded as they reach torch's dispatcher:
how many, of which kind, on which group, in which phase, and the bytes sent.

:class:`CollectiveLog` is a ``TorchDispatchMode``: every collective reaches
the dispatcher as a ``c10d`` op (FSDP2's all-gather and reduce-scatter,
``torch.distributed`` calls) or a ``_c10d_functional`` op (DTensor's
redistributions, i.e. tensor parallelism's and a DTensor clip's, and the
autograd all-to-all transformers' ``AllToAllEP`` issues), so the mode sees
each one with its real tensors and process group, whoever calls it and
however it was imported. A mode sees an op before a tensor subclass does and
runs it with itself off, so the mode hands a DTensor's op back to DTensor
(``NotImplemented``): DTensor's dispatch then runs with the mode on, and the
collectives it issues inside (the all-reduce of a ``Partial`` norm in
``torch.nn.utils.clip_grad_norm_``) are recorded. A collective runs with the
mode off, so whatever it issues inside (a functional collective's own
``c10d`` call) is not recorded again: one record per collective issued. Bytes *sent* by this rank,
per collective, as a ring or pairwise exchange moves them:

- all-gather: its input, to each of the ``n - 1`` others: ``input x (n - 1)``;
- reduce-scatter: ``input x (n - 1) / n`` (every chunk but its own);
- all-to-all: every row of its input but the rows it keeps (its own split);
- all-reduce: ``2 x bytes x (n - 1) / n``; broadcast: ``bytes x (n - 1) / n``.

Each record names its group by a label (``group_names`` maps a process
group's name to one, e.g. a mesh axis; else ``"size n"``) and by its ranks
(two meshes over the same ranks may name their groups apart), and carries
the :attr:`CollectiveLog.phase` set when it was issued. Given ``model``, the
same mode samples, at every op, the model state beyond the sharded steady
state: parameters that are not the sharded ones (FSDP2's unsharded
parameters, with their gradients) and the collective buffers still alive
(all-gather outputs, reduce-scatter inputs): :attr:`CollectiveLog.peak_transient`.
"""

from __future__ import annotations

import warnings
import weakref
from collections import Counter
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.distributed.tensor import DTensor
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
    "broadcast": "broadcast",
}
"""Collective ops by their dispatcher name (``c10d`` and ``_c10d_functional``),
filed under one kind each."""

SOURCE_ARGS = ("input_tensor", "input_tensors", "input", "inputs", "tensors")
"""The argument holding what a rank contributes, as each op's schema names it."""


class Collective(NamedTuple):
    """One collective this rank issued."""

    phase: str | None
    kind: str
    group: str
    ranks: tuple[int, ...]
    sent: int


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


def _source(bound: dict):
    return next(bound[name] for name in SOURCE_ARGS if name in bound)


def _all_to_all_kept(tensor: torch.Tensor, splits, rank: int, size: int) -> int:
    """Bytes of the rows ``rank`` sends to itself."""
    rows = tensor.shape[0] if tensor.dim() else 0
    if not rows:
        return 0
    kept = splits[rank] if len(splits) else rows // size
    return int(kept) * tensor.numel() // rows * tensor.element_size()


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


class CollectiveLog(TorchDispatchMode):
    """Records every collective issued while active (:attr:`records`, one
    :class:`Collective` each, module docstring); set :attr:`phase` to file
    the next ones under it. ``group_names`` maps a process group's name to
    its label. With ``model``, also tracks :attr:`peak_transient`: build the
    log while the model's parameters are all sharded (after wrapping,
    outside forward and backward)."""

    def __init__(
        self,
        group_names: dict[str, str] | None = None,
        model: nn.Module | None = None,
        phase: str | None = None,
    ):
        super().__init__()
        self.group_names = group_names or {}
        self.phase = phase
        self.records: list[Collective] = []
        self.model = model
        self._sharded = {id(p) for p in model.parameters()} if model is not None else set()
        self._buffers: list[weakref.ref] = []
        self.peak_transient = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = KINDS.get(func._overloadpacket.__name__)
        if kind is None and any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor dispatches it, issuing collectives we see
        if kind is not None:
            names = [a.name for a in func._schema.arguments]
            bound = {**dict(zip(names, args, strict=False)), **kwargs}
            self._record(kind, bound)
        out = func(*args, **kwargs)
        if kind in ("all_gather", "reduce_scatter"):  # FSDP2's flat buffers, while alive
            buffer = out if kind == "all_gather" and "group_name" in bound else None
            for t in _tensors(buffer if buffer is not None else _buffer(kind, bound)):
                self._buffers.append(weakref.ref(t))
        if self.model is not None:
            self.peak_transient = max(self.peak_transient, self._transient())
        return out

    def _record(self, kind: str, bound: dict) -> None:
        group = _group(bound)
        label = self.group_names.get(group.group_name, f"size {group.size()}")
        ranks = tuple(dist.get_process_group_ranks(group))
        sent = sent_bytes(kind, bound, group)
        self.records.append(Collective(self.phase, kind, label, ranks, sent))

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

    def calls(self, *fields: str) -> Counter:
        """How many collectives, by the record ``fields`` named (a tuple key
        per record; the bare value when one field is named)."""
        return Counter(self._key(r, fields) for r in self.records)

    def sent(self, *fields: str) -> Counter:
        """Bytes this rank sent, by the record ``fields`` named (as :meth:`calls`)."""
        out: Counter = Counter()
        for r in self.records:
            out[self._key(r, fields)] += r.sent
        return out

    @staticmethod
    def _key(record: Collective, fields: tuple[str, ...]):
        key = tuple(getattr(record, f) for f in fields)
        return key[0] if len(key) == 1 else key
