"""The Ray Train backend: ``FSDPConfig`` and the ``Backend`` it names.

``FSDPConfig`` is the settings of :mod:`ray_fsdp_backend.settings.config` made a
``ray.train.torch.TorchConfig`` (so ``TorchTrainer(torch_config=cfg)`` and
Train V2's ``DataParallelTrainer(backend_config=cfg)`` accept it). It lives
here, not in ``config.py``, because Ray's contract has the config name its
backend class: keeping that edge beside the backend keeps the package's
imports a tree, with the plain settings at its bottom.

The backend itself is orchestration only, with no per-run state.

``on_start`` runs in the Train controller. It learns where each worker runs,
computes the topology and mesh layout (pure, so a bad layout fails here,
before any process group exists), then has every worker build its process
group, mesh, strategy and context.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import ray
from ray.train.backend import Backend
from ray.train.torch import TorchConfig

from ray_fsdp_backend.distributed.mesh import resolve_layout
from ray_fsdp_backend.planning.topology import DATA_PARALLEL_AXES, compute_topology
from ray_fsdp_backend.runtime import worker
from ray_fsdp_backend.runtime.data_config import check_dataset_split
from ray_fsdp_backend.settings.config import FSDPSettings

_logger = logging.getLogger(__name__)

# Seconds to wait for workers to tear down before giving up on them.
SHUTDOWN_TIMEOUT_S = 30
# Seconds beyond the process-group timeout that worker setup may take.
SETUP_MARGIN_S = 60


@dataclass
class FSDPConfig(FSDPSettings, TorchConfig):
    """:class:`~ray_fsdp_backend.settings.config.FSDPSettings` as Ray's ``TorchConfig``:
    the same fields, validation, ``from_dict``/``from_yaml``/``to_dict``; Ray
    builds :class:`FSDPBackend` from it and keeps ``TorchConfig``'s per-worker
    device context."""

    @property
    def backend_cls(self) -> type[Backend]:
        return FSDPBackend


def resolve_pg_backend(config: FSDPSettings, uses_gpu: bool) -> str:
    """``torch.distributed`` backend string. NCCL on GPUs, with a gloo CPU
    backend beside it when CPU offload keeps gradients on the host (clipping
    then reduces CPU tensors); gloo on CPU.

    Ray's ``TorchTrainer`` fills an unset ``backend`` with ``"nccl"`` (or
    ``"gloo"``) before the backend sees the config (Ray 2.60), so a bare
    ``"nccl"`` under offload gets the CPU backend too, whoever wrote it: NCCL
    alone cannot reduce the host-side gradients.
    """
    backend = config.backend or ("nccl" if uses_gpu else "gloo")
    if uses_gpu and config.fsdp_cpu_offload and backend == "nccl":
        return "cuda:nccl,cpu:gloo"
    return backend


class FSDPBackend(Backend):
    """Sets up FSDP2/HSDP/DDP on a Ray Train worker group."""

    # Every worker on a node sees all of that node's GPUs, as with Ray's
    # TorchConfig, so NCCL can use peer-to-peer transport between them.
    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group, backend_config: FSDPConfig) -> None:
        described = worker_group.execute(worker.describe_worker)
        infos = [info for info, _ in described]
        topology = compute_topology(infos)
        layout = resolve_layout(backend_config, topology)
        dp_size = layout.size(DATA_PARALLEL_AXES)
        if dp_size != topology.world_size:  # tp / cp groups must read the same rows
            names, by_dp_rank = ray.get(
                worker_group.execute_single_async(0, worker.describe_datasets)
            )
            check_dataset_split(names, by_dp_rank, dp_size, topology.world_size)
        uses_gpu = any(info.gpu_ids for info in infos)
        backend_config.check_cp_device("cuda" if uses_gpu else "cpu")
        pg_backend = resolve_pg_backend(backend_config, uses_gpu)
        addr, port = next(address for info, address in described if info.world_rank == 0)
        _logger.info(
            "ray_fsdp_backend: %d workers on %d nodes, mesh %s %s, backend %s",
            topology.world_size,
            topology.num_nodes,
            layout.axis_names,
            layout.shape,
            pg_backend,
        )
        wait_all_or_first_error(
            [
                worker_group.execute_single_async(
                    index,
                    worker.setup_worker,
                    backend_config,
                    topology,
                    layout,
                    world_rank=info.world_rank,
                    pg_backend=pg_backend,
                    master=(addr, port),
                )
                for index, info in enumerate(infos)
            ],
            timeout_s=backend_config.timeout_s + SETUP_MARGIN_S,
        )

    def on_shutdown(self, worker_group, backend_config: FSDPConfig) -> None:
        """Tear down every live worker, waiting at most ``SHUTDOWN_TIMEOUT_S``.

        After a failure some workers are dead and others may be stuck in a
        collective: their errors and timeouts are logged, not raised, since Ray
        kills the group next and a restart starts new worker processes.
        """
        try:
            futures = worker_group.execute_async(worker.teardown_worker)
            ray.get(futures, timeout=SHUTDOWN_TIMEOUT_S)
        except Exception as exc:  # a dead worker cannot tear down; the next start is clean
            _logger.warning("ray_fsdp_backend: worker teardown failed: %s", exc)


def wait_all_or_first_error(futures: list, *, timeout_s: float) -> list:
    """Results of all ``futures``; raises the first failure as soon as it
    arrives (a plain ``ray.get`` of the list would first wait for the other
    workers, which block in rendezvous until the process-group timeout).

    Raises:
        TimeoutError: not all finished within ``timeout_s``.
    """
    pending, deadline = list(futures), time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=deadline - time.monotonic())
        if not ready:
            raise TimeoutError(
                f"ray_fsdp_backend: {len(pending)} workers did not finish in {timeout_s:.0f} s"
            )
        ray.get(ready)
    return ray.get(list(futures))
