"""DDP: every rank holds the whole model; gradients are all-reduced."""

from __future__ import annotations

import inspect
from contextlib import contextmanager

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


def autocast_forward(model: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run ``model``'s forward under ``torch.autocast``: DDP keeps one fp32
    copy of the weights, so mixed precision is autocast of the forward (the
    weights stay fp32, matmuls run in ``dtype``). Forward hooks enter and
    leave the context (``always_call``: also when the forward raises), so any
    forward works, its own or one assigned to the instance."""
    active: list[torch.autocast] = []

    def enter(module, args):
        context = torch.autocast(device_type, dtype=dtype)
        context.__enter__()
        active.append(context)

    def leave(module, args, output):
        active.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)


class DDPStrategy(DistributionStrategy):
    """``DistributedDataParallel`` with the config's bucket and buffer options;
    under ``use_mixed_precision`` the forward runs under bf16 autocast."""

    @property
    def params_sharded(self) -> bool:
        return False

    def wrap(self, model: nn.Module, *, tp_plan: dict | None = None) -> nn.Module:
        self._refuse_tp_plan(tp_plan)
        if self.config.compiles_on(self.device.type):
            blocks = find_blocks(model, self.config.fsdp_block_classes)
            apply_compile(model, blocks, required=self.config.compile is True)
        if self.config.use_gradient_checkpointing:
            apply_activation_checkpointing(
                model, find_blocks(model, self.config.fsdp_block_classes)
            )
        if has_meta_tensors(model):
            materialize_meta_module(model, self.device)
        model = model.to(self.device)
        if self.config.use_mixed_precision:
            autocast_forward(model, self.device.type, torch.bfloat16)
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

    @contextmanager
    def no_sync(self, model: nn.Module):
        with model.no_sync():
            yield
