"""Ray Data split by data-parallel rank: ``rfb.MeshDataConfig``.

Ray Train's default ``DataConfig`` gives every *world* rank its own
``streaming_split``. Under tensor or context parallelism the ranks of one tp /
cp group must read the same rows, and the data-parallel groups disjoint ones.
Pass ``TorchTrainer(..., dataset_config=rfb.MeshDataConfig())`` and
``ray.train.get_dataset_shard(name)`` gives exactly that, with no change to
the training loop:

- the dataset is split into ``dp_size`` streams (``streaming_split(dp_size,
  equal=True)``), one per data-parallel group;
- one coordinator actor reads each group's stream once and hands every rank
  of the group the same blocks, in the same order (``MeshSplitCoordinator``:
  the group shares one stream; a block is an object-store reference, so each
  rank of the group maps the same block from its node's object store rather
  than receiving a copy through the coordinator).

Which group a rank belongs to is the rank's own ``ctx.dp_rank`` /
``ctx.dp_size``, reported by the rank when it first iterates: the split
follows the mesh the backend built for this attempt, so an elastic restart at
a new size splits by the new dp size. Without an ``FSDPConfig`` context (a
plain ``TorchConfig``) every rank is its own group, as with Ray's
``DataConfig``.

Cost per step: one extra actor call per block per rank (a few hundred
microseconds) and no data copied beyond Ray's own: the blocks are read once per
group and mapped by each rank of it (same node: shared memory).

This relies on the protocol between Ray 2.60's ``StreamSplitDataIterator`` and
its ``SplitCoordinator`` (``start_epoch``, ``get``, ``notify_split_finished``,
``stats``, ``get_dataset_schema``, ``get_dataset_context``,
``get_dataset_tag``, ``shutdown_executor``): the coordinator here speaks it
to the ranks and to Ray's coordinator of the ``dp_size`` streams.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import ray
from ray.data._internal.iterator.stream_split_iterator import StreamSplitDataIterator
from ray.train import DataConfig


class MeshDataConfig(DataConfig):
    """``ray.train.DataConfig`` that splits datasets by data-parallel rank.

    Takes ``DataConfig``'s arguments (``datasets_to_split``,
    ``execution_options``, ``enable_shard_locality``). Datasets not split are
    given whole to every rank, as by ``DataConfig``.
    """

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        """One :class:`MeshShardIterator` per world rank for each split dataset."""
        output = [{} for _ in range(world_size)]
        split = set(datasets) if self._datasets_to_split == "all" else set(self._datasets_to_split)
        hints = worker_node_ids if self._enable_shard_locality else None
        for name, ds in datasets.items():
            if ds.name is None:
                ds.set_name(name)
            ds = ds.copy(ds)
            ds.context.execution_options = self._resolve_execution_options(name)
            if name in split:
                shards = MeshShardIterator.create(ds, world_size, hints)
            else:
                shards = [ds.iterator() for _ in range(world_size)]
            for rank, shard in enumerate(shards):
                output[rank][name] = shard
        return output


class MeshShardIterator(StreamSplitDataIterator):
    """One rank's ``DataIterator``: Ray's split iterator, talking to a
    :class:`MeshSplitCoordinator` with the world rank as its split index; it
    reports the rank's data-parallel coordinates before its first epoch."""

    @staticmethod
    def create(ds, world_size: int, hints) -> list[MeshShardIterator]:
        coord = MeshSplitCoordinator.options(
            max_concurrency=2 * world_size + 2,
            label_selector={ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()},
        ).remote(ds, world_size, hints)
        return [MeshShardIterator(coord, rank, world_size) for rank in range(world_size)]

    def __init__(self, coord_actor, world_rank: int, world_size: int) -> None:
        super().__init__(coord_actor, world_rank, world_size)
        self._joined = False

    def _to_ref_bundle_iterator(self):
        if not self._joined:
            dp_rank, dp_size = _data_parallel_coordinates(self._output_split_idx, self._world_size)
            ray.get(self._coord_actor.join.remote(self._output_split_idx, dp_rank, dp_size))
            self._joined = True
        return super()._to_ref_bundle_iterator()


def _data_parallel_coordinates(world_rank: int, world_size: int) -> tuple[int, int]:
    """This process's ``(dp_rank, dp_size)``; every rank its own group
    without the backend's context."""
    from ray_fsdp_backend.runtime.context import get_context

    try:
        ctx = get_context()
    except RuntimeError:
        return world_rank, world_size
    return ctx.dp_rank, ctx.dp_size


class _GroupStream:
    """One data-parallel group's stream: each block is read from Ray once and
    kept until every rank of the group has taken it."""

    def __init__(self, split: int, ranks: list[int]) -> None:
        self.split, self.ranks, self.lock = split, ranks, threading.Lock()
        self.epochs: list[int] = []  # Ray's epoch ids, in the order started
        self.started: dict[int, int] = defaultdict(int)  # rank -> epochs started
        self.read: dict[int, int] = defaultdict(int)  # epoch -> blocks read from Ray
        self.taken: dict[tuple[int, int], int] = defaultdict(int)  # (epoch, rank) -> next block
        self.blocks: dict[tuple[int, int], list] = {}  # (epoch, index) -> [block, ranks to take]
        self.done: dict[int, set[int]] = defaultdict(set)  # epoch -> ranks finished


@ray.remote(num_cpus=0)
class MeshSplitCoordinator:
    """Serves ``world_size`` ranks from ``dp_size`` streams of Ray's
    ``streaming_split``: the ranks of a data-parallel group share a stream.

    Speaks Ray's ``SplitCoordinator`` protocol with split index = world rank.
    The streams are created once every rank has joined with its ``(dp_rank,
    dp_size)``; locality hints put each stream on its group's node.
    """

    def __init__(self, dataset, world_size: int, hints) -> None:
        self._dataset, self._world_size, self._hints = dataset, world_size, hints
        self._joined: dict[int, tuple[int, int]] = {}
        self._ready = threading.Condition()
        self._coord = None  # Ray's coordinator of the dp_size streams, once all joined
        self._error: ValueError | None = None
        self._groups: dict[int, _GroupStream] = {}  # world rank -> its group's stream

    def join(self, rank: int, dp_rank: int, dp_size: int) -> None:
        """Block until all ranks have joined, then split by their dp ranks."""
        with self._ready:
            self._joined[rank] = (dp_rank, dp_size)
            if len(self._joined) == self._world_size:
                try:
                    self._start_streams(compute_data_parallel_groups(self._joined))
                except ValueError as exc:
                    self._error = exc
                self._ready.notify_all()
            self._ready.wait_for(lambda: self._coord is not None or self._error is not None)
            if self._error is not None:
                raise self._error

    def _start_streams(self, members: list[list[int]]) -> None:
        hints = [self._hints[ranks[0]] for ranks in members] if self._hints else None
        streams = self._dataset.streaming_split(len(members), equal=True, locality_hints=hints)
        self._coord = streams[0]._coord_actor
        for split, ranks in enumerate(members):
            stream = _GroupStream(split, ranks)
            self._groups.update(dict.fromkeys(ranks, stream))

    def start_epoch(self, rank: int) -> int:
        """The group's next epoch: its first rank to arrive starts it in Ray's
        coordinator (a barrier over all streams); the others get its id."""
        g = self._groups[rank]
        with g.lock:
            n = g.started[rank]
            g.started[rank] += 1
            if n == len(g.epochs):
                g.epochs.append(ray.get(self._coord.start_epoch.remote(g.split)))
            return g.epochs[n]

    def get(self, epoch: int, rank: int, prefetched_bytes: int = 0):
        """The rank's next block of ``epoch`` (None at the end), read from
        Ray's stream by the first rank of the group that asks for it."""
        g = self._groups[rank]
        with g.lock:
            index = g.taken[(epoch, rank)]
            g.taken[(epoch, rank)] = index + 1
            if index == g.read[epoch]:
                block = ray.get(self._coord.get.remote(epoch, g.split, prefetched_bytes))
                g.blocks[(epoch, index)] = [block, len(g.ranks)]
                g.read[epoch] += 1
            entry = g.blocks[(epoch, index)]
            entry[1] -= 1
            if not entry[1]:
                del g.blocks[(epoch, index)]
            return entry[0]

    def notify_split_finished(self, epoch: int, rank: int) -> None:
        """Forwarded to Ray once every rank of the group is done with ``epoch``
        (its blocks are dropped then)."""
        g = self._groups[rank]
        with g.lock:
            g.done[epoch].add(rank)
            if len(g.done[epoch]) < len(g.ranks):
                return
            for key in [k for k in g.blocks if k[0] == epoch]:
                del g.blocks[key]
            for r in g.ranks:
                g.taken.pop((epoch, r), None)
            g.read.pop(epoch, None)
            g.done.pop(epoch)
        self._coord.notify_split_finished.remote(epoch, g.split)

    def stats(self):
        if self._coord is None:
            return self._dataset._raw_stats()
        return ray.get(self._coord.stats.remote())

    def get_dataset_schema(self):
        if self._coord is None:
            return self._dataset.schema()
        return ray.get(self._coord.get_dataset_schema.remote())

    def get_dataset_context(self):
        return self._dataset.context

    def get_dataset_tag(self, rank: int) -> dict[str, str]:
        return {"dataset": self._dataset.get_dataset_id(), "split_index": str(rank)}

    def shutdown_executor(self) -> None:
        if self._coord is not None:
            ray.get(self._coord.shutdown_executor.remote())


def compute_data_parallel_groups(joined: dict[int, tuple[int, int]]) -> list[list[int]]:
    """PURE: the world ranks of each data-parallel group, by dp rank, from
    every rank's ``(dp_rank, dp_size)``.

    Raises:
        ValueError: ranks disagree on ``dp_size``, or a dp rank is out of
            range or has no rank.
    """
    sizes = {size for _, size in joined.values()}
    if len(sizes) != 1:
        raise ValueError(f"ranks report different dp sizes: {sorted(sizes)}")
    (dp_size,) = sizes
    groups: list[list[int]] = [[] for _ in range(dp_size)]
    for rank in sorted(joined):
        dp_rank = joined[rank][0]
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"rank {rank} reports dp_rank={dp_rank} outside [0, {dp_size})")
        groups[dp_rank].append(rank)
    if not all(groups):
        empty = [d for d, g in enumerate(groups) if not g]
        raise ValueError(f"no rank reads data-parallel shard(s) {empty} of {dp_size}")
    return groups


def check_dataset_split(split_names: tuple[str, ...], by_dp_rank: bool, dp_size: int, world: int):
    """PURE: refuse Ray Data split by world rank when ranks share data-parallel
    shards (a tp / cp group must read the same rows).

    Args:
        split_names: the run's datasets that its ``dataset_config`` splits.
        by_dp_rank: whether that config is a :class:`MeshDataConfig`.
        dp_size, world: the data-parallel and world sizes of the mesh.

    Raises:
        ValueError: naming the datasets and the fix.
    """
    if by_dp_rank or not split_names or dp_size == world:
        return
    raise ValueError(
        f"datasets {list(split_names)} would be split by Ray Train's DataConfig over "
        f"{world} world ranks, but the mesh has {dp_size} data-parallel shards (each tp / cp "
        f"group of {world // dp_size} ranks must read the same rows): pass "
        "TorchTrainer(..., dataset_config=ray_fsdp_backend.MeshDataConfig()) to split them "
        "by data-parallel rank"
    )
