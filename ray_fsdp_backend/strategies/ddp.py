"""DDP: every rank holds the whole model; gradients are all-reduced."""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ray_fsdp_backend.strategies.base import DistributionStrategy
from ray_fsdp_backend.strategies.blocks import (
    apply_activation_checkpointing,
    apply_compile,
    find_blocks,
    has_meta_tensors,
    materialize_meta_module,
)

_HAS_FORWARD_SYNC = (
    "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
)


def _buffer_sync_kwargs(broadcast_buffers: bool) -> dict[str, bool]:
    """DDP's buffer-sync argument. torch 2.13 deprecates ``broadcast_buffers``
    for ``forward_sync_buffers``; True means the same under either name, but
    only the old ``broadcast_buffers=False`` also skips the sync at
    construction (rank-local buffers), so False keeps the old name."""
    if broadcast_buffers and _HAS_FORWARD_SYNC:
        return {"forward_sync_buffers": True}
    return {"broadcast_buffers": broadcast_buffers}


class DDPStrategy(DistributionStrategy):
    """``DistributedDataParallel`` with the config's bucket and buffer options."""

    @property
    def params_sharded(self) -> bool:
        return False

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.config.compile:
            apply_compile(model, find_blocks(model, self.config.fsdp_block_classes))
        if self.config.use_gradient_checkpointing:
            apply_activation_checkpointing(
                model, find_blocks(model, self.config.fsdp_block_classes)
            )
        if has_meta_tensors(model):
            materialize_meta_module(model, self.device)
        model = model.to(self.device)
        on_gpu = self.device.type == "cuda"
        # DDP broadcasts rank 0's parameters at construction: all ranks start equal.
        return DistributedDataParallel(
            model,
            device_ids=[self.device] if on_gpu else None,
            output_device=self.device if on_gpu else None,
            find_unused_parameters=self.config.find_unused_parameters,
            **_buffer_sync_kwargs(self.config.broadcast_buffers),
            bucket_cap_mb=self.config.bucket_cap_mb,
        )

    def autocast(self) -> AbstractContextManager:
        """DDP holds one fp32 copy of the model: mixed precision is autocast of
        the forward pass to bf16 (or fp16 with ``bf16=False``)."""
        if not self.config.use_mixed_precision:
            return nullcontext()
        dtype = torch.bfloat16 if self.config.bf16 else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    @contextmanager
    def no_sync(self, model: nn.Module):
        with model.no_sync():
            yield
