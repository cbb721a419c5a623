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

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ray_fsdp_backend.planning.pipeline_layout import resolve_microbatches

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def token_sum_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The default ``loss_fn``: cross-entropy summed over the valid targets
    (labels already shifted; -100 ignored), in fp32."""
    return F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )


SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv_zero_bubble": "ScheduleZBVZeroBubble",
}
"""``pipeline_schedule`` -> torch.distributed.pipelining's schedule class."""


class _Pipeline:
    """A rank's stages and their schedule, built on the first step and kept on
    the model: one PipelineStage (one stage per rank: the model itself;
    virtual stages: each stage's module, an FSDP2 root torch's stage drives)."""

    def __init__(self, ctx, model: nn.Module, micro: int) -> None:
        from torch.distributed import pipelining
        from torch.distributed.pipelining import PipelineStage

        from ray_fsdp_backend.pipeline.split import pipeline_roots
        from ray_fsdp_backend.planning.pipeline_schedules import stage_indices

        self.micro = micro
        self.divisor = torch.ones((), device=ctx.device)
        self.loss_fn: LossFn = token_sum_cross_entropy
        group = ctx.mesh["pp"].get_group()
        self.group, config = group, ctx.config
        count = ctx.pp_size * config.pipeline_virtual_stages
        places = [
            stage_indices(r, ctx.pp_size, config.pipeline_virtual_stages, config.pipeline_schedule)
            for r in range(ctx.pp_size)
        ]
        self.last = next(r for r, held in enumerate(places) if count - 1 in held)
        stages = [
            PipelineStage(module, _stage_index(ctx, module), count, ctx.device, group=group)
            for module in pipeline_roots(model)
        ]
        self.holds_last = any(stage.is_last for stage in stages)
        kind = getattr(pipelining, SCHEDULES[ctx.config.pipeline_schedule])
        self.schedule = kind(
            stages if len(stages) > 1 else stages[0],
            n_microbatches=micro,
            loss_fn=self._loss,
            scale_grads=False,
        )
        self.holds_first = any(stage.is_first for stage in stages)
        for stage in stages:
            _uncounted_inference(stage)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) / self.divisor


def _uncounted_inference(stage) -> None:
    """Keep the forward torch 2.13's stage runs on its first step to infer
    shapes (on stand-in tensors past the first stage) out of the router
    statistics (``ctx.router_stats``)."""
    from ray_fsdp_backend.metrics.router import uncounted

    infer = getattr(stage, "_forward_metadata_inference", None)
    if infer is None:
        return

    def quiet(*args, **kwargs):
        with uncounted():
            return infer(*args, **kwargs)

    stage._forward_metadata_inference = quiet


def pipeline_step(
    ctx, model: nn.Module, batch: dict[str, torch.Tensor], loss_fn: LossFn | None
) -> torch.Tensor:
    """Run forward and backward of ``batch`` (``input_ids`` and ``labels``
    aligned as transformers takes them, or ``targets`` already shifted,
    ``[rows, seq]``: this dp rank's rows of the step; every stage of a
    pipeline passes the same; optional ``position_ids``, which every stage
    receives for its micro-batch: packed rows' document positions) through
    ``model`` (a stage :meth:`TrainContext.wrap` cut and sharded). Returns the
    step's loss on every rank: the sum over micro-batches of ``loss_fn(logits,
    shifted_labels)`` (a token sum; default: cross-entropy summed) over
    ``ctx.global_token_count``, from the last stage. Gradients accumulate on
    the stage's parameters; no other gradient sync is needed."""
    pipe, ids, targets, kwargs = _prepare(ctx, model, batch, loss_fn, "step")
    pipe.divisor = ctx.global_token_count(targets).to(ctx.device)
    return _run(ctx, model, pipe, pipe.schedule.step, (ids, targets, kwargs))


def pipeline_eval(
    ctx, model: nn.Module, batch: dict[str, torch.Tensor], loss_fn: LossFn | None = None
) -> torch.Tensor:
    """Forward only (the schedule's ``eval``): the token sum of ``loss_fn``
    over ``batch`` (as :func:`pipeline_step` takes it), on every rank of the
    pipeline; no gradients, no division. The gradients a ``pipeline_step``
    left for the optimizer stay as they were."""
    pipe, ids, targets, kwargs = _prepare(ctx, model, batch, loss_fn, "eval")
    pipe.divisor = torch.ones((), device=ctx.device)
    with torch.no_grad():
        return _run(ctx, model, pipe, pipe.schedule.eval, (ids, targets, kwargs))


def _prepare(ctx, model, batch, loss_fn, mode: str):
    """The stage's pipeline (built once per mode and micro-batch shape), the
    ids, the shifted targets and the keyword inputs every stage takes.
    Labels are shifted per document when ``position_ids`` restart inside a
    row (packed rows): a document's last token predicts nothing, as in
    :func:`~ray_fsdp_backend.context_parallel.sequence.shift_labels`."""
    if "input_ids" not in batch or not {"labels", "targets"} & set(batch):
        raise ValueError(
            f"pipeline_step needs input_ids and labels (or shifted targets), got {sorted(batch)}"
        )
    rows = batch["input_ids"].shape[0]
    micro = resolve_microbatches(ctx.config.pipeline_microbatches, ctx.pp_size, rows)
    # One stage and schedule per mode and micro-batch shape: a stage's receive
    # buffers keep the shape it first saw, and torch 2.13 re-runs its shape
    # inference (a forward and a backward) whenever one schedule switches
    # between step and eval.
    pipes = model.__dict__.setdefault("_rfb_pipelines", {})
    key = (mode, micro, *batch["input_ids"].shape)
    pipe = pipes.get(key)
    if pipe is None:
        pipe = pipes[key] = _Pipeline(ctx, model, micro)
    kwargs = {}
    if batch.get("position_ids") is not None:
        kwargs["position_ids"] = batch["position_ids"].expand(rows, -1).to(ctx.device)
    if "targets" in batch:
        targets = batch["targets"].to(ctx.device)
    else:
        labels = {"labels": batch["labels"], **kwargs}
        targets = ctx.shard_sequence(labels)["labels"].to(ctx.device)
    pipe.loss_fn = loss_fn or token_sum_cross_entropy
    return pipe, batch["input_ids"].to(ctx.device), targets, kwargs


@contextlib.contextmanager
def _gradients_kept(model: nn.Module) -> Iterator[None]:
    """Gradients accumulated before a schedule's run survive it, and the
    run's own are added to them.

    torch 2.13's ``PipelineStage`` infers shapes with a real forward (and
    backward) on a schedule's first run and on a train -> eval switch; its
    cleanup (``_post_metadata_inference_cleanup``) sets every FSDP
    parameter's ``.grad`` to None. A ``pipeline_eval`` (or a ``pipeline_step``
    of a new shape) between ``pipeline_step`` and ``opt.step()`` then left the
    optimizer no gradient: the norm read 0 and the step did nothing."""
    held = [(p, p.grad) for p in model.parameters() if p.grad is not None]
    for param, _ in held:
        param.grad = None
    try:
        yield
    finally:
        with torch.no_grad():
            for param, grad in held:
                param.grad = grad if param.grad is None else param.grad.add_(grad)


def _stage_index(ctx, module: nn.Module) -> int:
    """The global stage index of ``module`` (its split plan's), checked
    against where the schedule places this rank's stages."""
    from ray_fsdp_backend.planning.pipeline_schedules import stage_indices

    config = ctx.config
    index = module.pipeline_plan.stage
    placed = stage_indices(
        ctx.pp_rank, ctx.pp_size, config.pipeline_virtual_stages, config.pipeline_schedule
    )
    if index not in placed:
        raise ValueError(
            f"pipeline_schedule={config.pipeline_schedule!r} places stages {placed} on pipeline "
            f"rank {ctx.pp_rank}, but the model holds stage {index}: wrap it with this config"
        )
    return index


def _run(ctx, model: nn.Module, pipe: _Pipeline, run, inputs: tuple) -> torch.Tensor:
    """``run`` (the schedule's step or eval) on this rank's stages (the first
    stage takes the ids, the last the targets; ZBV holds both on rank 0);
    the summed micro-batch losses broadcast from the rank holding the last.
    ``inputs``: the ids, the targets and the keyword inputs."""
    ids, targets, kwargs = inputs
    losses: list[torch.Tensor] = []
    args = (ids,) if pipe.holds_first else ()
    with _gradients_kept(model):
        if pipe.holds_last:
            run(*args, target=targets, losses=losses, **kwargs)
        else:
            run(*args, **kwargs)
    loss = torch.zeros((), dtype=torch.float32, device=ctx.device)
    if losses:
        loss = torch.stack([part.detach().float() for part in losses]).sum()
    dist.broadcast(loss, group_src=pipe.last, group=pipe.group)
    return loss
