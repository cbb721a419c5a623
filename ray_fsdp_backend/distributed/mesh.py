"""Build the ``DeviceMesh`` a ``MeshLayout`` describes (creates process
groups), and name its sub-meshes: the data-parallel mesh FSDP shards over
(``dp_replicate``, ``dp_shard``, with ``cp`` folded into the shard axis when
present) and the model-parallel ones (``tp``, ``cp``).

Sub-meshes are slices of the one root mesh, so DTensors on them share its
process groups (torch caches a slice's groups on the root).

With ``expert_parallel_size > 1`` the root also answers ``mesh["ep"]`` (the
ranks exchanging tokens, each holding N/ep experts), ``mesh["efsdp"]`` (the
ranks holding the same experts, over which FSDP2 shards them) and
``mesh["etp"]`` (size one: the ranks sharing one batch, the ``tp_mesh``
argument of transformers' expert-parallel styles); see
:func:`build_expert_meshes`.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import TYPE_CHECKING

from ray_fsdp_backend.planning.topology import (
    CP_AXIS,
    DATA_PARALLEL_AXES,
    EP_AXIS,
    EXPERT_SHARD_AXIS,
    EXPERT_SOURCE_AXES,
    PP_AXIS,
    REPLICATE_AXIS,
    SHARD_AXIS,
    TP_AXIS,
    MeshLayout,
    Topology,
    compute_mesh_layout,
    compute_topology_from_env,
)
from ray_fsdp_backend.settings.config import FSDPSettings

if TYPE_CHECKING:  # torch is imported where a mesh is built: plan's layouts need none
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

SHARD_CP_AXIS = f"{SHARD_AXIS}_{CP_AXIS}"
"""The flattened ``dp_shard`` x ``cp`` axis FSDP shards over when cp > 1
(ranks of one cp group hold different sequence parts, so their gradients are
reduced like those of different data shards)."""

EXPERT_BATCH_AXIS = "etp"
"""Size-one axis of the expert mesh: the ranks that share one batch (what
transformers' ``EPImplementation`` takes as ``tp_mesh``)."""

_logger = logging.getLogger(__name__)


def build_device_mesh(layout: MeshLayout, device_type: str) -> DeviceMesh:
    """A mesh with the layout's axis names and exactly its rank placement.

    The grid is passed explicitly rather than through ``init_device_mesh``
    (which assumes rank ``i`` sits at flat index ``i``), so a shard group is
    one node even when the scheduler numbered a node's ranks apart.
    Collective: every rank must call it.
    """
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    grid = torch.tensor(layout.grid)  # host: the rank grid, which DeviceMesh reads on the host
    mesh = DeviceMesh(device_type, grid, mesh_dim_names=layout.axis_names)
    if layout.expert_parallel_size > 1:
        build_expert_meshes(mesh, layout)
    return mesh


def build_expert_meshes(mesh: DeviceMesh, layout: MeshLayout) -> None:
    """Split ``dp_shard`` x ``cp`` of ``mesh`` into ``(efsdp, ep, etp)`` (the
    layout's :meth:`~ray_fsdp_backend.planning.topology.MeshLayout.expert_coordinates`:
    ep innermost) and make those names reachable from the root as
    ``mesh["ep"]`` etc. Collective (creates the groups).

    torch 2.13's ``_unflatten`` returns a mesh on the same root (so FSDP2 can
    concatenate the efsdp and ep meshes of an expert parameter) but does not
    register its axis names on the root; they are registered the way
    ``_flatten`` registers a flattened name (the root's ``_flatten_mapping``),
    the only place this module touches it.
    """
    source = tuple(a for a in EXPERT_SOURCE_AXES if a in _dims(mesh))
    sizes = (layout.expert_shard_size, layout.expert_parallel_size, 1)
    names = (EXPERT_SHARD_AXIS, EP_AXIS, EXPERT_BATCH_AXIS)
    experts = flatten_axes(mesh, source)._unflatten(0, sizes, names)
    root = mesh._get_root_mesh()
    for name in names:
        root._flatten_mapping[name] = experts[name]


def expert_shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards the experts over: ``efsdp``, with
    ``dp_replicate`` before it under HSDP (the experts replicate like the
    dense modules)."""
    replicate = (REPLICATE_AXIS,) if REPLICATE_AXIS in _dims(mesh) else ()
    return slice_flattened(mesh, (*replicate, EXPERT_SHARD_AXIS))


def slice_flattened(mesh: DeviceMesh, axes: str | tuple[str, ...]) -> DeviceMesh:
    """``mesh[axes]`` where some of ``axes`` are flattened (``dp_shard_cp``)
    or expert names registered on the root. torch 2.13 warns that slicing
    them from the root "will be deprecated"; it is the documented way."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[axes]


def resolve_layout(config: FSDPSettings, topology: Topology) -> MeshLayout:
    """The mesh layout for ``config`` on ``topology`` (pure; raises ValueError
    for an impossible layout). Logs when ``hsdp_uneven_nodes`` chose it."""
    strategy = config.sharding_strategy if config.use_fsdp else None

    def stage_layout(ranks: Topology) -> MeshLayout:
        return compute_mesh_layout(
            strategy,
            ranks,
            config.fsdp_hsdp_replicate_size,
            config.hsdp_uneven_nodes,
            shard_across_nodes=config.fsdp_hsdp_shard_across_nodes,
            inner_axes=model_parallel_axes(config),
            expert_parallel_size=config.expert_parallel_size,
        )

    if config.pipeline_parallel_size > 1:
        from ray_fsdp_backend.planning.pipeline_layout import pipeline_mesh_layout

        layout = pipeline_mesh_layout(config.pipeline_parallel_size, topology, stage_layout)
    else:
        layout = stage_layout(topology)
    uneven = strategy is not None and strategy.is_hybrid and not topology.is_uniform
    if uneven and config.fsdp_hsdp_replicate_size is None:
        _logger.warning(
            "HSDP on nodes with %s workers: hsdp_uneven_nodes=%r gives mesh %s %s",
            list(topology.workers_per_node),
            config.hsdp_uneven_nodes,
            layout.axis_names,
            layout.shape,
        )
    return layout


def model_parallel_axes(config: FSDPSettings) -> list[tuple[str, int]]:
    """The axes inside the data-parallel ones, outermost first, with their
    configured sizes (size-one axes are dropped by the layout)."""
    return [(CP_AXIS, config.context_parallel_size), (TP_AXIS, config.tensor_parallel_size)]


def _dims(mesh: DeviceMesh) -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or ())


def submesh(mesh: DeviceMesh, axes: tuple[str, ...]) -> DeviceMesh:
    """The slice of ``mesh`` over those of ``axes`` it has (mesh order); the
    mesh itself when that is all of it, so a 1-D or HSDP mesh without
    model-parallel axes is used as before.

    Raises:
        ValueError: ``mesh`` has none of ``axes``.
    """
    present = tuple(a for a in _dims(mesh) if a in axes)
    if not present:
        raise ValueError(f"mesh with axes {_dims(mesh)} has none of {axes}")
    return mesh if present == _dims(mesh) else mesh[present]


def data_parallel_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The mesh FSDP2 shards and replicates over: ``dp_replicate`` and
    ``dp_shard`` of ``mesh``, with ``cp`` flattened into the shard axis
    (``dp_shard_cp``) when the mesh has one. 1-D: FSDP, 2-D: HSDP. A mesh
    without model-parallel axes (or None: FSDP2's default) is returned as is."""
    if mesh is None or not set(_dims(mesh)) & {CP_AXIS, TP_AXIS, PP_AXIS}:
        return mesh
    if CP_AXIS not in _dims(mesh):
        return submesh(mesh, DATA_PARALLEL_AXES)
    sharded = tuple(a for a in (SHARD_AXIS, CP_AXIS) if a in _dims(mesh))
    flat = flatten_axes(mesh, sharded)
    if REPLICATE_AXIS not in _dims(mesh):
        return flat
    return slice_flattened(mesh, (REPLICATE_AXIS, "_".join(sharded)))


def flatten_axes(mesh: DeviceMesh, axes: tuple[str, ...]) -> DeviceMesh:
    """``axes`` of ``mesh`` as one 1-D mesh named ``"_".join(axes)``
    (``dp_shard_cp``), reachable afterwards as ``mesh[name]``. Collective
    the first time (creates its process group).

    ``DeviceMesh._flatten`` is private in torch 2.13; it is what torchtitan
    uses for the same purpose, and this is its only call site.
    """
    if len(axes) == 1:
        return mesh[axes[0]]
    return mesh[axes]._flatten("_".join(axes))


def pipeline_group(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    """The process group of ``mesh["pp"]`` (this rank's stage peers), or None
    without pipeline parallelism."""
    return mesh.get_group(PP_AXIS) if mesh is not None and PP_AXIS in _dims(mesh) else None


def tensor_parallel_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """``mesh["tp"]``, or None when the mesh has no tp axis."""
    return mesh[TP_AXIS] if mesh is not None and TP_AXIS in _dims(mesh) else None


def topology_from_environment() -> Topology:
    """The node layout of a torchrun-style job: ``LOCAL_WORLD_SIZE`` ranks per
    node, numbered node by node (one node when the variable is unset)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    return compute_topology_from_env(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
