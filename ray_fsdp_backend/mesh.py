"""Build the ``DeviceMesh`` a ``MeshLayout`` describes (creates process groups)."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ray_fsdp_backend.config import FSDPSettings
from ray_fsdp_backend.topology import (
    MeshLayout,
    Topology,
    compute_mesh_layout,
    compute_topology_from_env,
)

_logger = logging.getLogger(__name__)


def build_device_mesh(layout: MeshLayout, device_type: str) -> DeviceMesh:
    """A mesh with the layout's axis names and exactly its rank placement.

    The grid is passed explicitly rather than through ``init_device_mesh``
    (which assumes rank ``i`` sits at flat index ``i``), so a shard group is
    one node even when the scheduler numbered a node's ranks apart.
    Collective: every rank must call it.
    """
    return DeviceMesh(device_type, torch.tensor(layout.grid), mesh_dim_names=layout.axis_names)


def resolve_layout(config: FSDPSettings, topology: Topology) -> MeshLayout:
    """The mesh layout for ``config`` on ``topology`` (pure; raises ValueError
    for an impossible layout). Logs when ``hsdp_uneven_nodes`` chose it."""
    strategy = config.sharding_strategy if config.use_fsdp else None
    layout = compute_mesh_layout(
        strategy,
        topology,
        config.fsdp_hsdp_replicate_size,
        config.hsdp_uneven_nodes,
        shard_across_nodes=config.fsdp_hsdp_shard_across_nodes,
    )
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


def topology_from_environment() -> Topology:
    """The node layout of a torchrun-style job: ``LOCAL_WORLD_SIZE`` ranks per
    node, numbered node by node (one node when the variable is unset)."""
    world = dist.get_world_size()
    return compute_topology_from_env(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
