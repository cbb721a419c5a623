"""What ``ray-fsdp plan`` prints: a layout's groups, batch, memory, traffic
and optimizer work per rank, for given node counts, computed by the
backend's own topology, mesh and estimate functions (nothing starts).

:func:`format_plan` is the report for one cluster shape,
:func:`format_elastic_plan` both ends of an elastic run, and
:func:`model_config_from_hf` reads a transformers ``config.json`` into the
shape the estimates take.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from ray_fsdp_backend.elastic import elastic_world_sizes, split_global_batch, worker_range
from ray_fsdp_backend.expert_plan import MoEModel, MoEPlanInputs, format_moe_plan
from ray_fsdp_backend.memory import (
    ModelSize,
    estimate_activations,
    estimate_loss_memory,
    estimate_memory,
    estimate_tp_block_traffic,
    format_bytes,
    format_count,
)
from ray_fsdp_backend.mesh import resolve_layout
from ray_fsdp_backend.topology import (
    CP_AXIS,
    DATA_PARALLEL_AXES,
    EP_AXIS,
    EXPERT_SHARD_AXIS,
    REPLICATE_AXIS,
    SHARD_AXIS,
    TP_AXIS,
    topology_from_node_counts,
)
from ray_fsdp_backend.trainer.model_config import ModelConfig
from ray_fsdp_backend.trainer.pretrained import PretrainedModelConfig
from ray_fsdp_backend.trainer.spec import (
    RunSpec,
    model_group,
    tensor_parallel_errors,
)


def model_config_from_hf(path: str, spec: RunSpec) -> ModelConfig:
    """The decoder shape of a transformers ``config.json`` (Llama family:
    ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``intermediate_size``, ``vocab_size``), with the
    YAML's sequence length; the plan then counts that model's parameters.

    Raises:
        ValueError: a key is missing.
    """
    with open(path) as f:
        hf = json.load(f)
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    missing = [k for k in (*keys, "vocab_size") if k not in hf]
    if missing:
        raise ValueError(f"--hf-config {path}: no {', '.join(missing)} (a Llama-family config)")
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads"),
        ffn_hidden=hf["intermediate_size"],
        seq_len=spec.model.seq_len,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def format_elastic_plan(spec: RunSpec, gpus_per_node: int, moe: MoEModel | None = None) -> str:
    """Both ends of an elastic run (``num_workers: [min, max]``), as whole
    nodes of ``gpus_per_node`` workers (a partial node shown as such), and
    which worker counts in between the global batch cannot split."""
    low, high = worker_range(spec.scaling.num_workers)
    lines = [f"\nelastic: scaling.num_workers=[{low}, {high}]"]
    for label, world in (("smallest", low), ("largest", high)):
        nodes, rest = divmod(world, gpus_per_node)
        node_counts = [gpus_per_node] * nodes + ([rest] if rest else [])
        lines.append(f"\n== {label}: {world} workers on nodes of {node_counts} ==")
        try:
            lines.append(plan_for_nodes(spec, node_counts, moe))
        except ValueError as exc:
            lines.append(f"refused at this size: {exc}")
    if spec.train.global_batch_size is not None:
        group = model_group(spec.distributed)  # a count must hold whole tp x cp groups
        _, refused = elastic_world_sizes(spec.train.global_batch_size, low, high, group)
        if refused:
            lines.append(
                f"\nwarning: train.global_batch_size={spec.train.global_batch_size} cannot be "
                f"split over {refused} workers: a restart at those sizes fails at start"
            )
    return "\n".join(lines)


def format_plan(spec: RunSpec, nodes: int, gpus_per_node: int, moe: MoEModel | None = None) -> str:
    """The ``plan`` report; raises ValueError for a layout the backend refuses."""
    return plan_for_nodes(spec, [gpus_per_node] * nodes, moe)


def plan_for_nodes(spec: RunSpec, node_counts: Sequence[int], moe: MoEModel | None = None) -> str:
    """The ``plan`` report for nodes running ``node_counts`` workers each;
    ``moe`` (an ``--hf-config`` MoE model) splits memory into dense and
    experts and adds the experts' traffic (docs/moe.md)."""
    world = sum(node_counts)
    topology = topology_from_node_counts(node_counts)
    layout = resolve_layout(spec.distributed, topology)
    cfg = spec.distributed
    errors = tensor_parallel_errors(cfg, spec.model)
    if errors:
        raise ValueError("; ".join(errors))
    dp_size = layout.size(DATA_PARALLEL_AXES)
    strategy = cfg.sharding_strategy if cfg.use_fsdp else None
    name = "DDP" if strategy is None else f"FSDP2 {strategy.value}"
    if strategy is not None and strategy.is_hybrid:
        name += " (HSDP)"
    if cfg.use_dmuon:
        name += " + DMuon"
    shape = ", ".join(f"{a}={n}" for a, n in shown_axes(layout))
    lines = [
        f"strategy: {name}",
        f"cluster:  {_describe_nodes(node_counts)} = {world} ranks",
        f"mesh:     ({shape})",
    ]
    low, high = worker_range(spec.scaling.num_workers)
    if not low <= world <= high:
        lines.append(
            f"note:     scaling.num_workers={spec.scaling.num_workers}; train this layout with "
            f"--set scaling.num_workers={world}"
        )
    batch, micro = format_batch(spec, dp_size, world)
    lines.append(f"batch:    {batch}")
    lines += format_groups(layout)
    if cfg.pipeline_parallel_size > 1:
        from ray_fsdp_backend.pipeline.layout import format_pipeline_plan

        lines += format_pipeline_plan(
            cfg.pipeline_parallel_size,
            spec.model.n_layers,
            cfg.pipeline_schedule,
            cfg.pipeline_microbatches,
            layout.groups("pp"),
            cfg.pipeline_virtual_stages,
        )
        from ray_fsdp_backend.pipeline.plan import plan_lines

        lines += plan_lines(spec, node_counts, layout)
    # FSDP2 shards over dp_shard x cp (the cp ranks hold different tokens).
    shard, tp = layout.size((SHARD_AXIS, CP_AXIS)), layout.axis_size(TP_AXIS)
    if moe is None:
        lines += format_memory(spec, strategy, shard, tp)
    else:
        lines += format_moe_memory(spec, moe, strategy, layout, micro)
    lines += format_activations(spec, layout.axis_size(CP_AXIS), layout.axis_size(TP_AXIS), micro)
    lines += format_loss_memory(spec, layout.axis_size(CP_AXIS), layout.axis_size(TP_AXIS), micro)
    lines += format_tp_traffic(spec, layout.axis_size(CP_AXIS), layout.axis_size(TP_AXIS), micro)
    lines += format_expert_groups(layout)
    if cfg.use_dmuon:  # owners span FSDP's dp_shard x cp; TP blocks are gathered over tp
        shard, tp = layout.size((SHARD_AXIS, CP_AXIS)), layout.axis_size(TP_AXIS)
        lines += format_dmuon(spec, shard, tp, moe, layout.expert_parallel_size)
    return "\n".join(lines)


def format_batch(spec: RunSpec, dp_size: int, world: int) -> tuple[str, int]:
    """The batch line and the micro-batch each rank runs: the split of
    ``train.global_batch_size`` over ``dp_size``, or ``micro_batch_size x
    grad_accum x dp``, which tp / cp ranks do not multiply (they share rows)."""
    train = spec.train
    if train.global_batch_size is not None:
        try:
            split = split_global_batch(train.global_batch_size, dp_size, train.micro_batch_size)
        except ValueError as exc:
            return f"refused: {exc}", train.micro_batch_size
        return split.describe(), split.micro_batch_size
    total = train.micro_batch_size * train.grad_accum * dp_size
    text = (
        f"global batch {total} = micro-batch {train.micro_batch_size} x {train.grad_accum} "
        f"accumulation step(s) x {dp_size} dp rank(s)"
    )
    if world > dp_size:
        text += (
            f" ({world // dp_size} tp x cp ranks share each row; "
            "set train.global_batch_size to keep a batch across layouts)"
        )
    return text, train.micro_batch_size


def shown_axes(layout) -> list[tuple[str, int]]:
    """The mesh's axes as ``plan`` prints them: the layout keeps a lone
    data-parallel axis of size one beside model-parallel axes (the mesh needs
    one), which the printout leaves out like every size-one axis: tp 8 on 8
    ranks reads ``(tp=8)``. HSDP's two data-parallel axes are both shown."""
    axes = list(zip(layout.axis_names, layout.shape, strict=True))
    dp = [a for a, _ in axes if a in DATA_PARALLEL_AXES]
    hidden = {a for a, n in axes if n == 1 and len(dp) == 1 and a in dp and len(axes) > 1}
    return [(a, n) for a, n in axes if a not in hidden]


def format_groups(layout) -> list[str]:
    """Each axis's rank groups and what crosses them. Under cp, FSDP2 shards
    parameters over dp_shard x cp, so those are the groups shown as split."""
    cp = layout.axis_size(CP_AXIS) if CP_AXIS in layout.axis_names else 1
    shard_axes = (SHARD_AXIS, CP_AXIS) if cp > 1 else (SHARD_AXIS,)
    lines = []
    for axes, what in (
        ((TP_AXIS,), "each layer's matrices split among these ranks; same batch"),
        ((CP_AXIS,), "each sequence split among these ranks; same batch"),
        (shard_axes, "parameters split among these ranks: all-gather, reduce-scatter"),
        ((REPLICATE_AXIS,), "same parameters on each rank: gradients all-reduced"),
    ):
        if not all(a in dict(shown_axes(layout)) for a in axes):
            continue
        label = " x ".join(axes)
        groups = layout.groups(axes)
        if len(groups[0]) == 1:
            lines.append(f"{label} groups: {len(groups)} of one rank each (nothing to reduce)")
            continue
        lines.append(f"{label} groups ({len(groups)}; {what}):")
        lines += [f"  {format_ranks(g)}" for g in groups]
    return lines


def format_dmuon(
    spec: RunSpec, shard_size: int, tp: int = 1, moe: MoEModel | None = None, ep: int = 1
) -> list[str]:
    """DMuon's owners and Newton–Schulz critical path for the trainer's model
    as the trainer plans them (the example decoder's from its config's
    shapes, no torch; a pretrained one's on a meta model built from its
    ``config.json``), and its expert matrices (orthogonalised where they
    live). With ``moe`` (``--hf-config``) the routers replace the dense
    MLPs of its MoE layers and its experts are the stacks (shared experts
    are not counted)."""
    from ray_fsdp_backend.dmuon.plan import format_ns_schedule
    from ray_fsdp_backend.dmuon.report import format_stack_lines, format_tp_traffic

    if isinstance(spec.model, ModelConfig):
        specs, stacks = _decoder_matrices(spec.model), []
    else:
        from ray_fsdp_backend.dmuon.selection import dedicated_specs, dedicated_stacks
        from ray_fsdp_backend.hf.models import build_causal_lm

        model = build_causal_lm(spec.model.pretrained)
        specs, stacks = dedicated_specs(model), dedicated_stacks(model)
    if moe is not None:
        specs, stacks = _moe_matrices(specs, moe)
    return (
        format_ns_schedule(specs, shard_size)
        + format_tp_traffic([m.shape for m in specs], tp, shard_size)
        + format_stack_lines(stacks, ep, shard_size // ep)
    )


def _decoder_matrices(model: ModelConfig) -> list:
    """The example decoder's dedicated matrices, from its parameter shapes:
    its blocks are ``layers.*``, its embedding ``tok_embeddings``."""
    from ray_fsdp_backend.dmuon.plan import dedicated_from_shapes

    blocks = [f"layers.{i}" for i in range(model.n_layers)]
    return dedicated_from_shapes(model.parameter_shapes(), blocks, ["tok_embeddings.weight"])


def _moe_matrices(specs: list, moe: MoEModel) -> tuple[list, list[tuple[int, int, int]]]:
    """The dense decoder's matrices with the MLPs of the last ``moe_layers``
    layers replaced by their routers, and the experts' stacks (the fused
    ``gate_up_proj`` and ``down_proj`` of each MoE layer)."""
    from ray_fsdp_backend.dmuon.plan import MatrixSpec

    e = moe.experts
    n_layers = 1 + max(int(m.name.split(".")[1]) for m in specs)
    routed = range(n_layers - e.moe_layers, n_layers)
    dense = [m for m in specs if not any(m.name.startswith(f"layers.{i}.feed_forward.")
                                         for i in routed)]  # fmt: skip
    routers = [MatrixSpec(f"layers.{i}.router", (e.num_experts, e.dim)) for i in routed]
    stacks = [(e.num_experts, 2 * e.expert_hidden, e.dim), (e.num_experts, e.dim, e.expert_hidden)]
    return dense + routers, stacks * e.moe_layers


def _describe_nodes(node_counts: Sequence[int]) -> str:
    if len(set(node_counts)) == 1:
        return f"{len(node_counts)} node(s) x {node_counts[0]} GPU(s)"
    return f"{len(node_counts)} nodes of {list(node_counts)} GPU(s)"


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
    if shape is None:
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
    softmax, gradient; :func:`~ray_fsdp_backend.memory.estimate_loss_memory`),
    chunked as configured and with the full logits, for the example decoder
    and pretrained models alike (their head's shape). Under pipeline
    parallelism the last stage takes each pipeline micro-batch's whole
    logits (``train.loss_chunk_tokens`` does not apply there)."""
    model, cfg, chunk = spec.model, spec.distributed, spec.train.loss_chunk_tokens
    pp = cfg.pipeline_parallel_size
    if pp > 1:
        from ray_fsdp_backend.pipeline.layout import resolve_microbatches

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
    return lines


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


def format_expert_groups(layout) -> list[str]:
    """With ``expert_parallel_size > 1``: the ep groups (ranks exchanging
    tokens) and efsdp groups (ranks sharding the same experts); docs/moe.md."""
    ep = layout.expert_parallel_size
    if ep == 1:
        return []
    lines = [
        f"experts:  expert_parallel_size={ep}: each rank holds 1/{ep} of every MoE layer's "
        f"experts, FSDP2-sharded over {layout.expert_shard_size} ranks"
    ]
    for axis, what in (
        (EP_AXIS, "tokens to their experts by all-to-all"),
        (EXPERT_SHARD_AXIS, "same experts: all-gather, reduce-scatter"),
    ):
        groups = layout.expert_groups(axis)
        lines.append(f"{axis} groups ({len(groups)}; {what}):")
        lines += [f"  {format_ranks(g)}" for g in groups]
    return lines


def format_ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``'[0-3]'``; ``[0, 8, 16]`` -> ``'[0, 8, 16]'``."""
    ranks = list(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"[{ranks[0]}-{ranks[-1]}]"
    return "[" + ", ".join(map(str, ranks)) + "]"
