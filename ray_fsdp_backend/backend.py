"""The Ray Train backend: orchestration only, no per-run state.

``on_start`` runs in the Train controller. It learns where each worker runs,
computes the topology and mesh layout (pure, so a bad layout fails here,
before any process group exists), then has every worker build its process
group, mesh, strategy and context.
"""

from __future__ import annotations

import logging

import ray
from ray.train.backend import Backend

from ray_fsdp_backend import _worker
from ray_fsdp_backend.config import FSDPConfig
from ray_fsdp_backend.mesh import resolve_layout
from ray_fsdp_backend.topology import compute_topology

_logger = logging.getLogger(__name__)

# Seconds to wait for workers to tear down before giving up on them.
SHUTDOWN_TIMEOUT_S = 30


def resolve_pg_backend(config: FSDPConfig, uses_gpu: bool) -> str:
    """``torch.distributed`` backend string. NCCL on GPUs, with a gloo CPU
    backend beside it when CPU offload keeps gradients on the host (clipping
    then reduces CPU tensors); gloo on CPU."""
    if config.backend is not None:
        return config.backend
    if not uses_gpu:
        return "gloo"
    return "cuda:nccl,cpu:gloo" if config.fsdp_cpu_offload else "nccl"


class FSDPBackend(Backend):
    """Sets up FSDP2/HSDP/DDP on a Ray Train worker group."""

    # Every worker on a node sees all of that node's GPUs, as with Ray's
    # TorchConfig, so NCCL can use peer-to-peer transport between them.
    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group, backend_config: FSDPConfig) -> None:
        infos = worker_group.execute(_worker.collect_worker_info)
        topology = compute_topology(infos)
        layout = resolve_layout(backend_config, topology)
        uses_gpu = any(info.gpu_ids for info in infos)
        pg_backend = resolve_pg_backend(backend_config, uses_gpu)
        rank0 = next(i for i, info in enumerate(infos) if info.world_rank == 0)
        addr, port = worker_group.execute_single(rank0, _worker.find_rendezvous_address)
        _logger.info(
            "ray_fsdp_backend: %d workers on %d nodes, mesh %s %s, backend %s",
            topology.world_size,
            topology.num_nodes,
            layout.axis_names,
            layout.shape,
            pg_backend,
        )
        ray.get(
            [
                worker_group.execute_single_async(
                    index,
                    _worker.setup_worker,
                    backend_config,
                    topology,
                    layout,
                    world_rank=info.world_rank,
                    pg_backend=pg_backend,
                    master=(addr, port),
                )
                for index, info in enumerate(infos)
            ]
        )

    def on_shutdown(self, worker_group, backend_config: FSDPConfig) -> None:
        futures = worker_group.execute_async(_worker.teardown_worker)
        try:
            ray.get(futures, timeout=SHUTDOWN_TIMEOUT_S)
        except Exception as exc:  # a dead worker cannot tear down; the next start is clean
            _logger.warning("ray_fsdp_backend: worker teardown failed: %s", exc)
