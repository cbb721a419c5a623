"""One optimizer step of the trainer, and the one loss it trains and evaluates.

:func:`train_step` runs ``grad_accum`` micro-batches (all but the last under
``no_sync``), clips and steps without waiting for the device: the loss, the
gradient norm and the skipped flag stay on it (:class:`StepResult`), and a
step whose norm is not finite is skipped there (``found_inf``, as
``GradScaler`` does). :func:`batch_loss` is the token sum of one micro-batch,
shared with the held-out evaluation; :func:`as_batch` moves a micro-batch to
the device.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import nn

from ray_fsdp_backend.distributed.step_guard import step_if_finite
from ray_fsdp_backend.ops.head import prepare_loss
from ray_fsdp_backend.trainer.loop.dpo import DPOObjective
from ray_fsdp_backend.trainer.loop.loss import MicroBatchLoss
from ray_fsdp_backend.trainer.loop.objectives import Objective, local_value
from ray_fsdp_backend.trainer.loop.pipeline import pipeline_loss
from ray_fsdp_backend.trainer.schema.spec import RunSpec


class StepResult(NamedTuple):
    """One optimizer step's scalars, 0-d tensors left on the device."""

    loss: torch.Tensor
    """This rank's share of the step's loss: averaged over the ranks it is
    the mean over every valid token of the step (the loss rule)."""
    grad_norm: torch.Tensor
    """The global pre-clip gradient norm (equal on every rank)."""
    skipped: torch.Tensor
    """1.0 when the norm was not finite and the step was skipped, else 0.0."""
    aux_loss: torch.Tensor | None = None
    """A mixture-of-experts model's auxiliary load-balancing loss (its
    output's ``aux_loss``, with ``output_router_logits``), this rank's mean
    over the micro-batches; logged, not added to the loss (docs/moe.md)."""
    stats: dict[str, torch.Tensor] | None = None
    """The objective's step metrics (``rewards/chosen``, ...), this rank's
    share as ``loss`` is: averaged over the ranks, the mean over the step's pairs."""


def train_step(
    ctx,
    model: nn.Module,
    optimizer,
    batches,
    spec: RunSpec,
    meter=None,
    head=...,
    objective: Objective | None = None,
) -> StepResult:
    """One optimizer step over ``grad_accum`` micro-batches, with no host
    synchronisation: a step whose gradient norm is not finite is skipped on
    the device (:func:`~ray_fsdp_backend.distributed.step_guard.step_if_finite`).
    ``meter`` (a ``StepMeter``) counts the tokens trained, once per tp group.

    The loss is the token-exact rule of docs/long-context.md: each
    micro-batch's token sum over ``ctx.global_token_count`` of the whole
    step's labels, so the gradient is that of the mean over every valid
    token of the step whatever the layout, and an elastic resize that
    changes ``grad_accum`` does not change the weighting. ``head``: the
    loss's output head (:func:`~ray_fsdp_backend.ops.head.prepare_loss`;
    resolved from the model when not given). With ``pipeline_parallel_size
    > 1`` the micro-batches go through ``ctx.pipeline_step`` as one batch
    (:mod:`~ray_fsdp_backend.trainer.loop.pipeline`). ``objective``: what
    each micro-batch's loss is (:func:`build_objective`,
    chosen once per run; built from ``spec`` when not given): the step
    divides its sums by its count (tokens, or pairs for ``dpo``)."""
    if ctx.pp_size == 1 and objective is None:
        objective = build_objective(ctx, model, spec, head)
    micro_batches = [
        ctx.shard_sequence(as_batch(batches.next_batch(), ctx.device))
        for _ in range(spec.train.grad_accum)
    ]
    if meter is not None and ctx.tp_rank == 0 and ctx.pp_rank == 0:
        # a tp group (and a pipeline) trains one copy of the rows
        meter.count_tokens(sum(batch["input_ids"].numel() for batch in micro_batches))
    stats = None
    if ctx.pp_size > 1:
        total, aux_total = pipeline_loss(ctx, model, micro_batches, spec.data.packing), None
    else:
        total, aux_total, stats = accumulate(ctx, model, micro_batches, objective)
    # max_grad_norm 0 (or null): no clipping, the norm is still measured.
    grad_norm = ctx.clip_grad_norm(model, spec.train.max_grad_norm or None, optimizer=optimizer)
    # Every rank sees the same global norm, so all skip together.
    skipped = step_if_finite(optimizer, grad_norm)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(total, grad_norm, skipped, aux_total, stats)


def accumulate(ctx, model: nn.Module, micro_batches: list[dict], objective: Objective):
    """Forward and backward of each micro-batch (gradients synced on the
    last only); returns the step's loss share, mean aux loss (or None) and
    the objective's metric shares (or None)."""
    accum = len(micro_batches)
    count = objective.count(ctx, micro_batches)
    total = torch.zeros((), device=ctx.device)
    aux_total, stats = None, None
    for micro, batch in enumerate(micro_batches):
        # Gradients sync only on the last micro-batch: one all-reduce per step.
        sync = contextlib.nullcontext() if micro == accum - 1 else ctx.no_sync(model)
        with sync, ctx.sequence_region(), ctx.loss_parallel():
            result = objective.micro_batch(ctx, model, batch)
            loss = result.total / count
            loss.backward()
        total += local_value(loss.detach())
        if result.aux_loss is not None:
            aux = result.aux_loss.detach() / accum
            aux_total = aux + (0 if aux_total is None else aux_total)
        if result.stats is not None:
            shares = {k: local_value(v.detach()) / count for k, v in result.stats.items()}
            stats = shares if stats is None else {k: stats[k] + shares[k] for k in stats}
    return total, aux_total, stats


def batch_loss(ctx, model: nn.Module, batch: dict, spec: RunSpec, head=...) -> MicroBatchLoss:
    """The one loss of the trainer, for training and evaluation: the token
    sum of one micro-batch as ``ctx.shard_sequence`` returned it (shifted
    ``targets``, -100 none), computed chunk by chunk without the whole logits
    (``train.loss_chunk_tokens``; 0: the full logits), and an MoE's aux loss.
    Divide by ``ctx.global_token_count`` of the step's targets for the mean."""
    if head is ...:
        head = prepare_loss(model, spec.train.loss_chunk_tokens)
    token_sum, aux = Objective(spec, head).micro_batch(ctx, model, batch)[:2]
    return MicroBatchLoss(token_sum, aux)


def build_objective(ctx, model: nn.Module, spec: RunSpec, head=...) -> Objective:
    """The run's objective, chosen once from ``train.objective``. ``head``:
    :func:`~ray_fsdp_backend.trainer.loop.loss.prepare_loss`'s result
    (resolved from the model when not given)."""
    if head is ...:
        head = prepare_loss(model, spec.train.loss_chunk_tokens)
    if spec.train.objective == "dpo":
        return DPOObjective(ctx, model, spec, head)
    return Objective(spec, head)


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``batch`` on ``device``; to a GPU through pinned memory, so that the
    copy is queued behind the running step instead of waiting for it."""
    if device.type == "cuda" and not batch.is_pinned():
        batch = batch.pin_memory()
    return batch.to(device, non_blocking=True)


def as_batch(batch, device: torch.device) -> dict[str, torch.Tensor]:
    """A micro-batch as a dict on ``device``: ``(inputs, targets)`` rows, or
    the dict packed rows come as (with their ``position_ids``)."""
    if not isinstance(batch, dict):
        batch = {"input_ids": batch[0], "targets": batch[1]}
    return {key: to_device(value, device) for key, value in batch.items()}
