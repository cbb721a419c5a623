"""What ``ray-fsdp train`` refuses under pipeline parallelism, found on the
driver before any worker starts: a model the split refuses (read by the
split's own rules from the config where they can, else a meta model), LoRA
adapters, rows that do not cut into the pipeline's micro-batches. No torch
for the built-in decoder or a local checkpoint of a family the rules read."""

from __future__ import annotations


def pipeline_errors(dist, model, train, data) -> list[str]:
    """What ``ray-fsdp train`` cannot run under ``pipeline_parallel_size > 1``,
    found on the driver: the model the split refuses (its family, tied
    embeddings, fewer layers than P x V stages, a ``pipeline_split`` that does
    not sum to its layers: the split itself runs on a meta model), LoRA
    adapters, and step (or held-out) rows that do not cut into
    ``pipeline_microbatches`` equal micro-batches."""
    if dist is None or dist.pipeline_parallel_size == 1 or model is None:
        return []
    from ray_fsdp_backend.planning.pipeline_layout import resolve_microbatches

    pp = dist.pipeline_parallel_size
    key = f"distributed.pipeline_parallel_size={pp}"
    if getattr(model, "lora", None) is not None:
        return [f"{key} with model.lora: LoRA adapters are not split into pipeline stages"]
    error = _split_error(model, pp * dist.pipeline_virtual_stages, dist.pipeline_split)
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


def _split_error(model, stages: int, split="auto") -> str | None:
    """Why the split refuses ``model`` cut into ``stages`` stages (layers per
    stage by ``split``, ``distributed.pipeline_split``), or None: by
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

            split_for_stage(build_causal_lm(model.pretrained), 0, stages, split)
            return None
        model_class, tied, n_layers = rules
        if tied:
            return tied_embeddings_error(model_class)
        plan_stages(n_layers, stages, split)
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
