"""Both ends of the collective weight sync: a process group of the trainer's rank 0 and the engines.

A :class:`WeightGroup` is a torch process group of its own, built from a
``TCPStore`` that the trainer's rank 0 opens on the address Ray reports for
its node, and ``ProcessGroupGloo`` (host tensors) or ``ProcessGroupNCCL``
(CUDA tensors) constructed on that store directly: the trainer's default
process group, and every group its mesh built, are never touched, and the
engines never join them. Rank 0 is the trainer's; each engine takes the
next ranks (one per vLLM worker: tensor-parallel workers each receive the
full tensors their loader shards).

Each bucket of ``ctx.stream_weights`` goes in two parts: its
:meth:`manifest` (names, dtypes, shapes: a few bytes, in the Ray call that
starts the engine's receive), then each tensor broadcast from rank 0 into a
buffer the engine allocates from the manifest (on the CPU for gloo, on its
GPU for NCCL). The broadcasts of a bucket are issued at once and waited
together; each tensor travels as its bytes (``uint8``), so any dtype does.

The trainer sends the engines this object (its address: the connection
stays in the process that joined), pickled by value
(:mod:`.transport`): one copy of the wire's code at both ends, in any
Python environment. So this module imports only torch.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch

Manifest = list[tuple[str, str, list[int]]]
"""``[(name, dtype name, shape), ...]`` of one bucket, in its order."""


@dataclass(frozen=True)
class GroupAddress:
    """Where and how to join a weight group (what travels to the engines)."""

    host: str
    """The node IP of the trainer's rank 0 (its ``TCPStore``)."""
    port: int
    size: int
    """Ranks: the trainer's rank 0 and every engine worker."""
    backend: str
    """``gloo`` | ``nccl``."""
    name: str
    """This group's id: an engine that reports another (or none) rejoins."""
    timeout_s: float = 600.0


class WeightGroup:
    """One member of a weight group: :meth:`open` on the trainer's rank 0,
    :meth:`join` on each engine worker with the object rank 0 opened."""

    def __init__(self, address: GroupAddress) -> None:
        self.address = address
        self._store = None
        self._group = None

    @classmethod
    def open(cls, backend: str, host: str, size: int, *, timeout_s: float = 600.0):
        """Rank 0's end: a ``TCPStore`` listening on ``host`` (a free port),
        the group formed at :meth:`join`."""
        from torch.distributed import TCPStore

        timeout = timedelta(seconds=timeout_s)
        store = TCPStore(host, 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
        group = cls(GroupAddress(host, store.port, size, backend, uuid.uuid4().hex, timeout_s))
        group._store = store
        return group

    def __getstate__(self) -> dict:
        return {"address": self.address}  # the connection stays in its process

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["address"])

    @property
    def device(self) -> torch.device:
        """Where this member's tensors travel from or to."""
        if self.address.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")  # host: gloo moves host tensors

    def join(self, rank: int, node_ip: str) -> WeightGroup:
        """Form the group as ``rank`` (0: the trainer's, on the store it
        opened); blocks until every rank has joined. ``node_ip``: this
        process's node address, for gloo's connections."""
        from torch.distributed import TCPStore

        a = self.address
        timeout = timedelta(seconds=a.timeout_s)
        if self._store is None:
            self._store = TCPStore(a.host, a.port, a.size, is_master=False, timeout=timeout)
        if a.backend == "nccl":
            from torch.distributed import ProcessGroupNCCL  # CUDA builds only

            options = ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = ProcessGroupNCCL(self._store, rank, a.size, options)
        else:
            from torch.distributed import ProcessGroupGloo

            options = ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [ProcessGroupGloo.create_device(hostname=node_ip)]
            self._group = ProcessGroupGloo(self._store, rank, a.size, options)
        return self

    @staticmethod
    def manifest(bucket: list[tuple[str, torch.Tensor]]) -> Manifest:
        return [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in bucket]

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Rank 0: broadcast each tensor of ``bucket`` (the engines receive
        its :meth:`manifest`)."""
        self._broadcast([t.to(self.device) for _, t in bucket])

    def receive(self, manifest: Manifest) -> list[tuple[str, torch.Tensor]]:
        """An engine worker: the bucket ``manifest`` describes, received
        into tensors allocated here (on :attr:`device`)."""
        tensors = [
            torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            for _, dtype, shape in manifest
        ]
        self._broadcast(tensors)
        return [(name, t) for (name, _, _), t in zip(manifest, tensors, strict=True)]

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        from torch.distributed import BroadcastOptions

        if self._group is None:
            raise RuntimeError(f"weight group {self.address.name}: not joined")
        options = BroadcastOptions()
        options.rootRank = 0
        works = [
            self._group.broadcast([t.contiguous().view(-1).view(torch.uint8)], options)
            for t in tensors
            if t.numel()
        ]
        for work in works:
            work.wait()

    def close(self) -> None:
        """Leave the group (its connections and the store closed)."""
        self._group = self._store = None
