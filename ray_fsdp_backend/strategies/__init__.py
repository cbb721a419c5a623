"""Distribution strategies and ``build_strategy``, the seed's entry point."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ray_fsdp_backend.strategies.base import DistributionStrategy
from ray_fsdp_backend.strategies.ddp import DDPStrategy
from ray_fsdp_backend.strategies.fsdp import FSDPStrategy

if TYPE_CHECKING:
    from ray_fsdp_backend.settings.config import FSDPSettings

__all__ = ["DDPStrategy", "DistributionStrategy", "FSDPStrategy", "build_strategy"]


def build_strategy(
    config: FSDPSettings | Mapping[str, Any],
    *,
    device: torch.device,
    local_rank: int,
    use_dmuon: bool = False,
    mesh: DeviceMesh | None = None,
) -> DistributionStrategy:
    """The strategy ``config`` asks for: FSDP2/HSDP when ``use_fsdp``, with
    the DMuon runtime when ``use_dmuon`` (argument or config), else DDP.

    Works in any initialised ``torch.distributed`` job. Without ``mesh`` (a
    torchrun job) the mesh is built here from ``WORLD_SIZE`` and
    ``LOCAL_WORLD_SIZE``; the Ray backend passes the mesh it built from the
    real node layout. ``local_rank`` is kept for the seed's signature; the
    device already says which GPU this rank drives.

    Raises:
        ValueError: an invalid config (a dict is validated like
            ``FSDPSettings.from_dict``), or DMuon without FSDP.
    """
    from ray_fsdp_backend.settings.config import FSDPSettings

    del local_rank
    if not isinstance(config, FSDPSettings):
        config = FSDPSettings.from_dict(config)
    use_dmuon = use_dmuon or config.use_dmuon
    if use_dmuon and not config.use_fsdp:
        raise ValueError("use_dmuon=True needs use_fsdp=true: DMuon runs on FSDP2 shards")
    if mesh is None:
        from ray_fsdp_backend.distributed.mesh import (
            build_device_mesh,
            resolve_layout,
            topology_from_environment,
        )

        mesh = build_device_mesh(resolve_layout(config, topology_from_environment()), device.type)
    if not config.use_fsdp:
        return DDPStrategy(config, device=device, mesh=mesh)
    if use_dmuon:
        from ray_fsdp_backend.strategies.dmuon import DMuonFSDPStrategy

        return DMuonFSDPStrategy(config, device=device, mesh=mesh)
    return FSDPStrategy(config, device=device, mesh=mesh)
