"""FSDP2 / HSDP with the DMuon optimizer (:mod:`ray_fsdp_backend.dmuon`).

DMuon keeps its dedicated matrices in FSDP2's sharded storage, so the
strategy differs from :class:`FSDPStrategy` only in telling the model's
``convert_to_fsdp`` hook that DMuon is on. A TP plan is applied as under
AdamW; the optimizer assembles whole matrices over tp
(:mod:`ray_fsdp_backend.dmuon.tensor_parallel`). Clipping (one global norm
over the model's and the optimizer's gradients) and ``no_sync`` are the FSDP
ones.
"""

from __future__ import annotations

from ray_fsdp_backend.strategies.fsdp import FSDPStrategy


class DMuonFSDPStrategy(FSDPStrategy):
    """FSDP2 plus the DMuon dedicated-parameter optimizer.

    Build the optimizer on the wrapped model:
    ``ray_fsdp_backend.dmuon.Muon(strategy.wrap(model), lr=...)``.
    """

    use_dmuon = True
