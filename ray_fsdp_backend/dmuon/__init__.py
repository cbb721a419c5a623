"""DMuon: distributed Muon with dedicated matrices, on FSDP2 / HSDP shards.

``Muon(model, lr=...)`` is the optimizer (Muon for the dedicated 2-D block
matrices, each orthogonalised by one owner rank; AdamW for the rest).
``no_sync`` and ``clip_grad_norm_`` are the two runtime calls the seed's
``DMuonFSDPStrategy`` makes; both reuse the project's single mechanisms
(FSDP2's gradient-sync switch and :func:`ray_fsdp_backend.clip.clip_grad_norm_`).

    strategy = build_strategy(cfg, device=device, local_rank=rank, use_dmuon=True)
    model = strategy.wrap(model)                 # FSDP2 / HSDP, per block
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=3e-4, weight_decay=0.1)
    with strategy.no_sync(model):                # accumulation micro-batch
        loss_fn(model, micro_batch).backward()
    loss_fn(model, last_micro_batch).backward()
    strategy.clip_grad_norm(model, 1.0, optimizer=opt)   # one global norm
    opt.step(); opt.zero_grad()

Checkpoints go through DCP (``ray_fsdp_backend.checkpoint.save_sharded``)
keyed by parameter name; they load at any world size.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import nn

from ray_fsdp_backend.clip import ClipStats
from ray_fsdp_backend.clip import clip_grad_norm_ as _clip_grad_norm_
from ray_fsdp_backend.dmuon.newton_schulz import zeropower_via_newtonschulz
from ray_fsdp_backend.dmuon.optimizer import ADAMW_GROUP, MUON_GROUP, DMuonStepStats, Muon
from ray_fsdp_backend.dmuon.plan import MatrixSpec, OwnershipPlan, compute_ownership_plan
from ray_fsdp_backend.strategies.fsdp import no_gradient_sync

__all__ = [
    "ADAMW_GROUP",
    "MUON_GROUP",
    "DMuonStepStats",
    "MatrixSpec",
    "Muon",
    "OwnershipPlan",
    "clip_grad_norm_",
    "compute_ownership_plan",
    "no_sync",
    "zeropower_via_newtonschulz",
]


def no_sync(model: nn.Module) -> AbstractContextManager:
    """Accumulate gradients without reduce-scatter (or the HSDP all-reduce)
    on every FSDP2 unit of ``model``; the next backward outside the context
    reduces everything accumulated. Dedicated matrices are FSDP2 parameters,
    so FSDP's own switch covers them too."""
    return no_gradient_sync(model)


def clip_grad_norm_(optimizer: torch.optim.Optimizer, max_norm: float | None) -> ClipStats:
    """Clip the gradients of all of ``optimizer``'s parameters (Muon and AdamW
    groups) to one global L2 norm of at most ``max_norm``; see
    :func:`ray_fsdp_backend.clip.clip_grad_norm_`."""
    return _clip_grad_norm_(
        [p for group in optimizer.param_groups for p in group["params"]], max_norm
    )
