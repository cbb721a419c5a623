"""The device a one-process benchmark runs on, and its world-size-1 process group.

Shared by :mod:`benchmarks.gpu` and :mod:`benchmarks.sustained` (``gpu --sustained``
hands over to ``sustained``; keeping these here lets the import run one way).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def pick_device(cpu: bool, name: str) -> torch.device | None:
    """The CPU with ``cpu``, else GPU 0 (made current); None, saying why,
    when no CUDA GPU is visible."""
    if cpu:
        return torch.device("cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    print(f"{name}: skipped, no CUDA GPU is visible (torch.cuda.is_available() "
          f"is False; torch {torch.__version__})")  # fmt: skip
    return None


def init_single_rank(device: torch.device) -> None:
    """A world-size-1 process group: NCCL bound to ``device`` on GPU, gloo on CPU;
    under CPU offload's backend string (``cuda:nccl,cpu:gloo``) as the Ray backend
    resolves it, so offload can run through it."""
    from ray_fsdp_backend import FSDPConfig
    from ray_fsdp_backend.runtime.backend import resolve_pg_backend
    from tests.dist.harness import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")  # fmt: skip
    on_gpu = device.type == "cuda"
    offload = FSDPConfig(use_fsdp=True, fsdp_cpu_offload=True)
    dist.init_process_group(
        resolve_pg_backend(offload, uses_gpu=on_gpu),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=120),
        device_id=device if on_gpu else None,
    )
