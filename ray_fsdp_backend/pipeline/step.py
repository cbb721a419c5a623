"""``ctx.pipeline_step``: one optimizer step's forward and backward through
the pipeline, torch.distributed.pipelining's schedule over the micro-batches.

The loss rule is the project's (docs/long-context.md): every micro-batch's
token sum of the loss is divided by ``ctx.global_token_count`` of the whole
step's labels, and the schedule does not rescale gradients
(``scale_grads=False``), so the gradients are those of the mean over every
valid target of the step (-100 targets ignored), FSDP2 averaging them over
the dp ranks of each stage.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ray_fsdp_backend.pipeline.layout import resolve_microbatches

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def token_sum_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The default ``loss_fn``: cross-entropy summed over the valid targets
    (labels already shifted; -100 ignored), in fp32."""
    return F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )


class _Pipeline:
    """A stage and its schedule, built on the first step and kept on the model."""

    def __init__(self, ctx, model: nn.Module, micro: int) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.micro = micro
        self.divisor = torch.ones(())
        self.loss_fn: LossFn = token_sum_cross_entropy
        group = ctx.mesh["pp"].get_group()
        self.group, self.last = group, ctx.pp_size - 1
        self.stage = PipelineStage(model, ctx.pp_rank, ctx.pp_size, ctx.device, group=group)
        kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[ctx.config.pipeline_schedule]
        self.schedule = kind(
            self.stage, n_microbatches=micro, loss_fn=self._loss, scale_grads=False
        )

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) / self.divisor


def pipeline_step(
    ctx, model: nn.Module, batch: dict[str, torch.Tensor], loss_fn: LossFn | None
) -> torch.Tensor:
    """Run forward and backward of ``batch`` (``input_ids`` and ``labels``
    aligned as transformers takes them, ``[rows, seq]``: this dp rank's rows
    of the step; every stage of a pipeline passes the same) through ``model``
    (a stage :meth:`TrainContext.wrap` cut and sharded). Returns the step's
    loss on every rank: the sum over micro-batches of ``loss_fn(logits,
    shifted_labels)`` (a token sum; default: cross-entropy summed) over
    ``ctx.global_token_count``, from the last stage. Gradients accumulate on
    the stage's parameters; no other gradient sync is needed."""
    if "input_ids" not in batch or "labels" not in batch:
        raise ValueError(f"pipeline_step needs input_ids and labels, got {sorted(batch)}")
    rows = batch["input_ids"].shape[0]
    micro = resolve_microbatches(ctx.config.pipeline_microbatches, ctx.pp_size, rows)
    pipe = getattr(model, "_rfb_pipeline", None)
    if pipe is None or pipe.micro != micro:
        pipe = _Pipeline(ctx, model, micro)
        model._rfb_pipeline = pipe
    labels = ctx.shard_sequence({"labels": batch["labels"]})["labels"].to(ctx.device)
    pipe.divisor = ctx.global_token_count(labels).to(ctx.device)
    pipe.loss_fn = loss_fn or token_sum_cross_entropy
    losses: list[torch.Tensor] = []
    if ctx.pp_rank == 0:
        pipe.schedule.step(batch["input_ids"].to(ctx.device))
    elif ctx.pp_rank == pipe.last:
        pipe.schedule.step(target=labels, losses=losses)
    else:
        pipe.schedule.step()
    loss = torch.zeros((), dtype=torch.float32, device=ctx.device)
    if losses:
        loss = torch.stack([part.detach().float() for part in losses]).sum()
    dist.broadcast(loss, group_src=pipe.last, group=pipe.group)
    return loss
