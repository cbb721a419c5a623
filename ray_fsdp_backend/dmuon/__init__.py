"""DMuon: distributed Muon with dedicated matrices, on FSDP2 / HSDP shards.

``Muon(model, lr=...)`` is the optimizer (Muon for the dedicated 2-D block
matrices, each orthogonalised by one owner rank; AdamW for the rest).
``no_sync`` and clipping are the strategy's (``DMuonFSDPStrategy`` is an
``FSDPStrategy``): dedicated matrices are FSDP2 parameters, so FSDP's
gradient-sync switch and the one global-norm clip cover them.

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

from ray_fsdp_backend.compat.optional_imports import lazy_exports

_EXPORTS = {
    "ADAMW_GROUP": "optimizer",
    "MUON_GROUP": "optimizer",
    "DMuonStepStats": "optimizer",
    "MatrixSpec": "plan",
    "Muon": "optimizer",
    "OwnershipPlan": "plan",
    "compute_ownership_plan": "plan",
    "zeropower_via_newtonschulz": "newton_schulz",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)  # plan imports .plan and .report without torch
