"""The interface every strategy keeps (the seed's), and what they all share."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager

import torch
from torch.distributed.device_mesh import DeviceMesh

from ray_fsdp_backend.distributed.clip import ClipStats, clip_grad_norm_
from ray_fsdp_backend.distributed.mesh import pipeline_group
from ray_fsdp_backend.settings.config import FSDPSettings


class DistributionStrategy(ABC):
    """Wraps a model for one kind of data parallelism and runs the gradient
    operations that depend on it.

    Subclasses differ in ``wrap`` (which also applies mixed precision:
    FSDP2's policy, DDP's autocast forward), ``no_sync`` and
    ``params_sharded``; clipping is the same global-norm clip for all of them.
    """

    cp_backend: str | None = None
    """``ulysses`` or ``ring`` once ``wrap`` applied context parallelism."""

    def __init__(self, config: FSDPSettings, *, device: torch.device, mesh: DeviceMesh | None):
        self.config = config
        self.device = device
        self.mesh = mesh
        self._last_clip: ClipStats | None = None

    @abstractmethod
    def wrap(self, model: torch.nn.Module, *, tp_plan: dict | None = None) -> torch.nn.Module:
        """Wrap ``model`` for this strategy and place it on ``device``;
        ``tp_plan`` overrides the model's tensor-parallel plan (FSDP only)."""

    @abstractmethod
    def no_sync(self, model: torch.nn.Module) -> AbstractContextManager:
        """Context manager under which backward accumulates gradients locally,
        without cross-rank reduction (gradient-accumulation micro-batches)."""

    @property
    @abstractmethod
    def params_sharded(self) -> bool:
        """Whether each rank holds only a shard of the parameters."""

    def _refuse_tp_plan(self, tp_plan) -> None:
        if tp_plan is not None:
            raise ValueError(
                "wrap(tp_plan=...) needs tensor_parallel_size > 1 under FSDP; "
                f"{type(self).__name__} with tensor_parallel_size="
                f"{self.config.tensor_parallel_size} splits no layer"
            )

    def loss_parallel(self) -> AbstractContextManager:
        """Where the loss and its backward run; a no-op unless the config
        asks for loss parallelism (FSDP with tensor parallelism)."""
        return contextlib.nullcontext()

    def autocast(self) -> AbstractContextManager:
        """A no-op kept for loops written against earlier versions, where DDP
        mixed precision happened only inside it: ``wrap`` applies the
        configured mixed precision to the forward for every strategy."""
        return contextlib.nullcontext()

    @property
    def last_grad_clip_stats(self) -> dict[str, float] | None:
        """The last ``clip_grad_norm`` call's ``ClipStats`` as floats (reading
        it synchronises with the device; clipping itself does not)."""
        return None if self._last_clip is None else self._last_clip.as_dict()

    def clip_grad_norm(
        self,
        model: torch.nn.Module,
        max_norm: float | None,
        *,
        norm_type: float = 2.0,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> torch.Tensor:
        """Clip all gradients of ``model`` (and of ``optimizer``'s parameters,
        when given) to one global ``norm_type`` norm (torch's keyword: 2, 1,
        inf, any p) of at most ``max_norm`` (None: only measure it).

        Returns the global norm before clipping, a 0-d float32 tensor equal on
        every rank; when it is not finite, skip the optimizer step (see
        :mod:`ray_fsdp_backend.distributed.clip`). Details of the last call are in
        ``last_grad_clip_stats``.
        """
        params = [p for p in model.parameters() if p.requires_grad]  # a frozen base has none
        if optimizer is not None:
            params += [p for group in optimizer.param_groups for p in group["params"]]
        # The first call also checks that plain gradients are equal on all ranks.
        self._last_clip = clip_grad_norm_(
            params,
            max_norm,
            norm_type=norm_type,
            check_replicated=self._last_clip is None,
            across=pipeline_group(self.mesh),
            device=self.device,
        )
        return self._last_clip.total_norm
