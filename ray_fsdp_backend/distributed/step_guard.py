"""Skipping an optimizer step whose gradients are not finite, without a host sync.

``if torch.isfinite(grad_norm): optimizer.step()`` reads the norm on the host:
the CPU waits for the GPU to finish the backward and the clip, and the GPU
then idles while Python launches the step. :func:`step_if_finite` keeps the
decision on the device, through the protocol ``torch.amp.GradScaler`` uses:
an optimizer whose class sets ``_step_supports_amp_scaling`` reads the 0-d
tensors ``optimizer.found_inf`` and ``optimizer.grad_scale`` during
``step()`` and leaves everything (parameters, moments, step counts) as it
was where ``found_inf`` is non-zero. torch's fused optimizers
(``AdamW(fused=True)``, ``Adam``, ``SGD``) and DMuon's
:class:`~ray_fsdp_backend.dmuon.optimizer.Muon` do. Any other optimizer is
stepped after reading the norm on the host, as before. Inside such an
optimizer, :class:`SkipFactors` applies the decision to each update.

Written here rather than taken from ``GradScaler``: the scaler also scales
the loss and unscales gradients (nothing to do in bf16 or fp32), and its
``step`` needs a scaled backward first.
"""

from __future__ import annotations

import torch


def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` honours ``found_inf`` on the device."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_if_finite(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> torch.Tensor:
    """``optimizer.step()`` unless ``grad_norm`` is inf or NaN; returns
    ``found_inf``, a 0-d float32 tensor on the norm's device (1.0: the step
    was skipped). With an optimizer that supports it (see
    :func:`supports_found_inf`) nothing is read on the host; otherwise the
    norm is (one sync). Every rank passes the same global norm, so all ranks
    skip together.
    """
    found_inf = torch.logical_not(torch.isfinite(grad_norm)).to(torch.float32)
    if supports_found_inf(optimizer):
        optimizer.found_inf, optimizer.grad_scale = found_inf, None
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf, optimizer.grad_scale
    elif not bool(found_inf):
        optimizer.step()
    return found_inf


class SkipFactors:
    """Step factors that ``found_inf`` turns off on the device (no sync):
    :meth:`pick` is the factor where the step is taken and its neutral value
    where it is skipped, as a 0-d tensor, so a taken step multiplies by the
    same number the plain update uses (bit for bit). ``found_inf`` None: no
    skipping, the plain update."""

    def __init__(self, found_inf: torch.Tensor | None) -> None:
        self.found_inf = found_inf
        self._masks: dict[torch.device, torch.Tensor] = {}

    def skipped(self, device: torch.device) -> torch.Tensor:
        if device not in self._masks:
            self._masks[device] = (self.found_inf != 0).to(device)
        return self._masks[device]

    def pick(
        self, taken: float, skipped: float, device: torch.device, dtype=torch.float32
    ) -> torch.Tensor:
        value = torch.where(self.skipped(device), skipped, taken)
        return value.to(dtype)
