"""How a weight sync's buckets reach the rollout engines: Ray's object store, or a process group.

:func:`~.fleet.sync_weights` hands each bucket of ``ctx.stream_weights`` to
the fleet's transport on the trainer's rank 0 (:meth:`put`) and waits for
the engines at the end (:meth:`finish`); the engines' ``finish_sync`` then
makes the sync theirs (vLLM reloads once per sync there). Both transports
keep at most two buckets in flight.

- :class:`ObjectStoreTransport` (``rollout.transport: object_store``, the
  default): each bucket is put in Ray's object store once and every engine
  loads it (``load_weights``). Any hardware, any node; a bucket crosses
  host memory (and the network to another node) through Ray.
- :class:`CollectiveTransport` (``collective``): a
  :class:`~.weight_group.WeightGroup` of rank 0 and every engine worker,
  over which rank 0 broadcasts each tensor (``receive_weights`` on the
  engines, which allocate its buffer from the bucket's manifest). Its
  backend is the devices': NCCL when the trainer's tensors and every
  engine are on CUDA (no host copies), gloo otherwise. The group is formed
  at the first sync and again whenever an engine reports another (a Ray
  restart leaves it in none): its address goes to the engines in Ray
  calls, the store on the node IP Ray reports for rank 0, so engines on
  other nodes reach it. An engine that dies during a sync fails that sync
  (the object store's loads are retried on the restarted engine instead).
  NCCL wants every member on a GPU of its own: an engine sharing the
  trainer's GPU (colocated) would need CUDA IPC, which is not built.
"""

from __future__ import annotations

import torch

from ray_fsdp_backend.rl import weight_group
from ray_fsdp_backend.rl.weight_group import WeightGroup


class Transport:
    """A sync's buckets to ``engines``: :meth:`put` each (rank 0), then :meth:`finish`."""

    def __init__(self, engines: list) -> None:
        self.engines = engines
        self._in_flight: list[list] = []
        """Per bucket not yet waited for, the engines' calls that take it."""

    def put(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def _wait(self, *, keep: int) -> None:
        """Wait for the engines' calls of all but the last ``keep`` buckets."""
        import ray

        while len(self._in_flight) > keep:
            ray.get(self._in_flight.pop(0))

    def finish(self) -> None:
        """Wait until every engine holds every bucket put."""
        self._wait(keep=0)


class ObjectStoreTransport(Transport):
    """Buckets through Ray's object store: put once, loaded by every engine."""

    def put(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        import ray

        ref = ray.put([(name, tensor.cpu()) for name, tensor in bucket])
        self._in_flight.append([engine.load_weights.remote(ref) for engine in self.engines])
        self._wait(keep=1)


class CollectiveTransport(Transport):
    """Buckets broadcast over a :class:`~.weight_group.WeightGroup` (gloo or NCCL)."""

    def __init__(self, engines: list, *, timeout_s: float = 600.0) -> None:
        super().__init__(engines)
        self.timeout_s = timeout_s
        self.group: WeightGroup | None = None
        self._checked = False

    def put(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        if not self._checked:
            self._connect(bucket[0][1].device)
            self._checked = True
        manifest = WeightGroup.manifest(bucket)
        self._in_flight.append([e.receive_weights.remote(manifest) for e in self.engines])
        self.group.send(bucket)  # the engines receive it in the calls just started
        self._wait(keep=1)

    def finish(self) -> None:
        super().finish()
        self._checked = False  # the next sync asks the engines again

    def _connect(self, device: torch.device) -> None:
        """(Re)form the group unless every engine is in the current one."""
        import ray
        from ray import cloudpickle

        receivers = ray.get([engine.weight_receiver.remote() for engine in self.engines])
        if self.group is not None:
            if all(r["group"] == self.group.address.name for r in receivers):
                return
            self.group.close()
        cuda = device.type == "cuda" and all(r["device"] == "cuda" for r in receivers)
        firsts, size = [], 1  # rank 0 is this process; each engine takes the next ranks
        for receiver in receivers:
            firsts.append(size)
            size += receiver["ranks"]
        cloudpickle.register_pickle_by_value(weight_group)  # engines may lack this package
        host = ray.util.get_node_ip_address()
        group = WeightGroup.open("nccl" if cuda else "gloo", host, size, timeout_s=self.timeout_s)
        joins = [
            engine.join_weight_group.remote(group, first)
            for engine, first in zip(self.engines, firsts, strict=True)
        ]
        self.group = group.join(0, host)
        ray.get(joins)


TRANSPORTS = {"object_store": ObjectStoreTransport, "collective": CollectiveTransport}
"""The transports by ``rollout.transport`` name (the schema checks the name
before Ray starts)."""


def build_transport(name: str, engines: list) -> Transport:
    """The transport ``rollout.transport`` names, for ``engines``.

    Raises:
        ValueError: not one of :data:`TRANSPORTS`."""
    if name not in TRANSPORTS:
        raise ValueError(f"rollout.transport={name!r} is not one of {', '.join(TRANSPORTS)}")
    return TRANSPORTS[name](engines)
