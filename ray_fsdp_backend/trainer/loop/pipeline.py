"""The trainer's step under pipeline parallelism (``distributed.pipeline_parallel_size > 1``).

Every rank of a pipeline reads the same rows (the data shards by dp rank,
which the ``pp`` axis does not change), so the step's ``grad_accum``
micro-batches of ``micro_batch_size`` rows are joined into one batch that
``ctx.pipeline_step`` cuts into ``pipeline_microbatches`` pipeline
micro-batches. The last stage computes the loss on each pipeline
micro-batch's whole logits (``train.loss_chunk_tokens`` does not apply: the
stage's output is the logits); the loss is the project's token-exact rule,
returned on every rank. Packed rows' ``position_ids`` reach every stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the driver's check of a built-in decoder imports no torch
    import torch
    from torch import nn


def join_rows(micro_batches: list[dict[str, torch.Tensor]], packed: bool) -> dict:
    """The step's micro-batches as one batch of rows; ``position_ids`` kept
    for packed rows only (whole rows take the plain causal mask)."""
    import torch

    keys = ["input_ids", "targets"] + ["position_ids"] * packed
    return {key: torch.cat([batch[key] for batch in micro_batches]) for key in keys}


def pipeline_loss(
    ctx, model: nn.Module, micro_batches: list[dict[str, torch.Tensor]], packed: bool
) -> torch.Tensor:
    """Forward and backward of the step's rows through the pipeline; returns
    this rank's share of the step's loss (the mean over the dp ranks is the
    step's token mean), equal on the ranks of one pipeline."""
    return ctx.pipeline_step(model, join_rows(micro_batches, packed))


def pipeline_token_sum(ctx, model: nn.Module, batch: dict, packed: bool) -> torch.Tensor:
    """The held-out token sum of ``batch`` (a micro-batch as
    ``ctx.shard_sequence`` returned it), forward only through the pipeline."""
    from ray_fsdp_backend.pipeline.step import pipeline_eval

    return pipeline_eval(ctx, model, join_rows([batch], packed))


def pipeline_flops_per_token(ctx, model: nn.Module, seq_len: int) -> float:
    """The whole model's FLOPs per token for the step meter: each stage's
    estimate (its layers, its embedding or head) summed over the pp group,
    since a token passes every stage."""
    import torch
    import torch.distributed as dist

    from ray_fsdp_backend.metrics.reporting import estimate_flops_per_token

    own = estimate_flops_per_token(model, seq_len, ctx.config.fsdp_block_classes)
    total = torch.tensor(float(own), dtype=torch.float64, device=ctx.device)
    dist.all_reduce(total, group=ctx.mesh["pp"].get_group())
    return float(total)
