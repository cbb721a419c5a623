"""Plain functions the backend runs on every worker (the only side effects).

Each takes the pure results computed in the controller (topology, mesh
layout) as arguments, so every worker builds the same groups in the same
order.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from ray_fsdp_backend.distributed.mesh import build_device_mesh
from ray_fsdp_backend.planning.topology import MeshLayout, Topology, WorkerInfo
from ray_fsdp_backend.runtime.context import TrainContext, set_context
from ray_fsdp_backend.settings.config import FSDPSettings
from ray_fsdp_backend.storage.retry import set_default_budget
from ray_fsdp_backend.strategies import build_strategy


def describe_worker() -> tuple[WorkerInfo, tuple[str, int]]:
    """This worker's rank, Ray node and GPUs, and an address it could host the
    rendezvous on (its node's IP and a free port there; rank 0's is used)."""
    info = WorkerInfo(
        world_rank=ray.train.get_context().get_world_rank(),
        node_id=ray.get_runtime_context().get_node_id(),
        gpu_ids=tuple(int(g) for g in ray.get_gpu_ids()),
    )
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return info, (ray.util.get_node_ip_address(), port)


def describe_datasets() -> tuple[tuple[str, ...], bool]:
    """The run's Ray Datasets that its ``dataset_config`` splits, and whether
    that config is a :class:`~ray_fsdp_backend.runtime.data_config.MeshDataConfig`.

    Ray 2.60 exposes neither to a backend: both are read from Train V2's
    worker context (``train_run_context.dataset_config``, the shard
    provider's dataset names).
    """
    from ray.train.v2._internal.execution.context import get_train_context

    from ray_fsdp_backend.runtime.data_config import MeshDataConfig

    train = get_train_context()
    config = train.train_run_context.dataset_config
    names = set(getattr(train.dataset_shard_provider, "_dataset_names", ()))
    split = names if config._datasets_to_split == "all" else names & set(config._datasets_to_split)
    return tuple(sorted(split)), isinstance(config, MeshDataConfig)


def _select_device() -> torch.device:
    if ray.get_gpu_ids() and torch.cuda.is_available():
        device = ray.train.torch.get_device()
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")  # host: no GPU, so this rank computes on the CPU


def setup_worker(
    config: FSDPSettings,
    topology: Topology,
    layout: MeshLayout,
    *,
    world_rank: int,
    pg_backend: str,
    master: tuple[str, int],
) -> None:
    """Create this rank's process group, mesh, strategy and ``TrainContext``.

    On GPU the process group is bound to this rank's device (``device_id``):
    NCCL then creates its communicator eagerly and barriers use the right GPU,
    which avoids the barrier hang seen with FSDP2 on Ray (Ray's own setup does
    not pass it).
    """
    os.environ.update(
        RANK=str(world_rank),
        WORLD_SIZE=str(topology.world_size),
        LOCAL_RANK=str(topology.local_rank(world_rank)),
        LOCAL_WORLD_SIZE=str(len(topology.nodes[topology.node_rank(world_rank)])),
        NODE_RANK=str(topology.node_rank(world_rank)),
        MASTER_ADDR=master[0],
        MASTER_PORT=str(master[1]),
    )
    os.environ.update({k: str(v) for k, v in config.nccl_env.items()})
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    set_default_budget(config.storage_retry_budget_s)
    device = _select_device()
    dist.init_process_group(
        backend=pg_backend,
        init_method="env://" if config.init_method == "env" else f"tcp://{master[0]}:{master[1]}",
        rank=world_rank,
        world_size=topology.world_size,
        timeout=timedelta(seconds=config.timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    install_context(config, topology, layout, device=device, world_rank=world_rank)


def install_context(
    config: FSDPSettings,
    topology: Topology,
    layout: MeshLayout,
    *,
    device: torch.device,
    world_rank: int,
) -> TrainContext:
    """Build the mesh and strategy, install the ``TrainContext`` for
    ``get_context()`` and return it (collective: builds the mesh)."""
    mesh = build_device_mesh(layout, device.type)
    strategy = build_strategy(
        config, device=device, local_rank=topology.local_rank(world_rank), mesh=mesh
    )
    context = TrainContext(
        config=config,
        strategy=strategy,
        mesh=mesh,
        layout=layout,
        topology=topology,
        device=device,
        world_rank=world_rank,
    )
    set_context(context)
    return context


def setup_process_context(config: FSDPSettings, device: torch.device) -> TrainContext:
    """The ``TrainContext`` of a process whose process group is already
    initialised without Ray (torchrun, a test's spawned ranks, a
    benchmark): the topology from ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE``, the
    mesh and strategy as the backend builds them. Installed for
    ``get_context()`` and returned; collective (builds the mesh)."""
    from ray_fsdp_backend.distributed.mesh import resolve_layout, topology_from_environment

    topology = topology_from_environment()
    layout = resolve_layout(config, topology)
    return install_context(config, topology, layout, device=device, world_rank=dist.get_rank())


def teardown_worker() -> None:
    """Drop the context and destroy the process group, so that the next
    ``fit()`` or a restart after a failure starts from a clean process."""
    set_context(None)
    if dist.is_initialized():
        dist.destroy_process_group()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
