"""PURE cluster-layout math: which ranks live on which node, and the mesh shape.

Nothing here starts a process, touches ``torch.distributed`` or Ray: every
function maps worker metadata and config to plain ints and tuples, so it is
tested in milliseconds and gives the driver, the workers and the ``plan``
command the same answer.

Mesh axes have fixed names and a fixed order (``AXIS_ORDER``):
``dp_replicate`` (ranks holding the same shard, whose gradients are
all-reduced), ``dp_shard`` (ranks that split the parameters among
themselves), ``cp`` (context parallel: ranks that split a sequence) and
``tp`` (tensor parallel: ranks that split each layer's matrices), innermost so
that a tp group is neighbouring ranks of one node. FSDP uses ``(dp_shard,)``,
HSDP ``(dp_replicate, dp_shard)`` and DDP ``(dp_replicate,)``; model-parallel
axes of size above one follow, e.g. ``(dp_replicate, dp_shard, tp)``.

Expert parallelism adds no axis to the layout's grid: its ``ep`` ranks are
carved out of ``dp_shard`` x ``cp`` (torchtitan's rule). The flattened
``dp_shard`` x ``cp`` index ``f`` of a rank splits as ``efsdp = f // ep`` and
``ep = f % ep``: an ep group is ``ep`` consecutive shard ranks, and the
``efsdp`` ranks (same ep coordinate, one per ep group) hold the same experts
and FSDP-shard them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ray_fsdp_backend.settings.config import UNEVEN_NODE_POLICIES, ShardingStrategy

REPLICATE_AXIS = "dp_replicate"
SHARD_AXIS = "dp_shard"
CP_AXIS = "cp"
TP_AXIS = "tp"
EP_AXIS = "ep"
PP_AXIS = "pp"
"""Pipeline stages: the outermost axis (one stage per node group)."""
EXPERT_SHARD_AXIS = "efsdp"
"""The ranks holding the same experts (one per ep group), over which FSDP2
shards them: ``dp_shard x cp / ep`` ranks."""
EXPERT_AXES = (EXPERT_SHARD_AXIS, EP_AXIS)
"""The expert view of ``dp_shard`` x ``cp``, outermost first."""
AXIS_ORDER = (REPLICATE_AXIS, SHARD_AXIS, CP_AXIS, TP_AXIS)
"""Every mesh axis, outermost first: tp innermost so a tp group is one
node's neighbouring ranks; cp just inside dp_shard."""
EXPERT_SOURCE_AXES = (SHARD_AXIS, CP_AXIS)
"""The axes expert parallelism is carved out of."""
DATA_PARALLEL_AXES = (REPLICATE_AXIS, SHARD_AXIS)
"""The axes whose ranks read different data."""
AXIS_CONFIG_KEYS = {CP_AXIS: "context_parallel_size", TP_AXIS: "tensor_parallel_size"}
"""The config key that sizes each model-parallel axis."""


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
    """A device-mesh layout: named axes, their sizes, and the rank at every
    mesh coordinate.

    ``ranks`` lists the ranks in row-major order of ``shape`` (the last axis
    varies fastest), so the innermost axis (``tp``) groups consecutive
    node-major ranks and stays inside a node. Axes of size one are left out,
    except a lone data-parallel axis.
    """

    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    expert_parallel_size: int = 1
    """``ep``: how many ranks of ``dp_shard`` x ``cp`` split the experts."""

    def __post_init__(self) -> None:
        if len(self.axis_names) != len(self.shape) or math.prod(self.shape) != len(self.ranks):
            raise ValueError(
                f"mesh axes {self.axis_names} {self.shape} hold {len(self.ranks)} ranks"
            )
        ep, shard = self.expert_parallel_size, self.size(EXPERT_SOURCE_AXES)
        if ep > 1 and (SHARD_AXIS not in self.axis_names or shard % ep):
            raise ValueError(
                f"expert_parallel_size={ep} must divide dp_shard x cp = {shard} (mesh "
                f"{dict(zip(self.axis_names, self.shape, strict=True))}); allowed: "
                f"{[d for d in range(1, shard + 1) if shard % d == 0]}"
            )

    @property
    def expert_shard_size(self) -> int:
        """``efsdp``: ranks holding the same experts (``dp_shard x cp / ep``)."""
        return self.size(EXPERT_SOURCE_AXES) // self.expert_parallel_size

    def expert_coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s ``efsdp`` and ``ep`` indices (ep rank r holds experts
        ``[r*N/ep, (r+1)*N/ep)``)."""
        flat, _ = self.flat_coordinate(rank, EXPERT_SOURCE_AXES)
        efsdp, ep = divmod(flat, self.expert_parallel_size)
        return {EXPERT_SHARD_AXIS: efsdp, EP_AXIS: ep}

    def expert_groups(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """The rank groups along ``ep`` (ranks exchanging tokens) or ``efsdp``
        (ranks sharding the same experts), each ordered by that axis."""
        other = EP_AXIS if axis == EXPERT_SHARD_AXIS else EXPERT_SHARD_AXIS
        by_rest: dict[tuple, list[tuple[int, int]]] = {}
        for rank in self.ranks:
            coords = self.coordinates(rank)
            expert = self.expert_coordinates(rank)
            rest = tuple(v for a, v in coords.items() if a not in EXPERT_SOURCE_AXES)
            by_rest.setdefault((*rest, expert[other]), []).append((expert[axis], rank))
        return tuple(tuple(r for _, r in sorted(g)) for g in by_rest.values())

    @property
    def grid(self) -> tuple:
        """The ranks nested like the mesh (what ``DeviceMesh`` takes)."""
        grid: tuple = self.ranks
        for size in reversed(self.shape[1:]):
            grid = tuple(grid[i : i + size] for i in range(0, len(grid), size))
        return grid

    def axis_size(self, axis: str) -> int:
        """Size of ``axis``; 1 for an axis the mesh does not have."""
        return self.shape[self.axis_names.index(axis)] if axis in self.axis_names else 1

    def size(self, axes: Sequence[str]) -> int:
        """Product of the sizes of ``axes`` (absent axes count 1)."""
        return math.prod(self.axis_size(a) for a in axes)

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s index along every axis of the mesh."""
        return dict(zip(self.axis_names, self._unravel(self.ranks.index(rank)), strict=True))

    def flat_coordinate(self, rank: int, axes: Sequence[str]) -> tuple[int, int]:
        """``rank``'s (index, size) in the row-major flattening of ``axes``
        (in mesh order; absent axes have size 1)."""
        coords = self.coordinates(rank)
        index = 0
        for axis in self._present(axes):
            index = index * self.axis_size(axis) + coords[axis]
        return index, self.size(axes)

    def data_parallel_coordinates(self, rank: int) -> tuple[int, int]:
        """``(dp_rank, dp_size)``: which data shard ``rank`` reads. Ranks of one
        ``tp`` (or ``cp``) group share them: they read the same batch."""
        return self.flat_coordinate(rank, DATA_PARALLEL_AXES)

    def groups(self, axes: str | Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """The rank groups that communicate along ``axes`` (one axis name, or
        several flattened in mesh order), each in row-major order.

        Raises:
            KeyError: an axis the mesh does not have.
        """
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        for axis in axes:
            if axis not in self.axis_names:
                raise KeyError(f"mesh has axes {self.axis_names}, not {axis!r}")
        keep = [i for i, a in enumerate(self.axis_names) if a not in axes]
        by_rest: dict[tuple, list[int]] = {}
        for flat, rank in enumerate(self.ranks):
            coords = self._unravel(flat)
            by_rest.setdefault(tuple(coords[i] for i in keep), []).append(rank)
        return tuple(tuple(g) for g in by_rest.values())

    def _unravel(self, flat: int) -> tuple[int, ...]:
        coords = []
        for size in reversed(self.shape):
            flat, c = divmod(flat, size)
            coords.append(c)
        return tuple(reversed(coords))

    def _present(self, axes: Sequence[str]) -> list[str]:
        return [a for a in self.axis_names if a in axes]


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
    inner_axes: Sequence[tuple[str, int]] = (),
    expert_parallel_size: int = 1,
) -> MeshLayout:
    """The mesh for a strategy on a cluster; ``strategy=None`` means DDP.

    ``inner_axes`` are the model-parallel axes inside the data-parallel ones,
    outermost first, as ``(name, size)`` (``(("cp", 2), ("tp", 2))``); axes of
    size one are left out. Consecutive node-major ranks form one inner block
    (a tp group is ``tp`` neighbouring ranks of one node), so every node's
    worker count must be a multiple of the block. The data-parallel axes are
    then laid out over the blocks exactly as over single ranks without inner
    axes.

    Ranks fill the grid node by node, so with the HSDP default (one replica
    per node) every ``dp_shard`` group is one node and every ``dp_replicate``
    group holds one rank of each node. ``uneven_nodes`` decides HSDP on nodes
    with unequal worker counts (an elastic restart after a node came back
    with fewer GPUs) when ``replicate_size`` is not given: ``error`` refuses,
    ``split_nodes`` shards over groups of ``gcd(workers per node)`` ranks,
    each inside one node, and ``full_shard`` uses a 1-D mesh over all ranks.

    An explicit ``replicate_size`` whose ``dp_shard`` groups would span nodes
    is refused unless ``shard_across_nodes``. ``expert_parallel_size`` is
    recorded on the layout (it splits ``dp_shard`` x ``cp``, see the module
    docstring).

    Raises:
        ValueError: inner axes that do not tile every node, HSDP on unequal
            nodes under ``uneven_nodes="error"``, a ``replicate_size`` that
            does not divide the data-parallel size, shard groups that leave
            a node without ``shard_across_nodes``, or an
            ``expert_parallel_size`` that does not divide ``dp_shard x cp``.
    """
    inner = tuple((name, size) for name, size in inner_axes if size > 1)
    block = _check_inner_axes(topology, inner)
    # One "slot" per inner block, numbered node by node like ranks.
    slots = topology_from_node_counts([n // block for n in topology.workers_per_node])
    names, shape, grid = _data_parallel_layout(strategy, slots, replicate_size, uneven_nodes, block)
    order = topology.ranks_node_major
    layout = MeshLayout(
        axis_names=names + tuple(n for n, _ in inner),
        shape=shape + tuple(s for _, s in inner),
        ranks=tuple(r for slot in grid for r in order[slot * block : (slot + 1) * block]),
        expert_parallel_size=expert_parallel_size,
    )
    if REPLICATE_AXIS in names and SHARD_AXIS in names and not shard_across_nodes:
        _check_shard_groups_in_nodes(topology, layout.groups(SHARD_AXIS), shape[0])
    return layout


def _data_parallel_layout(
    strategy, topology: Topology, replicate_size, uneven_nodes, block
) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """Axis names, shape and row-major slots of the data-parallel mesh."""
    order = topology.ranks_node_major
    world = topology.world_size
    if strategy is None:
        return (REPLICATE_AXIS,), (world,), order
    hybrid = strategy.is_hybrid
    if hybrid and replicate_size is None and not topology.is_uniform:
        hybrid = _check_uneven_policy(topology, uneven_nodes) != "full_shard"
    if not hybrid:
        return (SHARD_AXIS,), (world,), order
    replicate = resolve_replicate_size(topology, replicate_size, uneven_nodes, block=block)
    return (REPLICATE_AXIS, SHARD_AXIS), (replicate, world // replicate), order


def _check_inner_axes(topology: Topology, inner: Sequence[tuple[str, int]]) -> int:
    """The inner block size; refuses one that does not tile every node."""
    block = math.prod(size for _, size in inner)
    counts = topology.workers_per_node
    if any(n % block for n in counts):
        sizes = " x ".join(f"{AXIS_CONFIG_KEYS.get(n, n)}={s}" for n, s in inner)
        raise ValueError(
            f"{sizes} needs groups of {block} ranks inside one node, but the nodes run "
            f"{list(counts)} workers: every node's worker count must be a multiple of {block}"
        )
    return block


def _check_shard_groups_in_nodes(topology: Topology, groups, replicate: int) -> None:
    for group in groups:
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
    topology: Topology, replicate_size: int | None, uneven_nodes: str = "error", *, block: int = 1
) -> int:
    """HSDP replicate-axis size: the number of nodes unless overridden; on
    unequal nodes under ``split_nodes``, ``world / gcd(workers per node)``.
    ``topology`` counts data-parallel slots: blocks of ``block`` ranks (one
    tp x cp group each)."""
    world = topology.world_size
    if replicate_size is None:
        if topology.is_uniform:
            return topology.num_nodes
        _check_uneven_policy(topology, uneven_nodes)
        return world // math.gcd(*topology.workers_per_node)
    if world % replicate_size:
        raise ValueError(
            f"fsdp_hsdp_replicate_size={replicate_size} does not divide the "
            + ("world size " if block == 1 else f"data-parallel size (world / {block}) ")
            + f"{world}; allowed: {[d for d in range(1, world + 1) if world % d == 0]}"
        )
    return replicate_size
