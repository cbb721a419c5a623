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


def pipeline_errors(dist, model, train, data) -> list[str]:
    """What ``ray-fsdp train`` cannot run under ``pipeline_parallel_size > 1``,
    found on the driver: the model the split refuses (its family, tied
    embeddings, fewer layers than P x V stages: the split itself runs on a meta
    model), LoRA adapters, and step (or held-out) rows that do not cut into
    ``pipeline_microbatches`` equal micro-batches."""
    if dist is None or dist.pipeline_parallel_size == 1 or model is None:
        return []
    from ray_fsdp_backend.planning.pipeline_layout import resolve_microbatches

    pp = dist.pipeline_parallel_size
    key = f"distributed.pipeline_parallel_size={pp}"
    if getattr(model, "lora", None) is not None:
        return [f"{key} with model.lora: LoRA adapters are not split into pipeline stages"]
    error = _split_error(model, pp * dist.pipeline_virtual_stages)
    if error:
        return [f"{key}: {error}"]
    micro = resolve_microbatches(dist.pipeline_microbatches, pp)
    rows = []
    if train is not None and train.global_batch_size is None:
        rows.append(
            ("train.micro_batch_size x train.grad_accum", train.micro_batch_size * train.grad_accum)
        )
    if train is not None and data is not None and data.has_eval:
        rows.append(("train.micro_batch_size (held-out batches)", train.micro_batch_size))
    return [
        f"{name}={n} with {key}: the rows must split into pipeline_microbatches={micro} "
        "equal micro-batches"
        for name, n in rows
        if n % micro
    ]


def _split_error(model, stages: int) -> str | None:
    """Why the split refuses ``model`` cut into ``stages`` stages, or None: by
    the split's own rules (no torch) for the built-in decoder from its config
    and for a local checkpoint of a family :mod:`~ray_fsdp_backend.hf.shapes`
    reads from its ``config.json``; any other pretrained model by splitting it
    on the meta device."""
    from ray_fsdp_backend.planning.pipeline_layout import plan_stages, tied_embeddings_error

    rules = _split_rules(model)
    try:
        if rules is None:
            from ray_fsdp_backend.hf.models import build_causal_lm  # on the meta device
            from ray_fsdp_backend.pipeline.split import split_for_stage

            split_for_stage(build_causal_lm(model.pretrained), 0, stages)
            return None
        model_class, tied, n_layers = rules
        if tied:
            return tied_embeddings_error(model_class)
        plan_stages(n_layers, stages)
    except ValueError as error:
        return str(error)
    return None


def _split_rules(model) -> tuple[str, bool, int] | None:
    """What the split checks, read without building the model: the class name
    its refusal names, whether the embeddings are tied, the layer count. The
    built-in decoder from its config; a local checkpoint of a family in
    :data:`~ray_fsdp_backend.hf.shapes.SHAPE_FAMILIES` from ``config.json``
    (``architectures`` naming its causal LM class; ``tie_word_embeddings``,
    False by default in each of them, as transformers ties); else None.
    ``tests/unit/test_pipeline_split_rules.py`` holds them to the meta split."""
    from ray_fsdp_backend.models.config import ModelConfig

    if isinstance(model, ModelConfig):
        return "Transformer", model.tie_embeddings, model.n_layers
    from ray_fsdp_backend.hf.shapes import read_local_shapes

    ckpt = read_local_shapes(model.pretrained)
    config = ckpt.config if ckpt is not None else {}
    architectures = config.get("architectures")
    if not (isinstance(architectures, list) and len(architectures) == 1):
        return None
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or config.get("use_bidirectional_attention"):
        return None  # the meta model's family check names the variant
    return str(architectures[0]), bool(config.get("tie_word_embeddings", False)), layers


def pipeline_flops_per_token(ctx, model: nn.Module, seq_len: int) -> float:
    """The whole model's FLOPs per token for the step meter: each stage's
    estimate (its layers, its embedding or head) summed over the pp group,
    since a token passes every stage."""
    import torch
    import torch.distributed as dist

    from ray_fsdp_backend.metrics.reporting import estimate_flops_per_token

    own = estimate_flops_per_token(model, seq_len, ctx.config.fsdp_block_classes)
    total = torch.tensor(float(own), dtype=torch.float64)
    dist.all_reduce(total, group=ctx.mesh["pp"].get_group())
    return float(total)
