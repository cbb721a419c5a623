"""DMuon: Muon on FSDP2 row shards, each matrix orthogonalised by one owner.

One ``torch.optim.Optimizer`` with two named parameter groups: ``"muon"``
(the dedicated 2-D matrices) and ``"adamw"`` (everything else), so LR
schedulers and ``torch.distributed.checkpoint.state_dict`` see an ordinary
optimizer. All state is per parameter and shaped like the parameter (a
DTensor shard under FSDP2), keyed by parameter name in DCP checkpoints: a
checkpoint saved at one world size loads at another, where the owners are
simply re-planned (:mod:`ray_fsdp_backend.dmuon.plan`).

One Muon step, per dedicated matrix, following ``torch.optim.Muon``:

1. momentum (and Nesterov) on the rank's own row shard of the gradient;
2. one all-to-all over the shard group sends every row shard to the matrix's
   owner, which assembles the full matrix (only there);
3. the owner runs Newton–Schulz, batched over its matrices of one shape;
4. a second all-to-all returns the orthogonalised rows to their shards;
5. every rank applies decoupled weight decay and the (shape-adjusted)
   learning rate to its shard.

Under tensor parallelism the same runs on each rank's TP block, and owners
assemble whole matrices over the tp group before step 3
(:mod:`~ray_fsdp_backend.dmuon.tensor_parallel`). Stacked matrices (the
experts' ``[E, out, in]`` weights, under expert parallelism or not) skip
steps 2 and 4: FSDP2 shards them by expert, so each rank orthogonalises the
whole matrices it holds (:mod:`~ray_fsdp_backend.dmuon.stacks`). Under HSDP the same
happens inside each ``dp_shard`` group, identically in every replica group
(FSDP2 has already all-reduced the gradients across ``dp_replicate``). Both
exchanges travel in ``ns_dtype``: Newton–Schulz casts to it first and returns
it, so nothing is lost on the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim._muon import _adjust_lr
from torch.optim.optimizer import _to_scalar

from ray_fsdp_backend.distributed.step_guard import SkipFactors
from ray_fsdp_backend.dmuon import newton_schulz
from ray_fsdp_backend.dmuon.exchange import ShardExchange, ShardGroup, resolve_shard_group
from ray_fsdp_backend.dmuon.muon_setup import (
    ADAMW_GROUP,
    MUON_GROUP,
    check_muon_args,
    local_tensor,
    ns_device,
    param_groups,
    resolve_ns_device,
    shard_rows_error,
)
from ray_fsdp_backend.dmuon.plan import (
    DEFAULT_BUCKET_NUMEL,
    MatrixSpec,
    OwnershipPlan,
    compute_ownership_plan,
)
from ray_fsdp_backend.dmuon.selection import select_parameters
from ray_fsdp_backend.dmuon.stacks import (
    STACK_NDIM,
    local_matrix_names,
    orthogonalize_stacks,
    stack_layout_error,
)
from ray_fsdp_backend.dmuon.tensor_parallel import (
    TensorSplit,
    orthogonalize_whole,
    resolve_tensor_split,
)

__all__ = ["ADAMW_GROUP", "MUON_GROUP", "DMuonStepStats", "Muon", "resolve_ns_device"]


@dataclass(frozen=True)
class DMuonStepStats:
    """What the last ``step`` did on this rank."""

    orthogonalized: tuple[str, ...]
    """Names of the matrices this rank ran Newton–Schulz on (``name[i]`` for
    matrix ``i`` of a stack)."""
    ns_calls: int
    """Batched Newton–Schulz calls (one per owned shape in each bucket)."""
    bytes_sent: int
    """Bytes this rank sent to other ranks in the two exchanges."""
    bytes_received: int


class Muon(torch.optim.Optimizer):
    """Distributed Muon for the dedicated 2-D matrices (and stacks of them:
    experts) of an FSDP2 (or HSDP) model, AdamW for its other parameters.

    Built on the model the DMuon strategy wrapped (or any model whose
    dedicated parameters are FSDP2 DTensors sharded on dim 0 over one mesh
    axis, or plain tensors: then every rank orthogonalises every matrix).
    Matches ``torch.optim.Muon`` (momentum as ``buf.lerp_(grad, 1 - momentum)``,
    Nesterov, Newton–Schulz coefficients and steps, ``adjust_lr_fn``, decoupled
    weight decay) plus ``torch.optim.AdamW`` on the rest.

    Args:
        model: the wrapped model.
        lr, momentum, nesterov, weight_decay, ns_steps, adjust_lr_fn,
            ns_coefficients, ns_eps: the Muon group's hyperparameters, as in
            ``torch.optim.Muon`` (``ns_eps`` is its ``eps``).
        ns_dtype: precision of Newton–Schulz and of the exchanges; bfloat16
            like torch's Muon, float32 for exact comparisons.
        adamw_lr: the AdamW group's learning rate (default: ``lr``).
        adamw_betas, adamw_eps, adamw_weight_decay: the AdamW group's.
        is_dedicated: ``(name, param) -> bool`` choosing the Muon matrices;
            default: 2-D weights inside the sharded blocks (see
            :func:`~ray_fsdp_backend.dmuon.selection.select_parameters`).
        bucket_numel: matrix elements each owner assembles per exchange
            bucket, on average (a bucket holds at most ``bucket_numel`` times
            the shard-group size elements of matrices of similar cost; None:
            one bucket). Bounds the exchange buffers and lets the next bucket
            travel during Newton–Schulz.

    Raises:
        ValueError: a bad hyperparameter, a dedicated parameter that is not
            2-D or not sharded on dim 0, dedicated parameters on different
            meshes, or (on every rank) ranks that planned differently.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = newton_schulz.NS_STEPS,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        ns_coefficients: tuple[float, float, float] = newton_schulz.NS_COEFFICIENTS,
        ns_eps: float = newton_schulz.NS_EPS,
        is_dedicated: Callable[[str, nn.Parameter], bool] | None = None,
        bucket_numel: int | None = DEFAULT_BUCKET_NUMEL,
    ):
        check_muon_args(lr, momentum, weight_decay, ns_steps, adjust_lr_fn, ns_dtype)
        dedicated, rest = select_parameters(model, is_dedicated)
        matrices = [(n, p) for n, p in dedicated if p.ndim == 2]
        stacks = [(n, p) for n, p in dedicated if p.ndim == STACK_NDIM]
        dedicated = matrices + stacks  # the "muon" group: planned matrices, then stacks
        self.ns_dtype = ns_dtype
        self.param_names = tuple(name for name, _ in dedicated)
        self.shard_group: ShardGroup = resolve_shard_group(matrices)
        self.tensor_split: TensorSplit = resolve_tensor_split(matrices)
        self._shapes = tuple(tuple(p.shape[-2:]) for _, p in dedicated)  # whole, for the lr
        self._stack_ids = tuple(range(len(matrices), len(dedicated)))
        # Planned and exchanged over dp_shard on each rank's TP block.
        blocks = [self.tensor_split.block_shape(self._shapes[i], i) for i in range(len(matrices))]
        specs = [MatrixSpec(name, b) for (name, _), b in zip(matrices, blocks, strict=True)]
        self.plan: OwnershipPlan = compute_ownership_plan(
            specs, self.shard_group.size, bucket_numel
        )
        # Newton–Schulz and both exchanges run where compute runs (the GPU also
        # when CPU offload keeps the shards on the host).
        host = torch.device("cpu")  # host: no matrix on any rank: nothing is exchanged
        device = ns_device(dedicated[0][1]) if dedicated else host
        self._exchange = ShardExchange(self.plan, self.shard_group, dtype=ns_dtype, device=device)
        self._exchange.verify_consistent(
            shard_rows_error(matrices, self.plan, self.shard_group)
            or next(filter(None, (stack_layout_error(n, p) for n, p in stacks)), None)
        )
        muon_hyper = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_steps=ns_steps,
            ns_coefficients=tuple(ns_coefficients),
            eps=ns_eps,
            adjust_lr_fn=adjust_lr_fn,
        )
        adamw_hyper = dict(
            lr=lr if adamw_lr is None else adamw_lr,
            betas=adamw_betas,
            eps=adamw_eps,
            weight_decay=adamw_weight_decay,
        )
        # torch's AdamW runs the AdamW group's update (see _adamw_step).
        # Fused: it honours ``found_inf`` (a skipped step) on the device.
        self._adamw = (
            torch.optim.AdamW([p for _, p in rest], **adamw_hyper, fused=True) if rest else None
        )
        super().__init__(param_groups(model, dedicated, muon_hyper, self._adamw), defaults={})
        self.last_step_stats: DMuonStepStats | None = None
        self._init_state()

    # GradScaler's protocol (see ray_fsdp_backend.distributed.step_guard): ``step`` reads
    # ``self.found_inf`` and skips the whole update where it is non-zero.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step on the dedicated matrices and one AdamW step on the
        rest. Every rank of the mesh must call it (it communicates), also when
        some parameters have no gradient: those are left unchanged.

        With ``self.found_inf`` set (a 0-d tensor, as ``GradScaler`` and
        :func:`~ray_fsdp_backend.distributed.step_guard.step_if_finite` set it) a
        non-zero value leaves parameters and state as they were, decided on
        the device: the exchanges and Newton–Schulz still run (on zeroed
        gradients), their result is multiplied by 0.
        """
        if getattr(self, "grad_scale", None) is not None:
            raise ValueError(
                "Muon does not unscale gradients: call GradScaler.unscale_(optimizer) before "
                "step (or train in bf16 / fp32, which need no scaler)"
            )
        keep = SkipFactors(getattr(self, "found_inf", None))
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["name"] == MUON_GROUP:
                self._muon_step(group, keep)
        self._adamw_step(keep.found_inf)
        return loss

    def _muon_step(self, group: dict, keep: SkipFactors) -> None:
        params = group["params"]
        updates, owned, ns_calls = self._orthogonalized_shards(params, group, keep)
        lr = _to_scalar(group["lr"])
        for i, (p, shape) in enumerate(zip(params, self._shapes, strict=True)):
            if p.grad is None:
                continue
            local = local_tensor(p)
            adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], shape)
            update = updates[i].to(local.device)  # offload: host shard
            if keep.found_inf is None:
                local.mul_(1 - lr * group["weight_decay"])
                local.add_(update, alpha=-adjusted_lr)
            else:  # the same factors, or 1 and 0 where the step is skipped
                local.mul_(keep.pick(1 - lr * group["weight_decay"], 1.0, local.device))
                local.addcmul_(update, keep.pick(-adjusted_lr, 0.0, local.device))
        stacked = (local_matrix_names(self.param_names[i], params[i]) for i in self._stack_ids
                   if params[i].grad is not None)  # fmt: skip
        self.last_step_stats = DMuonStepStats(
            orthogonalized=tuple(self.plan.matrices[i].name for i in owned)
            + tuple(name for names in stacked for name in names),
            ns_calls=ns_calls,
            bytes_sent=self._exchange.bytes_sent,
            bytes_received=self._exchange.bytes_received,
        )

    def _orthogonalized_shards(
        self, params: list[torch.Tensor], group: dict, keep: SkipFactors
    ) -> tuple[dict[int, torch.Tensor], list[int], int]:
        """This rank's rows of every orthogonalised update (by plan index),
        the matrices it owned, and its batched Newton–Schulz calls.

        Bucket ``b + 1`` travels to its owners while they orthogonalise bucket
        ``b``; results go back as soon as a bucket is done. The stacks, which
        need no exchange, are orthogonalised while the first bucket travels.
        """
        ex = self._exchange
        ex.reset_counters()
        incoming = self._start_bucket(0, params, group, keep)
        updates, ns_calls = self._orthogonalized_stacks(params, group, keep)
        outgoing, owned = [], []
        for b, layout in enumerate(ex.layouts):
            full = ex.finish_to_owners(incoming)
            if b + 1 < len(ex.layouts):
                incoming = self._start_bucket(b + 1, params, group, keep)
            done = orthogonalize_whole(
                full, layout.ns_batches, self.tensor_split, lambda s: self._orthogonalize(s, group)
            )
            outgoing.append(ex.start_to_shards(b, done))
            owned += layout.owned
            ns_calls += len(layout.ns_batches)
        for pending in outgoing:
            updates.update(ex.finish_to_shards(pending))
        return updates, sorted(owned), ns_calls

    def _orthogonalized_stacks(
        self, params: list[torch.Tensor], group: dict, keep: SkipFactors
    ) -> tuple[dict[int, torch.Tensor], int]:
        """The momentum update of every matrix of this rank's stack shards,
        orthogonalised here (one batched call per matrix shape), by param
        index, and the number of calls."""
        ids = [i for i in self._stack_ids if params[i].grad is not None]
        outs = [
            torch.empty(
                local_tensor(params[i]).shape, dtype=self.ns_dtype, device=self._exchange.device
            )
            for i in ids
        ]
        for i, out in zip(ids, outs, strict=True):
            self._momentum_update(params[i], group, out, keep)
        calls = len({tuple(out.shape[1:]) for out in outs if out.shape[0]})
        done = orthogonalize_stacks(outs, lambda s: self._orthogonalize(s, group))
        return dict(zip(ids, done, strict=True)), calls

    def _start_bucket(
        self, bucket: int, params: list[torch.Tensor], group: dict, keep: SkipFactors
    ):
        """Momentum-update this rank's rows of ``bucket``'s matrices straight
        into the exchange buffer and send it to the owners."""
        buffer, views = self._exchange.send_buffer(bucket)
        for i, view in views.items():
            self._momentum_update(params[i], group, view, keep)
        return self._exchange.start_to_owners(bucket, buffer)

    def _momentum_update(
        self, p: torch.Tensor, group: dict, out: torch.Tensor, keep: SkipFactors
    ) -> None:
        """Write this rank's rows of the Nesterov (or plain) momentum update,
        cast to ``ns_dtype``, into ``out``; zeros for a parameter without
        gradient, so that the exchanges have the same layout on every rank.
        Like ``torch.optim.Muon``, Nesterov leaves the update in the gradient.
        A skipped step (``keep`` 0) zeroes the gradient and leaves the
        momentum as it was."""
        if p.grad is None:
            out.zero_()
            return
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        grad, buf = local_tensor(p.grad), local_tensor(state["momentum_buffer"])
        if keep.found_inf is None:
            buf.lerp_(grad, 1 - group["momentum"])
        else:
            grad.masked_fill_(keep.skipped(grad.device), 0.0)  # inf and NaN out
            buf.lerp_(grad, keep.pick(1 - group["momentum"], 0.0, buf.device, buf.dtype))
        # In place, as torch.optim.Muon does: no fp32 temporary per matrix.
        out.copy_(grad.lerp_(buf, group["momentum"]) if group["nesterov"] else buf)

    def _orthogonalize(self, stacks: dict, group: dict) -> dict:
        """Newton–Schulz on owned matrices, one batched call per shape."""
        return {
            shape: newton_schulz.zeropower_via_newtonschulz(
                stack,
                group["ns_coefficients"],
                group["ns_steps"],
                group["eps"],
                self.ns_dtype,
            )
            for shape, stack in stacks.items()
        }

    def _init_state(self) -> None:
        """Create every parameter's state now rather than at its first
        gradient, so that a checkpoint always holds every key and a freshly
        built optimizer loads one through DCP without a fake step (a parameter
        that never got a gradient would otherwise be missing on one side).

        AdamW's state comes from torch's own lazy initialisation: one AdamW
        step with zero gradients at lr 0 (what DCP itself does), after which
        the step counts are reset to 0, as if no step had run.
        """
        for group in self.param_groups:
            if group["name"] == MUON_GROUP:
                for p in group["params"]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        adamw_groups = [g for g in self.param_groups if g["name"] == ADAMW_GROUP]
        params = [p for g in adamw_groups for p in g["params"]]
        grads, lrs = [p.grad for p in params], [g["lr"] for g in adamw_groups]
        try:
            for p in params:
                p.grad = torch.zeros_like(p)
            for g in adamw_groups:
                g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
            self._adamw_step()
        finally:
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad
            for g, lr in zip(adamw_groups, lrs, strict=True):
                g["lr"] = lr
        for p in params:
            self.state[p]["step"].zero_()

    def _adamw_step(self, found_inf: torch.Tensor | None = None) -> None:
        # The inner AdamW runs torch's own update on our "adamw" groups and
        # our state: rebound on every step because load_state_dict replaces
        # both objects.
        if self._adamw is None:
            return
        self._adamw.param_groups = [g for g in self.param_groups if g["name"] == ADAMW_GROUP]
        self._adamw.state = self.state
        if found_inf is None:
            self._adamw.step()
            return
        self._adamw.found_inf, self._adamw.grad_scale = found_inf, None
        try:
            self._adamw.step()
        finally:
            del self._adamw.found_inf, self._adamw.grad_scale

    def momentum_numel(self) -> int:
        """Elements of Muon momentum this rank holds (its shards only)."""
        return sum(
            local_tensor(s["momentum_buffer"]).numel()
            for s in self.state.values()
            if "momentum_buffer" in s
        )
