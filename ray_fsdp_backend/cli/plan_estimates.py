"""The estimate lines of ``ray-fsdp plan``: per-GPU memory of the model
state (dense, or an ``--hf-config`` MoE model's dense and experts),
activations and the loss for one micro-batch, and tensor-parallel traffic,
each from the backend's own estimate functions (:mod:`ray_fsdp_backend.planning.memory`,
:mod:`ray_fsdp_backend.planning.experts`). :mod:`ray_fsdp_backend.cli.plan_report`
puts them in the report.
"""

from __future__ import annotations

import math

from ray_fsdp_backend.models.config import ModelConfig
from ray_fsdp_backend.planning.experts import MoEModel, MoEPlanInputs, format_moe_plan
from ray_fsdp_backend.planning.memory import (
    ModelSize,
    estimate_activations,
    estimate_loss_memory,
    estimate_memory,
    estimate_tp_block_traffic,
    format_bytes,
    format_count,
)
from ray_fsdp_backend.planning.topology import CP_AXIS, DATA_PARALLEL_AXES, SHARD_AXIS, TP_AXIS
from ray_fsdp_backend.settings.checks import parse_size
from ray_fsdp_backend.trainer.schema.preference import Reference
from ray_fsdp_backend.trainer.schema.pretrained import BASE_DTYPES, PretrainedModelConfig
from ray_fsdp_backend.trainer.schema.spec import RunSpec


def format_memory(spec: RunSpec, strategy, shard_size: int, tp: int = 1) -> list[str]:
    model, cfg = spec.model, spec.distributed
    frozen = model.frozen_params() if isinstance(model, PretrainedModelConfig) else 0
    size = ModelSize(
        num_params=model.num_params(),
        largest_unit_params=max(model.block_params(), model.embedding_params()),
        matrix_params=model.matrix_params(),
        frozen_params=frozen,
    )
    est = estimate_memory(
        size,
        strategy,
        shard_size,
        optimizer=spec.train.optimizer,
        mixed_precision=cfg.use_mixed_precision,
        reduce_fp32=cfg.fsdp_reduce_dtype == "fp32",
        cpu_offload=cfg.fsdp_cpu_offload,
        accumulate_unsharded=cfg.fsdp_accumulate_unsharded,
        tensor_parallel=tp,
        frozen_bytes=model.frozen_dtype_bytes if frozen else 4,
    )
    split = f", split over tp={tp} x dp_shard={shard_size}" if tp > 1 else ""
    lines = [
        f"model:    {format_count(size.num_params, 1)} parameters ({model.n_layers} blocks of "
        f"{format_count(model.block_params(), 2)}), optimizer {spec.train.optimizer}",
        *_frozen_lines(model, size, shard_size * tp),
    ]
    if cfg.pipeline_parallel_size > 1:  # a rank holds its stage: the stage lines above
        return [*lines, "per-GPU memory: the pipeline stages above (a rank holds its stage's)"]
    lines += [
        f"per-GPU memory, model state only (activations below){split}:",
        f"  parameters  {format_bytes(est.params):>10}",
        f"  gradients   {format_bytes(est.grads):>10}",
        f"  optimizer   {format_bytes(est.optimizer):>10}",
        f"  transient   {format_bytes(est.transient):>10}  (unsharded blocks / buffers"
        + (", unsharded no_sync gradients)" if cfg.fsdp_accumulate_unsharded else ")"),
        f"  total       {format_bytes(est.total):>10}",
    ]
    if est.host:
        lines.append(f"  host (CPU offload) {format_bytes(est.host)} per rank")
    return lines


def format_moe_memory(spec: RunSpec, moe: MoEModel, strategy, layout, micro: int) -> list[str]:
    """The MoE model's memory (dense / experts) and expert traffic for the
    rows each dp rank runs per step (cp ranks split their tokens)."""
    cfg, train = spec.distributed, spec.train
    if strategy is None or layout.axis_size(TP_AXIS) > 1:
        raise ValueError(
            "--hf-config with a mixture-of-experts config.json plans FSDP2 layouts only "
            "(use_fsdp: true, tensor_parallel_size: 1)"
        )
    dp = layout.size(DATA_PARALLEL_AXES)
    if train.global_batch_size is not None:
        rows = train.global_batch_size // dp
    else:
        rows = train.micro_batch_size * train.grad_accum
    run = MoEPlanInputs(
        strategy=strategy,
        shard_size=layout.size((SHARD_AXIS, CP_AXIS)),
        ep=layout.expert_parallel_size,
        tokens=rows * spec.model.seq_len // layout.axis_size(CP_AXIS),
        micro_batches=max(1, rows // micro),
        memory_kwargs=dict(
            mixed_precision=cfg.use_mixed_precision,
            reduce_fp32=cfg.fsdp_reduce_dtype == "fp32",
            cpu_offload=cfg.fsdp_cpu_offload,
            accumulate_unsharded=cfg.fsdp_accumulate_unsharded,
        ),
    )
    return format_moe_plan(moe, run, spec.train.optimizer)


def format_activations(spec: RunSpec, cp: int, tp: int, micro_batch: int) -> list[str]:
    """Activation memory per rank for one micro-batch of ``micro_batch``
    rows (the one the batch line prints): the byte-level decoder's, or a
    pretrained model's from its ``config.json`` (width, heads, vocabulary)."""
    model, cfg = spec.model, spec.distributed
    shape = model.activation_shape(micro_batch)
    if shape is None or cfg.pipeline_parallel_size > 1:  # PP: each stage's own, above
        return []
    value_bytes = 2 if cfg.use_mixed_precision else 4
    kwargs = dict(
        cp=cp,
        tp=tp,
        value_bytes=value_bytes,
        sequence_parallel=cfg.sequence_parallel_enabled,
        loss_parallel=cfg.loss_parallel,
    )
    kwargs["checkpointing"] = cfg.use_gradient_checkpointing
    kwargs["logits"] = spec.train.loss_chunk_tokens == 0  # else the loss line counts them
    with_scores = estimate_activations(shape, **kwargs)
    flash = estimate_activations(shape, attention_scores=False, **kwargs)
    split = f", sequence split over cp={cp}" if cp > 1 else ""
    return [
        f"activations per rank, one micro-batch of {micro_batch} x "
        f"{model.seq_len} tokens{split} (estimate):",
        f"  {format_bytes(with_scores):>10}  kernels that keep attention scores (CPU)",
        f"  {format_bytes(flash):>10}  flash / memory-efficient attention (GPU)",
    ]


def format_loss_memory(spec: RunSpec, cp: int, tp: int, micro_batch: int) -> list[str]:
    """The cross-entropy's peak per rank for one micro-batch (logits chunk,
    softmax, gradient; :func:`~ray_fsdp_backend.planning.memory.estimate_loss_memory`),
    chunked as configured and with the full logits, for the example decoder
    and pretrained models alike (their head's shape). Under pipeline
    parallelism the last stage takes each pipeline micro-batch's whole
    logits (``train.loss_chunk_tokens`` does not apply there)."""
    model, cfg, chunk = spec.model, spec.distributed, spec.train.loss_chunk_tokens
    if spec.train.objective == "reward":  # a scalar head: one value a token, no logits
        return ["loss per rank: a scalar score a token (train.objective: reward), no logits"]
    pp = cfg.pipeline_parallel_size
    if pp > 1:
        from ray_fsdp_backend.planning.pipeline_layout import resolve_microbatches

        chunk = 0
        step_rows = micro_batch * spec.train.grad_accum
        micro_batch = step_rows // resolve_microbatches(cfg.pipeline_microbatches, pp)
    tokens = micro_batch * model.seq_len // cp
    value_bytes = 2 if cfg.use_mixed_precision else 4
    kwargs = dict(tp=tp, value_bytes=value_bytes, loss_parallel=cfg.loss_parallel)
    vocab, dim = model.vocab_size, model.dim
    full = estimate_loss_memory(tokens, vocab, dim, chunk=0, **kwargs)
    lines = [f"loss per rank, {tokens:,} tokens x {vocab:,} words (estimate):"]
    if chunk > 0:
        fused = estimate_loss_memory(tokens, vocab, dim, chunk=chunk, **kwargs)
        lines.append(f"  {format_bytes(fused):>10}  chunked, {chunk:,} tokens a chunk (in use)")
    in_use = "" if chunk > 0 else ", in use"
    if pp > 1:
        in_use = ", in use: the last pipeline stage's"
    lines.append(f"  {format_bytes(full):>10}  full logits (train.loss_chunk_tokens: 0{in_use})")
    if chunk > 0:
        lines.append(_smaller_loss(tokens, vocab, dim, chunk, fused < full, kwargs))
    return lines


def _smaller_loss(tokens: int, vocab: int, dim: int, chunk: int, chunked: bool, kwargs) -> str:
    """Which of the two losses is smaller at ``tokens`` and why: the chunked
    one holds one chunk's logits and an fp32 sum of the head's gradient
    (``vocab x dim x 4``), which outweighs the logits it saves below about
    ``chunk + 4 dim / (value_bytes + 8)`` tokens."""
    if chunked:
        return (
            f"  chunked is smaller: one {chunk:,}-token chunk of logits instead of all "
            f"{tokens:,} tokens' (its fp32 head-gradient sum costs less than the rest)"
        )

    def pays(t: int) -> bool:
        chunked = estimate_loss_memory(t, vocab, dim, chunk=chunk, **kwargs)
        return chunked < estimate_loss_memory(t, vocab, dim, chunk=0, **kwargs)

    low, high = tokens, max(2 * tokens, 2 * chunk)
    while not pays(high):  # ends: past one chunk, the logits grow faster than 4 B a token
        low, high = high, 2 * high
    while high - low > 1:  # the smallest token count at which chunking is smaller
        mid = (low + high) // 2
        low, high = (low, mid) if pays(mid) else (mid, high)
    grad = format_bytes(vocab * dim * 4 // kwargs["tp"])
    return (
        f"  full logits are smaller at {tokens:,} tokens: the chunked loss adds an fp32 sum of "
        f"the head's gradient ({grad}) and saves logits only beyond one chunk; it is smaller "
        f"from about {high:,} tokens a micro-batch"
    )


def format_tp_traffic(spec: RunSpec, cp: int, tp: int, micro_batch: int) -> list[str]:
    """What each block sends over its tp group for one micro-batch (forward
    and backward, as ``estimate_tp_block_traffic`` counts it) for the
    byte-level decoder; nothing without tensor parallelism."""
    model, cfg = spec.model, spec.distributed
    if tp == 1 or not isinstance(model, ModelConfig):
        return []
    traffic = estimate_tp_block_traffic(
        model.activation_shape(micro_batch),
        tp=tp,
        cp=cp,
        value_bytes=2 if cfg.use_mixed_precision else 4,
        sequence_parallel=cfg.sequence_parallel_enabled,
        checkpointing=cfg.use_gradient_checkpointing,
    )
    kinds = " + ".join(f"{n} {kind.replace('_', '-')}s" for kind, n in traffic.collectives.items())
    recompute = "recompute, " if cfg.use_gradient_checkpointing else ""
    return [
        f"tensor-parallel traffic per rank, one micro-batch of {micro_batch} x "
        f"{model.seq_len} tokens (estimate):",
        f"  {format_bytes(traffic.sent):>10}  per block ({kinds}: forward, {recompute}backward)",
        f"  {format_bytes(traffic.sent * model.n_layers):>10}  all {model.n_layers} blocks",
    ]


def format_objective(spec: RunSpec, shard_size: int) -> list[str]:
    """``train.objective`` other than ``sft``: what it trains and the memory
    its reference model adds per GPU (docs/preference.md)."""
    opts = spec.train
    if opts.objective == "sft":
        return []
    if opts.objective == "grpo":
        return format_rollout(spec)
    if opts.objective != "dpo":
        return [f"objective: {opts.objective} on preference pairs (docs/preference.md)"]
    dpo, model = opts.dpo, spec.model
    head = f"objective: dpo ({dpo.loss_type}, beta {dpo.beta:g}), reference: "
    reference = dpo.resolve_reference(getattr(model, "lora", None) is not None)
    if reference is None:
        return [head + "none (reference-free): no extra memory"]
    if reference is Reference.ADAPTERS:
        return [head + "adapters (the policy with its adapters off): no extra memory"]
    if reference is Reference.PRECOMPUTE:
        return [
            head + "precompute (one forward pass over the pairs before step 1): 8 bytes a "
            "pair on every rank (1M pairs: 7.6 MiB), kept in the checkpoint"
        ]
    base = model.frozen_params() if model.lora else model.num_params()
    copy = math.ceil(base * BASE_DTYPES[model.base_dtype][1] / shard_size)
    return [
        head + f"frozen (a second sharded copy of the base, {format_count(base, 1)} "
        f"{model.base_dtype}): +{format_bytes(copy)} per GPU, one more forward a micro-batch"
    ]


def format_rollout(spec: RunSpec) -> list[str]:
    """``train.objective: grpo``: the samples a step, the rollout fleet, and
    what each weight sync sends to every engine (the whole model, LoRA
    merged, in the checkpoint's dtype; or ``rollout.sync: adapters``, the
    fp32 adapters alone; docs/rl.md)."""
    grpo, rollout, model = spec.train.grpo, spec.rollout, spec.model
    samples = grpo.prompts_per_step * grpo.group_size
    if rollout.sync == "adapters":
        sync, what = (model.num_params() - model.frozen_params()) * 4, "fp32, adapters alone"
    else:
        base = model.frozen_params() if model.lora else model.num_params()  # adapters merge in
        sync = base * BASE_DTYPES[model.base_dtype][1]
        what = f"{model.base_dtype}, adapters merged" if model.lora else model.base_dtype
    bucket = parse_size(rollout.bucket_bytes, "rollout.bucket_bytes")
    clip = f"{grpo.clip_low:g}" + (f"/{grpo.clip_high:g}" if grpo.clip_high else "")
    route = {
        "object_store": "through Ray's object store",
        "collective": "broadcast over a weight group (NCCL on GPUs, else gloo)",
    }[rollout.transport]
    return [
        f"objective: grpo, {samples} samples a step ({grpo.prompts_per_step} prompts x "
        f"group {grpo.group_size}), {grpo.normalisation} mean, clip {clip}, "
        f"kl_coef {grpo.kl_coef:g}, {grpo.updates} update(s) a rollout",
        f"rollout:  {rollout.replicas} {rollout.engine} engine(s) (Ray actors), each "
        f"{rollout.num_cpus:g} CPU {rollout.num_gpus:g} GPU, responses up to "
        f"{rollout.max_tokens} tokens"
        + (
            ", colocated (on the trainer's nodes, asleep between rollouts)"
            if rollout.colocate
            else ""
        ),
        f"sync:     {format_bytes(sync)} a step ({what}) in "
        f"{math.ceil(sync / bucket)} bucket(s) of at most {format_bytes(bucket)}, to each of "
        f"{rollout.replicas} engine(s) {route}",
    ]


def _frozen_lines(model, size: ModelSize, shard_size: int) -> list[str]:
    """With LoRA: the frozen base and the adapters, each per GPU."""
    if not size.frozen_params:
        return []
    base = model.frozen_dtype_bytes * size.frozen_params
    return [
        f"lora:     frozen base {format_count(size.frozen_params, 1)} ({model.base_label}, "
        f"{format_bytes(math.ceil(base / shard_size))} per GPU), adapters "
        f"{format_count(size.trainable_params, 3)} trainable (gradients and optimizer state "
        "for these only)",
    ]
