"""FSDP2 and HSDP: one path; the mesh decides which one it is.

A 1-D ``(dp_shard,)`` mesh gives FSDP (full_shard / shard_grad_op), a 2-D
``(dp_replicate, dp_shard)`` mesh gives HSDP (hybrid_shard /
_hybrid_shard_zero2): FSDP2's ``fully_shard`` shards over the last axis and
replicates over the first. Everything the config says is resolved into one
``FSDPPolicy`` before the single ``fully_shard`` call site.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from ray_fsdp_backend.compat.peft import is_peft_model
from ray_fsdp_backend.context_parallel.apply import (
    apply_context_parallel,
    attention_heads,
    check_context_parallel,
)
from ray_fsdp_backend.distributed.mesh import (
    data_parallel_mesh,
    expert_shard_mesh,
    tensor_parallel_mesh,
)
from ray_fsdp_backend.planning.topology import CP_AXIS
from ray_fsdp_backend.strategies.base import DistributionStrategy
from ray_fsdp_backend.strategies.blocks import (
    apply_activation_checkpointing,
    apply_compile,
    find_blocks,
    has_meta_tensors,
    materialize_meta_module,
    pipeline_roots,
)
from ray_fsdp_backend.strategies.expert_parallel import apply_expert_parallel, shard_experts

if TYPE_CHECKING:
    from ray_fsdp_backend.settings.config import FSDPSettings

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FSDPPolicy:
    """The ``fully_shard`` keyword arguments a config resolves to."""

    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    reshard_after_forward: bool

    @property
    def offloads(self) -> bool:
        return isinstance(self.offload_policy, CPUOffloadPolicy)

    @property
    def kwargs(self) -> dict:
        """The ``fully_shard`` keyword arguments besides the mesh."""
        return dict(
            mp_policy=self.mp_policy,
            offload_policy=self.offload_policy,
            reshard_after_forward=self.reshard_after_forward,
        )


def resolve_fsdp_policy(config: FSDPSettings, device: torch.device) -> FSDPPolicy:
    """Mixed precision, offload and resharding for ``fully_shard``.

    ``use_mixed_precision=False`` gives a policy that keeps everything in the
    parameters' dtype (full fp32): the seed refused to run without mixed
    precision. CPU offload needs an accelerator; on CPU workers the
    parameters already live in host memory, so it is skipped with a log line.
    """
    if config.use_mixed_precision:
        reduce_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[config.fsdp_reduce_dtype]
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    else:
        mp_policy = MixedPrecisionPolicy()
    offload_policy = OffloadPolicy()
    if config.fsdp_cpu_offload:
        if device.type == "cpu":
            _logger.info("fsdp_cpu_offload: workers run on CPU, nothing to offload")
        else:
            offload_policy = CPUOffloadPolicy(pin_memory=True)
    return FSDPPolicy(
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        # Under pipeline parallelism a stage runs several micro-batches' forwards
        # before their backwards: resharding after each would all-gather again
        # per micro-batch (torchtitan keeps it off too).
        reshard_after_forward=config.sharding_strategy.reshard_after_forward
        and config.pipeline_parallel_size == 1,
    )


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], mesh, policy: FSDPPolicy) -> nn.Module:
    """``fully_shard`` every block, then the root (which takes the rest:
    embeddings, tied output head, final norm). Without blocks the whole model
    is one unit, gathered whole on every rank in forward: that is warned."""
    if not blocks:
        _logger.warning(
            "ray_fsdp_backend: no blocks found in %s (no nn.ModuleList children and "
            "fsdp_block_classes unset): the whole model is ONE FSDP unit and every rank "
            "gathers all its parameters in forward. Set fsdp_block_classes to the class "
            "names of its repeated blocks.",
            type(model).__name__,
        )
    kwargs = dict(mesh=mesh, **policy.kwargs)
    for block in blocks:
        fully_shard(block, **kwargs)
    for root in pipeline_roots(model):  # a rank's virtual pipeline stages: one root each
        fully_shard(root, **kwargs)
    return model


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def no_gradient_sync(model: nn.Module, *, unsharded: bool) -> Iterator[None]:
    """Defer gradient reduction on every FSDP module of ``model`` until the
    next synced backward. ``unsharded``: skip the reduce-scatter (and the HSDP
    all-reduce), accumulating full gradients on every rank; otherwise only
    the HSDP cross-replica all-reduce is skipped and gradients stay sharded.
    Works for models sharded by a ``convert_to_fsdp`` hook, whose root need
    not be an FSDP module."""
    switches = [
        m.set_requires_gradient_sync if unsharded else m.set_requires_all_reduce
        for m in fsdp_modules(model)
    ]
    for switch in switches:
        switch(False, recurse=False)
    try:
        yield
    finally:
        for switch in switches:
            switch(True, recurse=False)


class FSDPStrategy(DistributionStrategy):
    """FSDP2 over the data-parallel axes of the mesh the backend built
    (1-D: FSDP, 2-D: HSDP); model-parallel axes (tp) are left to the plan."""

    use_dmuon = False
    """Tells a model's ``convert_to_fsdp`` hook that DMuon is on (the DMuon strategy)."""

    @functools.cached_property
    def dp_mesh(self) -> DeviceMesh:
        """The sub-mesh ``fully_shard`` shards and replicates over (made once:
        slicing a mesh reads its rank grid element by element, and
        ``no_sync`` asks for it every micro-batch)."""
        return data_parallel_mesh(self.mesh)

    @property
    def trainer_process_group(self) -> dist.ProcessGroup | None:
        """All ranks, for trainer-level barriers and metric reductions
        (independent of the mesh shape; no extra communicator)."""
        if not dist.is_initialized() or dist.get_world_size() <= 1:
            return None
        return dist.group.WORLD

    @property
    def params_sharded(self) -> bool:
        return True

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """``mesh["tp"]``, or None without tensor parallelism."""
        return tensor_parallel_mesh(self.mesh)

    def wrap(self, model: nn.Module, *, tp_plan: dict | None = None) -> nn.Module:
        if self.config.context_parallel_size > 1:
            self.check_context_parallel(model)  # refusals before any weight moves
        if self.tp_mesh is None:
            self._refuse_tp_plan(tp_plan)
        else:
            self._apply_tensor_parallel(model, tp_plan)
        return self._wrap(model, use_dmuon=self.use_dmuon)

    def _apply_tensor_parallel(self, model: nn.Module, tp_plan: dict | None) -> None:
        """Split ``model`` over the tp mesh (before blocks are compiled,
        checkpointed and sharded: torchtitan's order)."""
        from ray_fsdp_backend.strategies.tensor_parallel import (
            TPOptions,
            apply_tensor_parallel,
            resolve_tp_plan,
        )

        if is_peft_model(model):
            raise ValueError(
                f"tensor_parallel_size={self.config.tensor_parallel_size}: "
                f"{type(model).__name__} holds peft adapters, which the tensor-parallel plan "
                "does not split; train adapters with tensor_parallel_size=1 (FSDP2 shards the "
                "frozen base and the adapters)"
            )
        if callable(getattr(model, "convert_to_fsdp", None)):
            raise ValueError(
                f"tensor_parallel_size={self.config.tensor_parallel_size}: {type(model).__name__} "
                "shards itself through convert_to_fsdp, which takes no tp mesh; wrap a model "
                "without that hook"
            )
        sequence_parallel = self.config.sequence_parallel_enabled
        if sequence_parallel and not getattr(model, "supports_sequence_parallel", False):
            if self.config.sequence_parallel:
                raise ValueError(
                    f"sequence_parallel=True: {type(model).__name__} does not declare "
                    "supports_sequence_parallel (transformers models derive positions from the "
                    "hidden states' length); set sequence_parallel: false"
                )
            _logger.info("sequence parallel off: %s does not support it", type(model).__name__)
            sequence_parallel = False
        options = TPOptions(sequence_parallel, self.config.loss_parallel)
        apply_tensor_parallel(model, self.tp_mesh, resolve_tp_plan(model, tp_plan), options)

    def loss_parallel(self) -> AbstractContextManager:
        """torch's ``loss_parallel`` when the config keeps logits split over
        the vocabulary, else a no-op: compute the loss and call backward in it."""
        if not self.config.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def _wrap(self, model: nn.Module, *, use_dmuon: bool) -> nn.Module:
        """Shard ``model`` with its own ``convert_to_fsdp`` hook when it has one
        (the seed's adapter interface), else with the per-block policy; then
        materialise it if it was built on the meta device."""
        policy = resolve_fsdp_policy(self.config, self.device)
        experts = self._apply_expert_parallel(model)
        if self.config.context_parallel_size > 1:
            self.apply_context_parallel(model)
        if self.config.compiles_on(self.device.type):
            blocks = find_blocks(model, self.config.fsdp_block_classes)
            apply_compile(model, blocks, required=self.config.compile is True)
        convert = getattr(model, "convert_to_fsdp", None)
        if callable(convert):
            if self.config.use_gradient_checkpointing:
                apply_activation_checkpointing(model, find_blocks(model))
            model = convert(
                mesh=self.dp_mesh,
                mp_policy=policy.mp_policy,
                offload_policy=policy.offload_policy,
                reshard_after_forward=policy.reshard_after_forward,
                use_dmuon=use_dmuon,
            )
        else:
            blocks = find_blocks(model, self.config.fsdp_block_classes)
            if self.config.use_gradient_checkpointing:
                apply_activation_checkpointing(model, blocks)
            if not has_meta_tensors(model):
                model.to(self.device)
            if experts:
                shard_experts(
                    experts, expert_shard_mesh(self.mesh), self.dp_mesh.size(), **policy.kwargs
                )
            model = apply_fsdp(model, blocks, self.dp_mesh, policy)
        if has_meta_tensors(model):
            # Offloaded shards live on the host; FSDP2 moves them per use.
            param_device = "cpu" if policy.offloads else self.device
            materialize_meta_module(model, param_device, buffer_device=self.device)
        return model

    def _apply_expert_parallel(self, model: nn.Module) -> list[nn.Module]:
        """With ``expert_parallel_size > 1``, split the experts over ``ep`` and
        install the token dispatch (docs/moe.md); returns the experts modules
        to shard over ``efsdp`` (none without EP)."""
        ep = self.config.expert_parallel_size
        if ep == 1:
            return []
        if callable(getattr(model, "convert_to_fsdp", None)):
            raise ValueError(
                f"expert_parallel_size={ep}: {type(model).__name__} shards itself through "
                "convert_to_fsdp, which takes no ep mesh; wrap a model without that hook"
            )
        return apply_expert_parallel(model, self.mesh, ep)

    def apply_context_parallel(self, model: nn.Module) -> None:
        """Swap ``model``'s attention for Ulysses or ring over the mesh's cp
        axis (the backend resolved from its heads and the device, kept in
        ``cp_backend``)."""
        dtype = self.check_context_parallel(model)
        apply_context_parallel(model, self.mesh[CP_AXIS].get_group(), self.cp_backend, dtype)

    def check_context_parallel(self, model: nn.Module) -> torch.dtype | None:
        """Resolve the cp backend for ``model``'s heads and device (kept in
        ``cp_backend``) and refuse what it cannot compute in the dtype the
        attention computes in (bf16 under mixed precision, else the
        parameters'), which it returns."""
        heads = attention_heads(model)
        self.cp_backend = self.config.resolve_cp_backend(heads, self.device.type)
        floating = (p.dtype for p in model.parameters() if p.is_floating_point())
        dtype = torch.bfloat16 if self.config.use_mixed_precision else next(floating, None)
        check_context_parallel(model, self.cp_backend, dtype)
        return dtype

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        """Accumulation micro-batches. By default gradients are reduce-scattered
        every micro-batch and stay sharded (1-D mesh: nothing to defer; HSDP:
        only the cross-replica all-reduce waits); ``fsdp_accumulate_unsharded``
        defers the reduce-scatter too, holding full gradients on every rank."""
        unsharded = self.config.fsdp_accumulate_unsharded
        if not unsharded and (self.mesh is None or self.dp_mesh.ndim == 1):
            return contextlib.nullcontext()
        return no_gradient_sync(model, unsharded=unsharded)
