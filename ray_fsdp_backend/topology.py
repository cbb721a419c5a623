"""PURE cluster-layout math: which ranks live on which node, and the mesh shape.

Nothing here starts a process, touches ``torch.distributed`` or Ray: every
function maps worker metadata and config to plain ints and tuples, so it is
tested in milliseconds and gives the driver, the workers and the ``plan``
command the same answer.

Mesh axes have fixed names: ``dp_replicate`` (ranks holding the same shard,
whose gradients are all-reduced) and ``dp_shard`` (ranks that split the
parameters among themselves). FSDP uses ``(dp_shard,)``, HSDP
``(dp_replicate, dp_shard)`` and DDP ``(dp_replicate,)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ray_fsdp_backend.config import UNEVEN_NODE_POLICIES, ShardingStrategy

REPLICATE_AXIS = "dp_replicate"
SHARD_AXIS = "dp_shard"


@dataclass(frozen=True)
class WorkerInfo:
    """What the backend learns about one Ray Train worker before any setup."""

    world_rank: int
    node_id: str
    gpu_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Topology:
    """Ranks grouped by node. ``nodes[i]`` lists node i's ranks in ascending
    order; nodes are ordered by their lowest rank."""

    nodes: tuple[tuple[int, ...], ...]

    @property
    def world_size(self) -> int:
        return sum(len(ranks) for ranks in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def workers_per_node(self) -> tuple[int, ...]:
        return tuple(len(ranks) for ranks in self.nodes)

    @property
    def is_uniform(self) -> bool:
        """Whether every node runs the same number of workers."""
        return len(set(self.workers_per_node)) <= 1

    @property
    def ranks_node_major(self) -> tuple[int, ...]:
        """All ranks, node by node: the order in which mesh grids are filled."""
        return tuple(rank for ranks in self.nodes for rank in ranks)

    def node_rank(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.nodes) if rank in ranks)

    def local_rank(self, rank: int) -> int:
        return self.nodes[self.node_rank(rank)].index(rank)


@dataclass(frozen=True)
class MeshLayout:
    """A device-mesh layout: axis names and the rank at every mesh coordinate.

    ``grid`` is nested like the mesh: a tuple of ranks for a 1-D mesh, a tuple
    of rows (one per ``dp_replicate`` index) for a 2-D mesh.
    """

    axis_names: tuple[str, ...]
    grid: tuple

    @property
    def shape(self) -> tuple[int, ...]:
        if len(self.axis_names) == 1:
            return (len(self.grid),)
        return (len(self.grid), len(self.grid[0]))

    def _rows(self) -> tuple[tuple[int, ...], ...]:
        return self.grid if len(self.axis_names) == 2 else (self.grid,)

    def groups(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """The rank groups that communicate along ``axis``."""
        if axis not in self.axis_names:
            raise KeyError(f"mesh has axes {self.axis_names}, not {axis!r}")
        rows = self._rows()
        if axis == self.axis_names[-1]:
            return rows
        return tuple(zip(*rows, strict=True))

    def axis_size(self, axis: str) -> int:
        return self.shape[self.axis_names.index(axis)] if axis in self.axis_names else 1


def compute_topology(workers: Sequence[WorkerInfo]) -> Topology:
    """Group workers by Ray ``node_id`` (not IP: on a fake multi-node cluster
    all nodes share one IP).

    Raises:
        ValueError: ranks are not exactly 0..N-1.
    """
    ranks = sorted(w.world_rank for w in workers)
    if ranks != list(range(len(workers))):
        raise ValueError(f"worker ranks must be 0..{len(workers) - 1}, got {ranks}")
    by_node: dict[str, list[int]] = {}
    for w in sorted(workers, key=lambda w: w.world_rank):
        by_node.setdefault(w.node_id, []).append(w.world_rank)
    return Topology(nodes=tuple(tuple(r) for r in by_node.values()))


def compute_topology_from_env(world_size: int, local_world_size: int) -> Topology:
    """The torchrun convention: node i holds ranks [i*L, (i+1)*L).

    Raises:
        ValueError: ``local_world_size`` does not divide ``world_size``.
    """
    if local_world_size <= 0 or world_size % local_world_size:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={local_world_size} does not divide WORLD_SIZE={world_size}"
        )
    per = local_world_size
    return Topology(nodes=tuple(tuple(range(i, i + per)) for i in range(0, world_size, per)))


def topology_from_node_counts(node_counts: Sequence[int]) -> Topology:
    """Nodes running ``node_counts`` workers each, ranks numbered node by node."""
    starts = [sum(node_counts[:i]) for i in range(len(node_counts))]
    return Topology(
        nodes=tuple(tuple(range(a, a + n)) for a, n in zip(starts, node_counts, strict=True))
    )


def compute_mesh_layout(
    strategy: ShardingStrategy | None,
    topology: Topology,
    replicate_size: int | None = None,
    uneven_nodes: str = "error",
    *,
    shard_across_nodes: bool = False,
) -> MeshLayout:
    """The mesh for a strategy on a cluster; ``strategy=None`` means DDP.

    Ranks fill the grid node by node, so with the HSDP default (one replica
    per node) every ``dp_shard`` group is one node and every ``dp_replicate``
    group holds one rank of each node. ``uneven_nodes`` decides HSDP on nodes
    with unequal worker counts (an elastic restart after a node came back
    with fewer GPUs) when ``replicate_size`` is not given: ``error`` refuses,
    ``split_nodes`` shards over groups of ``gcd(workers per node)`` ranks,
    each inside one node, and ``full_shard`` uses a 1-D mesh over all ranks.

    An explicit ``replicate_size`` whose ``dp_shard`` groups would span nodes
    is refused unless ``shard_across_nodes``.

    Raises:
        ValueError: HSDP on unequal nodes under ``uneven_nodes="error"``, a
            ``replicate_size`` that does not divide the world size, or shard
            groups that leave a node without ``shard_across_nodes``.
    """
    order = topology.ranks_node_major
    if strategy is None:
        return MeshLayout(axis_names=(REPLICATE_AXIS,), grid=order)
    hybrid = strategy.is_hybrid
    if hybrid and replicate_size is None and not topology.is_uniform:
        hybrid = _check_uneven_policy(topology, uneven_nodes) != "full_shard"
    if not hybrid:
        return MeshLayout(axis_names=(SHARD_AXIS,), grid=order)
    replicate = resolve_replicate_size(topology, replicate_size, uneven_nodes)
    shard = topology.world_size // replicate
    rows = tuple(order[i * shard : (i + 1) * shard] for i in range(replicate))
    if not shard_across_nodes:
        _check_shard_groups_in_nodes(topology, rows, replicate)
    return MeshLayout(axis_names=(REPLICATE_AXIS, SHARD_AXIS), grid=rows)


def _check_shard_groups_in_nodes(topology: Topology, rows, replicate: int) -> None:
    for group in rows:
        nodes = sorted({topology.node_rank(rank) for rank in group})
        if len(nodes) > 1:
            raise ValueError(
                f"fsdp_hsdp_replicate_size={replicate} makes dp_shard group {tuple(group)} "
                f"span nodes {nodes} (workers per node: {list(topology.workers_per_node)}); "
                "HSDP shards inside a node. Choose a replicate size whose shard groups fit "
                "in a node, or set fsdp_hsdp_shard_across_nodes: true if this is intended."
            )


def _check_uneven_policy(topology: Topology, uneven_nodes: str) -> str:
    if uneven_nodes not in UNEVEN_NODE_POLICIES:
        raise ValueError(
            f"hsdp_uneven_nodes={uneven_nodes!r} is not one of {', '.join(UNEVEN_NODE_POLICIES)}"
        )
    if uneven_nodes == "error":
        raise ValueError(
            "hybrid sharding shards inside a node, so every node must run the same "
            f"number of workers; got {list(topology.workers_per_node)} workers on "
            f"{topology.num_nodes} nodes. Use equal nodes, set fsdp_hsdp_replicate_size, "
            "or set hsdp_uneven_nodes to split_nodes or full_shard."
        )
    return uneven_nodes


def resolve_replicate_size(
    topology: Topology, replicate_size: int | None, uneven_nodes: str = "error"
) -> int:
    """HSDP replicate-axis size: the number of nodes unless overridden; on
    unequal nodes under ``split_nodes``, ``world / gcd(workers per node)``."""
    world = topology.world_size
    if replicate_size is None:
        if topology.is_uniform:
            return topology.num_nodes
        _check_uneven_policy(topology, uneven_nodes)
        return world // math.gcd(*topology.workers_per_node)
    if world % replicate_size:
        raise ValueError(
            f"fsdp_hsdp_replicate_size={replicate_size} does not divide the world size "
            f"{world}; allowed: {[d for d in range(1, world + 1) if world % d == 0]}"
        )
    return replicate_size
