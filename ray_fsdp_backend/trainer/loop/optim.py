"""The trainer's optimizer and its learning-rate schedule.

:func:`build_optimizer` is fused AdamW, or distributed Muon for the blocks'
matrices (``train.optimizer: muon``); :func:`lr_factor` is the schedule's
factor at a step (linear warmup, then cosine decay).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ray_fsdp_backend.trainer.schema.spec import RunSpec, TrainOptions


def build_optimizer(model: nn.Module, spec: RunSpec) -> torch.optim.Optimizer:
    """Fused AdamW (decay on 2-D weights only), or distributed Muon for the
    blocks' matrices with AdamW for the rest. Both skip a non-finite step
    without a host sync (``found_inf``)."""
    opts = spec.train
    if opts.optimizer == "muon":
        from ray_fsdp_backend.dmuon.optimizer import Muon

        return Muon(
            model,
            lr=opts.lr,
            weight_decay=opts.weight_decay,
            adamw_lr=opts.adamw_lr,
            adamw_weight_decay=0.0,
        )
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": opts.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # Fused: one kernel per step, and it skips a non-finite step on the device.
    return torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def lr_factor(step: int, opts: TrainOptions) -> float:
    """Linear warmup to 1, then cosine decay to ``min_lr_ratio``."""
    if step < opts.warmup_steps:
        return (step + 1) / opts.warmup_steps
    progress = (step - opts.warmup_steps) / max(1, opts.steps - opts.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return opts.min_lr_ratio + (1 - opts.min_lr_ratio) * cosine
