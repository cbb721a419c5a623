"""The training YAML's rules that span sections (``train.optimizer`` against
``distributed.use_dmuon``, the batch against the worker range, cp, tp, pp
and QLoRA layouts against the model, the data against the model, the
storage path), each checked once the sections it involves built;
:func:`~ray_fsdp_backend.trainer.schema.spec.check_spec` runs them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ray_fsdp_backend.models.config import ModelConfig
from ray_fsdp_backend.planning.elastic import (
    describe_group_sizes,
    elastic_world_sizes,
    worker_range,
)
from ray_fsdp_backend.trainer.schema.options import DataOptions, ScalingOptions, TrainOptions
from ray_fsdp_backend.trainer.schema.preference import preference_errors
from ray_fsdp_backend.trainer.schema.preflight import storage_errors
from ray_fsdp_backend.trainer.schema.pretrained import PretrainedModelConfig
from ray_fsdp_backend.trainer.schema.rl import PROMPTS_FORMAT, rl_errors


def cross_section_errors(built: Mapping[str, Any]) -> list[str]:
    """Rules spanning sections, each checked when its sections built."""
    errors = []
    train, dist, model, data = (built.get(k) for k in ("train", "distributed", "model", "data"))
    if train is not None and dist is not None and (train.optimizer == "muon") != dist.use_dmuon:
        errors.append(
            f"train.optimizer={train.optimizer!r} and distributed.use_dmuon="
            f"{dist.use_dmuon} disagree: Muon runs as DMuon on FSDP shards, "
            "so use optimizer muon with use_dmuon true, or adamw with use_dmuon false"
        )
    group = model_group(dist)
    errors += _group_errors(dist, built.get("scaling")) or _batch_errors(
        train, built.get("scaling"), group
    )
    errors += _context_parallel_errors(dist, model, data, built.get("scaling"))
    # the checkpoint exists, LoRA targets match: before the rules that read it (the split)
    checkpoint = model.check() if isinstance(model, PretrainedModelConfig) else []
    if dist is not None and dist.pipeline_parallel_size > 1 and not checkpoint:
        from ray_fsdp_backend.trainer.schema.pipeline import pipeline_errors  # imports torch

        errors += pipeline_errors(dist, model, train, data)
    errors += tensor_parallel_errors(dist, model)
    errors += qlora_errors(dist, model)
    if isinstance(model, ModelConfig) and model.vocab_size != 256:
        errors.append(f"model.vocab_size={model.vocab_size} must be 256 (byte tokens)")
    if isinstance(model, PretrainedModelConfig):  # its shapes fit the layout: before Ray starts
        errors += checkpoint or _pretrained_layout_errors(model, dist, built.get("scaling"))
    if built.get("run") is not None:
        errors += storage_errors(built["run"].storage_path)
    if data is not None:
        errors += data_errors(data, model, train)
    errors += preference_errors(train, data, model, dist)
    errors += rl_errors(built)
    return errors


def data_errors(data: DataOptions, model, train: TrainOptions | None) -> list[str]:
    """The ``data:`` section against the model and ``train.eval_every``
    (keys only; the records themselves are read by ``sft_input_errors``)."""
    errors = []
    pretrained = isinstance(model, PretrainedModelConfig)
    if data.format == PROMPTS_FORMAT:
        if data.path is None:
            errors.append("data.format='prompts' needs data.path (JSONL or parquet)")
        elif "://" not in data.path and not os.path.exists(data.path):
            errors.append(f"data.path={data.path!r} is not a file or directory")
        return errors
    if data.is_sft:
        if model is not None and not pretrained:
            errors.append(
                f"data.format={data.format!r} needs model.pretrained: records are rendered "
                "with its tokenizer's chat template (the byte-level model has none)"
            )
        if data.path is None:
            errors.append(f"data.format={data.format!r} needs data.path (JSONL or parquet)")
        for key in ("path", "eval_path"):
            path = getattr(data, key)
            if path is not None and "://" not in path and not os.path.exists(path):
                errors.append(f"data.{key}={path!r} is not a file or directory")
        if data.format == "preference" and data.train_on_prompt:
            errors.append(
                "data.train_on_prompt=true with data.format='preference': a pair's loss is "
                "on its responses (the prompt is shared by both)"
            )
        if data.eval_path is not None and data.eval_fraction is not None:
            errors.append(
                f"data.eval_path={data.eval_path!r} and data.eval_fraction={data.eval_fraction}: "
                "choose one held-out set"
            )
    elif data.has_eval:
        key = "eval_path" if data.eval_path is not None else "eval_fraction"
        errors.append(
            f"data.{key} with data.format='text': evaluation runs on chat / "
            "prompt_completion records"
        )
    if train is not None and train.eval_every and not data.has_eval:
        errors.append(
            f"train.eval_every={train.eval_every} needs a held-out set: data.eval_path or "
            "data.eval_fraction"
        )
    return errors + ([] if data.is_sft else _text_errors(data, pretrained))


def _text_errors(data: DataOptions, pretrained: bool) -> list[str]:
    """``format: text``: its source and path."""
    errors = []
    if pretrained and data.source != "corpus":
        errors.append(
            "model.pretrained with data.format='text' trains on data.source='corpus' (its "
            "tokenizer's ids); for JSONL / parquet records use data.format chat or "
            "prompt_completion"
        )
    if data.source == "ray_data" and data.path is None:
        errors.append("data.source='ray_data' needs data.path (files or a directory of text)")
    if data.source == "corpus" and data.path is not None:
        if "://" not in data.path and not os.path.isfile(data.path):
            errors.append(f"data.path={data.path!r} is not a file")
    return errors


def _pretrained_layout_errors(model, dist, scaling) -> list[str]:
    """The checkpoint's shapes against the layout at the smallest and largest
    worker count, on one node (``plan`` checks its own nodes)."""
    if dist is None or scaling is None:
        return []
    from ray_fsdp_backend.hf.layout_check import pretrained_layout_errors

    low, high = worker_range(scaling.num_workers)
    return pretrained_layout_errors(model, dist, [[n] for n in sorted({low, high})])


def _context_parallel_errors(dist, model, data, scaling) -> list[str]:
    """Layouts the cp ranks cannot run, caught before any worker starts."""
    if dist is None or model is None:
        return []
    cp, ring = dist.context_parallel_size, dist.context_parallel_backend == "ring"
    errors = []
    if data is not None and data.packing:
        if ring and cp > 1:
            errors.append(
                "data.packing with distributed.context_parallel_backend=ring: torch's ring "
                "attention takes no mask, so packed rows would attend across documents; "
                "use ulysses"
            )
        if not data.is_sft and (not isinstance(model, ModelConfig) or data.source != "corpus"):
            errors.append(
                "data.packing with data.format='text' needs the byte-level model and "
                "data.source='corpus'; a pretrained model packs chat / prompt_completion records"
            )
    if cp == 1:
        return errors
    parts = 2 * cp if ring else cp
    if model.seq_len % parts:
        rule = "2 x context_parallel_size" if ring else "context_parallel_size"
        errors.append(f"model.seq_len={model.seq_len} is not divisible by {rule} = {parts}")
    if isinstance(model, ModelConfig):
        device = "cuda" if scaling is None or scaling.use_gpu is not False else "cpu"
        try:
            dist.resolve_cp_backend(model.n_heads, device)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def qlora_errors(dist, model) -> list[str]:
    """Layouts an NF4 base (``model.lora.base_quantization``) cannot run:
    NF4 shards live in FSDP2's all-gather, so no DDP, DMuon or tensor parallel."""
    lora = getattr(model, "lora", None)
    if dist is None or lora is None or lora.base_quantization is None:
        return []
    key = f"model.lora.base_quantization={lora.base_quantization!r}"
    rules = [
        (not dist.use_fsdp, "distributed.use_fsdp=false (DDP would hold the whole base)"),
        (dist.use_dmuon, "distributed.use_dmuon=true (DMuon's team all-gathers are not NF4's)"),
        (
            dist.tensor_parallel_size > 1,
            f"distributed.tensor_parallel_size={dist.tensor_parallel_size} (NF4 shards by rows "
            "over FSDP only)",
        ),
    ]
    return [f"{key} with {what}: QLoRA runs on FSDP2 / HSDP" for bad, what in rules if bad]


def tensor_parallel_errors(dist, model) -> list[str]:
    """Model shapes the tp size does not divide (the byte-level decoder's are
    known here; a pretrained model's are checked by ``ctx.wrap``), and LoRA
    adapters, which the tensor-parallel plan does not split."""
    if dist is None or dist.tensor_parallel_size == 1:
        return []
    tp, errors = dist.tensor_parallel_size, []
    if isinstance(model, ModelConfig):
        sizes = dict(
            n_heads=model.n_heads,
            n_kv_heads=model.kv_heads,
            ffn_hidden=model.hidden,
            vocab_size=model.vocab_size,
        )
        bad = [f"model.{k}={v}" for k, v in sizes.items() if v % tp]
        if bad:
            errors.append(
                f"distributed.tensor_parallel_size={tp} does not divide {', '.join(bad)}: "
                "every split dimension and head count must be a multiple of the tp size"
            )
    if isinstance(model, PretrainedModelConfig) and model.lora is not None:
        errors.append(
            f"model.lora with distributed.tensor_parallel_size={tp}: the tensor-parallel plan "
            "does not split LoRA adapters; train LoRA with tensor_parallel_size 1 (FSDP2 "
            "shards the frozen base and the adapters over every rank)"
        )
    return errors


def _batch_errors(
    train: TrainOptions | None, scaling: ScalingOptions | None, group: int = 1
) -> list[str]:
    """A global batch that no allowed worker count can split (over its
    data-parallel size: ``group`` ranks per tp x cp group), or that conflicts
    with ``grad_accum`` (derived when the global batch is set)."""
    if train is None or train.global_batch_size is None:
        return []
    errors = []
    if train.grad_accum != 1:
        errors.append(
            f"train.grad_accum={train.grad_accum} with train.global_batch_size="
            f"{train.global_batch_size}: grad_accum is derived from the global batch; remove it"
        )
    if scaling is not None:
        low, high = worker_range(scaling.num_workers)
        fits, _ = elastic_world_sizes(train.global_batch_size, low, high, group)
        if not fits:
            per_group = f" divided by its tp x cp group of {group}" if group > 1 else ""
            errors.append(
                f"train.global_batch_size={train.global_batch_size} is not a multiple of any "
                f"worker count in scaling.num_workers={scaling.num_workers}{per_group}"
            )
    return errors


def _group_errors(dist, scaling: ScalingOptions | None) -> list[str]:
    """A worker range with no count that holds whole tp x cp groups."""
    if dist is None or scaling is None:
        return []
    tp, cp = dist.tensor_parallel_size, dist.context_parallel_size
    sizes = [f"tensor_parallel_size={tp}"] * (tp > 1) + [f"context_parallel_size={cp}"] * (cp > 1)
    label = "distributed." + " x ".join(sizes) if sizes else None
    message = describe_group_sizes(*worker_range(scaling.num_workers), model_group(dist), label)
    return [message] if message else []


def model_group(dist) -> int:
    """Ranks of one model-parallel (tp x cp x pp) group; 1 without the section."""
    if dist is None:
        return 1
    return dist.tensor_parallel_size * dist.context_parallel_size * dist.pipeline_parallel_size
