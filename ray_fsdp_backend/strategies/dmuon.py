"""FSDP2 / HSDP with the DMuon optimizer (:mod:`ray_fsdp_backend.dmuon`).

DMuon keeps its dedicated matrices in FSDP2's sharded storage, so the
strategy differs from :class:`FSDPStrategy` only in telling the model's
``convert_to_fsdp`` hook that DMuon is on. Clipping (one global norm over the
model's and the optimizer's gradients) and ``no_sync`` are the FSDP ones.
"""

from __future__ import annotations

from torch import nn

from ray_fsdp_backend.strategies.fsdp import FSDPStrategy


class DMuonFSDPStrategy(FSDPStrategy):
    """FSDP2 plus the DMuon dedicated-parameter optimizer.

    Build the optimizer on the wrapped model:
    ``ray_fsdp_backend.dmuon.Muon(strategy.wrap(model), lr=...)``.
    """

    def wrap(self, model: nn.Module, *, tp_plan: dict | None = None) -> nn.Module:
        self._refuse_tp_plan(tp_plan)  # the config refuses DMuon with TP
        return self._wrap(model, use_dmuon=True)
