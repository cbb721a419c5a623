"""The ``train_loop_per_worker`` that ``ray-fsdp train`` runs on every worker.

It reads top to bottom like nanoGPT's ``train.py``: build the model on the
meta device, let the backend shard and initialise it, build the optimizer and
data, restore a checkpoint if the run has one (:func:`setup_run`), then
repeat micro-batches (all but the last under ``no_sync``), clip, step
(:func:`~ray_fsdp_backend.trainer.loop.step.train_step`), and report
(:func:`log_step`). Rank 0 prints a
progress line every ``train.log_every`` steps (throughput, MFU, memory and
ETA from ``ctx.step_meter``; TensorBoard scalars with ``logging.tensorboard``)
and returns the metric history, which the driver turns into
``metrics.jsonl`` and ``loss_curve.png``. Ray hears from the loop only with
a checkpoint: each ``ray.train.report`` is a barrier that can wait up to
2 s for Ray 2.60's controller (docs/monitoring.md), so none sits on a
logged step.

A step that does not log never waits for the device: the loss, the gradient
norm and the count of skipped steps stay on it, a step whose norm is not
finite is skipped there (``found_inf``, as ``GradScaler`` does), and a
logged step reads them all in one copy. :func:`run_training` is the loop
without Ray's entry, for benchmarks and tests that build their own context.

``loop_config`` is the training YAML document after ``--set`` overrides (see
:mod:`ray_fsdp_backend.trainer.schema.spec`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray.train
import torch
from torch import nn

import ray_fsdp_backend as rfb
from ray_fsdp_backend.context_parallel.sequence import count_valid_tokens
from ray_fsdp_backend.distributed.seeding import seed_step
from ray_fsdp_backend.metrics.flops import format_progress
from ray_fsdp_backend.metrics.reporting import TensorBoardWriter, quiet_console
from ray_fsdp_backend.models.decoder import Transformer
from ray_fsdp_backend.ops.head import prepare_loss
from ray_fsdp_backend.ops.quantization import keep_torchao_unimported
from ray_fsdp_backend.planning.elastic import split_global_batch
from ray_fsdp_backend.trainer.data.corpus import (
    PackedBatches,
    RayDataBatches,
    ShardedBatches,
    load_corpus,
    tokenize_corpus,
)
from ray_fsdp_backend.trainer.data.sft import is_small
from ray_fsdp_backend.trainer.data.sft_batches import (
    EVAL_DATASET,
    SftBatches,
    eval_batches,
    to_micro_batch,
)
from ray_fsdp_backend.trainer.loop.checkpoints import CheckpointHooks
from ray_fsdp_backend.trainer.loop.evaluation import evaluate
from ray_fsdp_backend.trainer.loop.optim import build_optimizer, lr_factor
from ray_fsdp_backend.trainer.loop.pipeline import pipeline_flops_per_token, pipeline_token_sum
from ray_fsdp_backend.trainer.loop.pretrained import build_pretrained
from ray_fsdp_backend.trainer.loop.step import (
    StepResult,
    as_batch,
    batch_loss,
    build_objective,
    local_value,
    train_step,
)
from ray_fsdp_backend.trainer.schema.pretrained import PretrainedModelConfig
from ray_fsdp_backend.trainer.schema.spec import RunSpec, TrainOptions, build_spec

# Progress goes through logging, not print: Ray Train V2 (2.60) patches a
# worker's print to write to stdout *and* its logger, so the driver shows
# every printed line twice.
_logger = logging.getLogger(__name__)


def train_loop_per_worker(loop_config: dict[str, Any]) -> list[dict[str, float]]:
    """Train the example model; returns the logged history (rank 0's is used)."""
    if not quantizes(loop_config):
        keep_torchao_unimported()  # before the spec's checks build a transformers model
    ctx = rfb.get_context()
    spec = fit_global_batch(build_spec(loop_config), ctx.dp_size, ctx.world_rank)
    quiet_console(spec.logging.verbose)
    if spec.train.objective == "grpo":  # samples from rollout engines, not a dataset
        from ray_fsdp_backend.trainer.loop.grpo import run_grpo

        return run_grpo(ctx, spec)
    return run_training(ctx, spec)


def quantizes(loop_config: dict[str, Any]) -> bool:
    """Whether the run's base is quantised (``model.lora.base_quantization``)."""
    lora = (loop_config.get("model") or {}).get("lora") or {}
    return isinstance(lora, dict) and lora.get("base_quantization") is not None


@dataclass
class TrainRun:
    """What :func:`setup_run` builds and the loop steps through."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    batches: Any
    checkpoints: CheckpointHooks
    meter: Any
    start_step: int
    skipped: torch.Tensor
    """Steps skipped for a non-finite gradient norm (a 0-d device tensor,
    read only at logged steps), counted over the whole run across restarts."""
    skipped_logged: int = 0
    board: TensorBoardWriter | None = None
    loss_head: Any = None
    """The loss's output head (:func:`~ray_fsdp_backend.ops.head.prepare_loss`;
    None: the full logits)."""
    router: Any = None
    """A mixture-of-experts model's :class:`RouterStats` (no hooks on a dense one)."""
    held_out: Any = None
    """The held-out dataset (``data.eval_path`` / ``eval_fraction``), whole on every rank."""
    objective: Any = None
    """What each micro-batch's loss is (``train.objective``;
    :func:`~ray_fsdp_backend.trainer.loop.objectives.build_objective`), None under pp."""
    history: list[dict[str, float]] = field(default_factory=list)


def run_training(
    ctx,
    spec: RunSpec,
    *,
    report: Callable[[dict], None] | None = None,
    on_step: Callable[[int], None] | None = None,
    resume: bool = True,
) -> list[dict[str, float]]:
    """Set up the run and train from the restored step to ``train.steps``;
    returns the logged history. ``report`` receives the metrics of every
    logged step that saves no checkpoint (default: none, Ray hears only
    with checkpoints);
    ``on_step(step)`` runs after every step (benchmarks time and profile
    with it); ``resume=False`` starts fresh without asking Ray for a
    checkpoint (outside a Ray Train run). Between logged steps nothing is
    read on the host."""
    run = setup_run(ctx, spec, report=report, resume=resume)
    for step in range(run.start_step + 1, spec.train.steps + 1):
        seed_step(ctx, spec.train.seed, step)
        result = train_step(
            ctx, run.model, run.optimizer, run.batches, spec, run.meter, objective=run.objective
        )
        run.skipped += result.skipped
        run.schedule.step()
        held_out = None
        if run.held_out is not None and is_eval_step(step, spec.train):
            held_out = held_out_metrics(ctx, spec, run)
        logged = is_logged(step, run.start_step, spec.train) or held_out is not None
        if logged or run.checkpoints.due(step):
            log_step(ctx, spec, run, step, result, held_out)
        if on_step is not None:
            on_step(step)
    if run.board is not None:
        run.board.close()
    if isinstance(spec.model, PretrainedModelConfig) and spec.model.export:
        model = spec.model
        ctx.export_model(
            run.model, model.export, format=model.export_format, overwrite=model.export_overwrite
        )
    return run.history


def setup_run(
    ctx, spec: RunSpec, *, report: Callable[[dict], None] | None = None, resume: bool = True
) -> TrainRun:
    """Build the model (wrapped by the backend), optimizer, schedule, data,
    checkpoint hooks and meter, and (``resume``) restore the run's latest
    checkpoint."""
    opts = spec.train
    torch.manual_seed(opts.seed)
    if isinstance(spec.model, PretrainedModelConfig):
        reward = opts.objective == "reward"  # the decoder with a scalar head
        model = build_pretrained(ctx, spec.model, reward=reward)  # wraps, then loads by shard
    else:
        with torch.device("meta"):
            model = Transformer(spec.model)
        model = ctx.wrap(model)  # shards, materialises and calls init_weights()
    optimizer = build_optimizer(model, spec)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, opts))
    batches = build_batches(spec, ctx.dp_rank, ctx.dp_size)
    checkpoints = CheckpointHooks(
        ctx, every=opts.checkpoint_every, async_save=opts.checkpoint_async, report=report
    )
    no_head = ctx.pp_size > 1 or opts.objective == "reward"  # reward: a scalar head
    loss_head = None if no_head else prepare_loss(model, opts.loss_chunk_tokens)
    objective = None if ctx.pp_size > 1 else build_objective(ctx, model, spec, loss_head)
    extra = checkpoints.restore(model, optimizer, schedule, batches) if resume else {}
    held_out = ray.train.get_dataset_shard(EVAL_DATASET) if spec.data.has_eval else None
    if objective is not None:
        objective.load_state_dict(extra.get("objective", {}))
        objective.before_training(ctx, model, *precompute_rows(ctx, spec, held_out))
    start_step, skipped = int(extra.get("step", 0)), int(extra.get("skipped_steps", 0))
    tokens_per_step = opts.micro_batch_size * opts.grad_accum * spec.model.seq_len * ctx.dp_size
    meter = ctx.step_meter(
        model,
        seq_len=spec.model.seq_len,
        total_steps=opts.steps,
        start_step=start_step,
        start_tokens=start_step * tokens_per_step,
        # Under pp a rank holds one stage; MFU counts the whole model's FLOPs.
        flops_per_token=(
            pipeline_flops_per_token(ctx, model, spec.model.seq_len) if ctx.pp_size > 1 else None
        ),
    )
    board = None
    if spec.logging.tensorboard and ctx.world_rank == 0:
        board = TensorBoardWriter(spec.logging.tensorboard)
    return TrainRun(
        model=model,
        optimizer=optimizer,
        schedule=schedule,
        batches=batches,
        checkpoints=checkpoints,
        meter=meter,
        start_step=start_step,
        skipped=torch.tensor(float(skipped), device=ctx.device),
        skipped_logged=skipped,
        board=board,
        router=ctx.router_stats(model),
        held_out=held_out,
        # Under pp the last stage's output is the logits (trainer/pipeline.py).
        loss_head=loss_head,
        objective=objective,
    )


def precompute_rows(ctx, spec: RunSpec, held_out) -> tuple:
    """Callables giving this rank's training rows (one pass over its shard)
    and its share of the held-out rows as micro-batches (None: no held-out
    set), read only by an objective that needs them before the first step
    (``dpo``'s ``reference: precompute``)."""
    micro = spec.train.micro_batch_size

    def train_rows():
        shard = ray.train.get_dataset_shard("train")
        rows = shard.iter_torch_batches(batch_size=micro, drop_last=False)
        return (to_micro_batch(batch) for batch in rows)

    def held_out_rows():
        rows = held_out.iter_torch_batches(batch_size=micro * ctx.dp_size, drop_last=False)
        return eval_batches(rows, micro, ctx.dp_rank, ctx.dp_size)

    return train_rows, None if held_out is None else held_out_rows


def is_logged(step: int, start_step: int, opts: TrainOptions) -> bool:
    """Whether ``step`` reports metrics: every ``log_every`` steps, the first
    step of a (re)start and the last one."""
    return step % opts.log_every == 0 or step in (start_step + 1, opts.steps)


def is_eval_step(step: int, opts: TrainOptions) -> bool:
    """Whether the held-out loss is measured after ``step``: every
    ``eval_every`` steps (0: never) and after the last."""
    return step == opts.steps or (opts.eval_every > 0 and step % opts.eval_every == 0)


def held_out_metrics(ctx, spec: RunSpec, run: TrainRun) -> dict[str, float]:
    """The held-out metrics: ``eval_loss`` (and the objective's ``eval/...``)."""
    if spec.train.objective == "sft" or ctx.pp_size > 1:
        return {"eval_loss": held_out_loss(ctx, run.model, spec, run.held_out, run.loss_head)}
    micro = spec.train.micro_batch_size
    rows = run.held_out.iter_torch_batches(batch_size=micro * ctx.dp_size, drop_last=False)
    batches = eval_batches(rows, micro, ctx.dp_rank, ctx.dp_size)
    return run.objective.evaluate(ctx, run.model, (as_batch(b, ctx.device) for b in batches))


def held_out_loss(ctx, model: nn.Module, spec: RunSpec, dataset, head=...) -> float:
    """The token-mean loss over the whole held-out set, each dp rank its
    share, through :func:`batch_loss` (the training step's loss)."""

    def sums(rows):
        batch = ctx.shard_sequence(as_batch(rows, ctx.device))
        if ctx.pp_size > 1:  # forward only through the stages, the sum on every rank
            token_sum = pipeline_token_sum(ctx, model, batch, spec.data.packing)
            return token_sum, count_valid_tokens(batch["targets"])
        with ctx.sequence_region(), ctx.loss_parallel():
            token_sum, _ = batch_loss(ctx, model, batch, spec, head)
        return local_value(token_sum), count_valid_tokens(batch["targets"])

    micro = spec.train.micro_batch_size
    rows = dataset.iter_torch_batches(batch_size=micro * ctx.dp_size, drop_last=False)
    return evaluate(model, eval_batches(rows, micro, ctx.dp_rank, ctx.dp_size), sums, ctx.device)


def log_step(
    ctx, spec: RunSpec, run: TrainRun, step: int, result: StepResult, held_out=None
) -> dict:
    """Report ``step``'s metrics (and save a checkpoint when one is due),
    with the held-out metrics when measured at this step. Collective: every
    rank reaches it at the same steps. The step's device scalars cross to
    the host here, in one copy (``StepMeter.measure``)."""
    mean = {"loss": result.loss, **(result.stats or {})}
    if result.aux_loss is not None:  # transformers' load-balancing loss, averaged over ranks
        mean["aux_loss"] = result.aux_loss
    metrics = {
        "step": step,
        **run.meter.measure(
            step, mean=mean, same={"grad_norm": result.grad_norm, "skipped_steps": run.skipped}
        ),
        **run.router.collect(),  # per-layer expert load over the global batch (docs/moe.md)
        **(held_out or {}),
        "lr": run.schedule.get_last_lr()[0],
        "data_position": run.batches.position,
        "world_size": ctx.world_size,
    }
    skipped = int(metrics["skipped_steps"])
    if skipped > run.skipped_logged and ctx.world_rank == 0:
        _logger.warning(
            "%d step(s) up to step %d skipped: gradient norm inf or NaN (%d in the run)",
            skipped - run.skipped_logged,
            step,
            skipped,
        )
    run.skipped_logged = skipped
    run.history.append(metrics)
    if ctx.world_rank == 0:
        _logger.info(format_progress(metrics, spec.train.steps))
    if run.board is not None:
        run.board.write(metrics, step)
    extra_state = {
        "step": step,
        "data": run.batches.state_dict(),
        "schedule": run.schedule.state_dict(),
        "skipped_steps": skipped,
        **({} if run.objective is None else {"objective": run.objective.state_dict()}),
    }
    run.checkpoints.report(step, run.model, run.optimizer, metrics, extra_state)
    return metrics


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


def build_batches(spec: RunSpec, dp_rank: int, dp_size: int):
    """This rank's micro-batch stream: the sharded corpus, or its Ray Data shard."""
    opts, seq_len = spec.train, spec.model.seq_len
    if spec.data.is_sft:  # rfb.sft_dataset rows, built on the driver
        shard, small = ray.train.get_dataset_shard("train"), is_small(spec.data.path)
        return SftBatches(
            shard, opts.micro_batch_size, dp_size, seq_len=seq_len, seed=opts.seed, hold_rows=small
        )
    if spec.data.source == "ray_data":
        shard = ray.train.get_dataset_shard("train")
        return RayDataBatches(shard, opts.micro_batch_size, dp_size)
    if isinstance(spec.model, PretrainedModelConfig):
        tokens = tokenize_corpus(spec.model, spec.data.path)
    else:
        tokens = load_corpus(spec.data.path)
    rows = PackedBatches if spec.data.packing else ShardedBatches
    return rows(tokens, seq_len, opts.micro_batch_size, dp_rank, dp_size, seed=opts.seed)
