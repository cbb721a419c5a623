"""What ``ray-fsdp plan`` prints: a layout's groups, batch, memory, traffic
and optimizer work per rank, for given node counts, computed by the
backend's own topology, mesh and estimate functions (nothing starts).

:func:`format_plan` is the report for one cluster shape,
:func:`format_elastic_plan` both ends of an elastic run, and
:func:`model_config_from_hf` reads a transformers ``config.json`` into the
shape the estimates take. The memory, activation, loss and traffic lines
come from :mod:`ray_fsdp_backend.cli.plan_estimates`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from ray_fsdp_backend.cli.plan_estimates import (
    format_activations,
    format_loss_memory,
    format_memory,
    format_moe_memory,
    format_objective,
    format_tp_traffic,
)
from ray_fsdp_backend.distributed.mesh import resolve_layout
from ray_fsdp_backend.models.config import ModelConfig
from ray_fsdp_backend.planning.elastic import elastic_world_sizes, split_global_batch, worker_range
from ray_fsdp_backend.planning.experts import MoEModel
from ray_fsdp_backend.planning.topology import (
    CP_AXIS,
    DATA_PARALLEL_AXES,
    EP_AXIS,
    EXPERT_SHARD_AXIS,
    REPLICATE_AXIS,
    SHARD_AXIS,
    TP_AXIS,
    topology_from_node_counts,
)
from ray_fsdp_backend.trainer.schema.spec import (
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
        from ray_fsdp_backend.planning.pipeline_layout import format_pipeline_plan

        lines += format_pipeline_plan(
            cfg.pipeline_parallel_size,
            spec.model.n_layers,
            cfg.pipeline_schedule,
            cfg.pipeline_microbatches,
            layout.groups("pp"),
            cfg.pipeline_virtual_stages,
            cfg.pipeline_split,
        )
        from ray_fsdp_backend.planning.pipeline_plan import plan_lines

        lines += plan_lines(spec, node_counts, layout)
    # FSDP2 shards over dp_shard x cp (the cp ranks hold different tokens).
    shard, tp = layout.size((SHARD_AXIS, CP_AXIS)), layout.axis_size(TP_AXIS)
    if moe is None:
        lines += format_memory(spec, strategy, shard, tp)
    else:
        lines += format_moe_memory(spec, moe, strategy, layout, micro)
    lines += format_objective(spec, shard * tp)
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
        text += f" ({_row_sharing(spec.distributed)}; "
        text += "set train.global_batch_size to keep a batch across layouts)"
    return text, train.micro_batch_size


def _row_sharing(cfg) -> str:
    """Why ranks outnumber dp ranks: the tp / cp ranks that share each row
    (named only when > 1) and the pipeline stages each row runs through."""
    sizes = {"tp": cfg.tensor_parallel_size, "cp": cfg.context_parallel_size}
    shared = " x ".join(f"{axis} {n}" for axis, n in sizes.items() if n > 1)
    parts = [f"{shared} ranks share each row"] if shared else []
    if cfg.pipeline_parallel_size > 1:
        parts.append(f"each row runs through all {cfg.pipeline_parallel_size} pipeline stages")
    return "; ".join(parts)


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
