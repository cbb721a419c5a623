"""The ``train_loop_per_worker`` that ``ray-fsdp train`` runs on every worker.

It reads top to bottom like nanoGPT's ``train.py``: build the model on the
meta device, let the backend shard and initialise it, build the optimizer and
data, restore a checkpoint if the run has one, then repeat micro-batches
(all but the last under ``no_sync``), clip, step, and report. Rank 0 prints a
progress line every ``train.log_every`` steps (throughput, MFU, memory and
ETA from ``ctx.step_meter``; TensorBoard scalars with ``logging.tensorboard``)
and returns the metric history, which the driver turns into
``metrics.jsonl`` and ``loss_curve.png``.

``loop_config`` is the training YAML document after ``--set`` overrides (see
:mod:`ray_fsdp_backend.trainer.spec`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Any

import ray.train
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ray_fsdp_backend as rfb
from ray_fsdp_backend.elastic import split_global_batch
from ray_fsdp_backend.metrics.flops import format_progress
from ray_fsdp_backend.metrics.reporting import TensorBoardWriter, show_ray_report_lines
from ray_fsdp_backend.trainer.data import RayDataBatches, ShardedBatches, load_corpus
from ray_fsdp_backend.trainer.model import Transformer
from ray_fsdp_backend.trainer.pretrained import (
    PretrainedModelConfig,
    build_pretrained,
    tokenize_corpus,
)
from ray_fsdp_backend.trainer.spec import RunSpec, TrainOptions, build_spec

# Progress goes through logging, not print: Ray Train V2 (2.60) patches a
# worker's print to write to stdout *and* its logger, so the driver shows
# every printed line twice.
_logger = logging.getLogger(__name__)


def train_loop_per_worker(loop_config: dict[str, Any]) -> list[dict[str, float]]:
    """Train the example model; returns the logged history (rank 0's is used)."""
    ctx = rfb.get_context()
    spec = fit_global_batch(build_spec(loop_config), ctx.dp_size, ctx.world_rank)
    opts = spec.train
    show_ray_report_lines(spec.logging.verbose)
    torch.manual_seed(opts.seed)

    if isinstance(spec.model, PretrainedModelConfig):
        model = build_pretrained(ctx, spec.model)  # wraps, then loads shard by shard
    else:
        with torch.device("meta"):
            model = Transformer(spec.model)
        model = ctx.wrap(model)  # shards, materialises and calls init_weights()
    optimizer = build_optimizer(model, spec)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, opts))
    batches = build_batches(spec, ctx.dp_rank, ctx.dp_size)
    checkpoints = CheckpointHooks(
        ctx, every=opts.checkpoint_every, async_save=opts.checkpoint_async
    )
    start_step = checkpoints.restore(model, optimizer, schedule, batches)

    history: list[dict[str, float]] = []
    tokens_per_step = opts.micro_batch_size * opts.grad_accum * spec.model.seq_len * ctx.dp_size
    meter = ctx.step_meter(
        model,
        seq_len=spec.model.seq_len,
        total_steps=opts.steps,
        start_step=start_step,
        start_tokens=start_step * tokens_per_step,
    )
    board = None
    if spec.logging.tensorboard and ctx.world_rank == 0:
        board = TensorBoardWriter(spec.logging.tensorboard)
    for step in range(start_step + 1, opts.steps + 1):
        loss, grad_norm = train_step(ctx, model, optimizer, batches, spec, meter)
        schedule.step()
        logged = step % opts.log_every == 0 or step in (start_step + 1, opts.steps)
        if not (logged or checkpoints.due(step)):
            continue
        # Collective: every rank reaches this line at the same steps.
        metrics = {
            "step": step,
            "loss": mean_across_ranks(loss.detach(), ctx.device),
            "grad_norm": float(grad_norm),
            "lr": schedule.get_last_lr()[0],
            "data_position": batches.position,
            "world_size": ctx.world_size,
            **meter.measure(step),
        }
        history.append(metrics)
        if ctx.world_rank == 0:
            _logger.info(format_progress(metrics, opts.steps))
        if board is not None:
            board.write(metrics, step)
        extra_state = {
            "step": step,
            "data": batches.state_dict(),
            "schedule": schedule.state_dict(),
        }
        checkpoints.report(step, model, optimizer, metrics, extra_state)
    if board is not None:
        board.close()
    if getattr(spec.model, "export", None):
        ctx.export_model(model, spec.model.export)  # Hugging Face layout
    return history


def fit_global_batch(spec: RunSpec, dp_size: int, world_rank: int) -> RunSpec:
    """With ``train.global_batch_size``: the spec with this (re)start's
    micro-batch and ``grad_accum`` for ``dp_size`` ranks (logged); raises
    ValueError when the global batch cannot be split over them."""
    opts = spec.train
    if opts.global_batch_size is None:
        return spec
    split = split_global_batch(opts.global_batch_size, dp_size, opts.micro_batch_size)
    if world_rank == 0:
        _logger.info("elastic batch: %s", split.describe())
    train = dataclasses.replace(
        opts, micro_batch_size=split.micro_batch_size, grad_accum=split.grad_accum
    )
    return dataclasses.replace(spec, train=train)


def train_step(
    ctx, model: nn.Module, optimizer, batches, spec: RunSpec, meter=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over ``grad_accum`` micro-batches; returns this rank's
    mean loss and the global pre-clip gradient norm. ``meter`` (a
    ``StepMeter``) counts the tokens trained."""
    accum = spec.train.grad_accum
    total = torch.zeros((), device=ctx.device)
    for micro in range(accum):
        inputs, targets = (t.to(ctx.device, non_blocking=True) for t in batches.next_batch())
        if meter is not None:
            meter.count_tokens(inputs.numel())
        # Gradients sync only on the last micro-batch: one all-reduce per step.
        sync = contextlib.nullcontext() if micro == accum - 1 else ctx.no_sync(model)
        with sync:
            logits = model(inputs)
            logits = getattr(logits, "logits", logits)  # a transformers model's output
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) / accum
            loss.backward()
        total += loss.detach()
    # max_grad_norm 0 (or null): no clipping, the norm is still measured.
    grad_norm = ctx.clip_grad_norm(model, spec.train.max_grad_norm or None, optimizer=optimizer)
    if torch.isfinite(grad_norm):
        optimizer.step()
    else:  # every rank sees the same global norm, so all skip together
        _logger.warning("step skipped: gradient norm is %s", float(grad_norm))
    optimizer.zero_grad(set_to_none=True)
    return total, grad_norm


def build_optimizer(model: nn.Module, spec: RunSpec) -> torch.optim.Optimizer:
    """AdamW (decay on 2-D weights only), or distributed Muon for the blocks'
    matrices with AdamW for the rest."""
    opts = spec.train
    if opts.optimizer == "muon":
        from ray_fsdp_backend.dmuon.optimizer import Muon

        return Muon(
            model,
            lr=opts.lr,
            weight_decay=opts.weight_decay,
            adamw_lr=opts.adamw_lr,
            adamw_weight_decay=0.0,
        )
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": opts.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_factor(step: int, opts: TrainOptions) -> float:
    """Linear warmup to 1, then cosine decay to ``min_lr_ratio``."""
    if step < opts.warmup_steps:
        return (step + 1) / opts.warmup_steps
    progress = (step - opts.warmup_steps) / max(1, opts.steps - opts.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return opts.min_lr_ratio + (1 - opts.min_lr_ratio) * cosine


def build_batches(spec: RunSpec, dp_rank: int, dp_size: int):
    """This rank's micro-batch stream: the sharded corpus, or its Ray Data shard."""
    opts, seq_len = spec.train, spec.model.seq_len
    if spec.data.source == "ray_data":
        shard = ray.train.get_dataset_shard("train")
        return RayDataBatches(shard, opts.micro_batch_size, dp_size)
    if isinstance(spec.model, PretrainedModelConfig):
        tokens = tokenize_corpus(spec.model, spec.data.path)
    else:
        tokens = load_corpus(spec.data.path)
    return ShardedBatches(tokens, seq_len, opts.micro_batch_size, dp_rank, dp_size, seed=opts.seed)


def mean_across_ranks(value: torch.Tensor, device: torch.device) -> float:
    """Mean of a scalar over all ranks (SUM then divide: gloo lacks a reliable AVG)."""
    t = value.detach().float().reshape(1).to(device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t) / dist.get_world_size()


class CheckpointHooks:
    """Checkpoints every ``every`` steps through the context's helpers, plain
    metric reports between them (and always with ``every`` 0). The loop calls
    :meth:`restore` once and :meth:`report` at every logged step.
    """

    def __init__(self, ctx, every: int, async_save: bool = False) -> None:
        self.ctx, self.every, self.async_save = ctx, every, async_save
        self.enabled = every > 0

    def due(self, step: int) -> bool:
        return self.enabled and step % self.every == 0

    def restore(self, model, optimizer, schedule, batches) -> int:
        """Load the latest checkpoint if the run has one; returns its step (0: none)."""
        extra = self.ctx.restore_checkpoint(model, optimizer)
        if not extra:
            return 0
        batches.load_state_dict(extra["data"])
        schedule.load_state_dict(extra["schedule"])
        if self.ctx.world_rank == 0:
            _logger.info("resumed from step %d", extra["step"])
        return int(extra["step"])

    def report(self, step, model, optimizer, metrics, extra_state) -> None:
        """A checkpoint when one is due, else a metrics-only report (every rank)."""
        if self.due(step):
            self.ctx.save_checkpoint(
                model, optimizer, metrics, extra_state=extra_state, async_save=self.async_save
            )
        else:
            ray.train.report(metrics)
