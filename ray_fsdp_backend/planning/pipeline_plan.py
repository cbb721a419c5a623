"""PURE: ``ray-fsdp plan``'s pipeline lines beyond the stages (issue 47): each
stage's parameters and model state per rank, the activations it keeps in
flight under the schedule, and the bytes a step moves across nodes with PP
against FSDP and HSDP on the same cluster without PP (:mod:`.traffic`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ray_fsdp_backend.planning.memory import format_bytes, format_count
from ray_fsdp_backend.planning.pipeline_layout import StagePlan, plan_stages
from ray_fsdp_backend.planning.pipeline_schedules import stage_indices
from ray_fsdp_backend.planning.pipeline_traffic import CrossNode, cross_node_bytes, stage_volumes

ADAMW_STATE_BYTES = 16
"""fp32 parameter, gradient and AdamW's two moments: bytes per parameter."""


@dataclass(frozen=True)
class PipelineCluster:
    """What the traffic comparison needs of a config and its cluster."""

    nodes: int
    ranks_per_node: int
    stages: int
    tp: int
    microbatches: int
    schedule: str
    rows: int  # the step's rows (global batch)
    seq_len: int
    dim: int
    mixed_precision: bool = True
    reduce_fp32: bool = False
    reshard_after_forward: bool = True  # the no-PP FSDP's
    micro_batch_size: int = 1  # the no-PP run's rows per forward
    virtual: int = 1  # pipeline_virtual_stages

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def value_bytes(self) -> int:
        return 2 if self.mixed_precision else 4

    @property
    def reduce_bytes(self) -> int:
        return 4 if self.reduce_fp32 or not self.mixed_precision else 2


def stage_params(plan: StagePlan, block: int, embedding: int, head: int) -> int:
    """Parameters stage ``plan`` holds: its blocks, the embedding on the
    first stage, final norm and head (``head``) on the last."""
    return len(plan.layers) * block + embedding * plan.first + head * plan.last


def in_flight(schedule: str, stage: int, stages: int, microbatches: int, virtual: int = 1) -> float:
    """Micro-batches whose activations pipeline rank ``stage`` keeps at once,
    in units of all its layers (a virtual stage's micro-batch counts 1/V),
    from torch 2.13's schedules: GPipe runs every forward first (M), 1F1B at
    most ``P - r``; the interleaved ones warm up ``(V - 1) * M / rounds +
    2 (P - 1 - r)`` stage forwards (``_get_warmup_ops``) and hold one more;
    ZBV ``2 (P - r) - 1`` forwards of its first stage and ``r`` of its
    second, then one more (``2P - r`` halves: at most 1F1B's rank 0)."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, stages - stage)
    if schedule == "zbv_zero_bubble":
        chunks = min(2 * stages - stage, 2 * microbatches)
    else:
        per_round = microbatches // max(1, microbatches // stages)
        warmup = (virtual - 1) * per_round + 2 * (stages - 1 - stage)
        chunks = min(warmup + 1, virtual * microbatches)
    return chunks / virtual


def crossing_boundaries(c: PipelineCluster, stage: int) -> int:
    """How many of pipeline rank ``stage``'s stage neighbours sit on another
    node (0, 1 or 2; with virtual stages up to 2V: each of the rank's stages
    has its own): pipeline ranks are consecutive node-major rank blocks of
    ``world / stages``, stages placed as torch's schedule places them."""
    per_stage = c.world // c.stages
    count = c.stages * c.virtual
    owner = {
        s: r for r in range(c.stages) for s in stage_indices(r, c.stages, c.virtual, c.schedule)
    }

    def node(rank: int) -> int:
        return rank * per_stage // c.ranks_per_node

    held = stage_indices(stage, c.stages, c.virtual, c.schedule)
    return sum(
        node(owner[n]) != node(stage) for s in held for n in (s - 1, s + 1) if 0 <= n < count
    )


def pipeline_cross_node(c: PipelineCluster, rank: int, params: int) -> CrossNode:
    """One rank of pipeline rank ``rank``'s bytes across nodes per step, its
    stages holding ``params`` (split over tp)."""
    per_stage = c.world // c.stages
    shard = per_stage // c.tp
    volumes = stage_volumes(
        [params // c.tp],
        stage=rank,
        stages=c.stages,
        activation_values=c.rows // shard * c.seq_len * c.dim,
        param_bytes=c.value_bytes,
        reduce_bytes=c.reduce_bytes,
        activation_bytes=c.value_bytes,
    )
    one_way = c.rows // shard * c.seq_len * c.dim * c.value_bytes
    cross = cross_node_bytes(volumes, shard=shard, shard_spans_nodes=per_stage > c.ranks_per_node)
    return CrossNode(sends=one_way * crossing_boundaries(c, rank), fsdp=cross.fsdp, replicate=0)


def flat_cross_node(c: PipelineCluster, params: int, hybrid: bool) -> CrossNode:
    """The same model and batch without PP: FSDP over every rank (``hybrid``:
    HSDP, sharded inside a node, replicated across nodes), each unit gathered
    once per micro-batch of ``micro_batch_size`` rows (twice under
    ``reshard_after_forward``)."""
    shard = (c.ranks_per_node if hybrid else c.world) // c.tp
    dp = c.world // c.tp
    accumulation = max(1, math.ceil(c.rows / dp / c.micro_batch_size))
    gathers = accumulation * (2 if c.reshard_after_forward else 1)
    volumes = stage_volumes(
        [params // c.tp],
        stage=0,
        stages=1,
        activation_values=c.rows // dp * c.seq_len * c.dim,
        gathers=gathers,
        param_bytes=c.value_bytes,
        reduce_bytes=c.reduce_bytes,
    )
    return cross_node_bytes(
        volumes,
        shard=shard,
        shard_spans_nodes=not hybrid and c.nodes > 1,
        replicas=c.nodes if hybrid else 1,
    )


def format_pipeline_traffic(
    c: PipelineCluster, n_layers: int, block: int, embedding: int, head: int
) -> list[str]:
    """The per-stage lines and the cross-node comparison."""
    lines = ["pipeline stages, per rank (model state fp32 + AdamW, over the stage's ranks):"]
    worst = CrossNode(0, 0, 0)
    shard = c.world // c.stages
    plans = plan_stages(n_layers, c.stages * c.virtual)
    for rank in range(c.stages):
        held = stage_indices(rank, c.stages, c.virtual, c.schedule)
        params = sum(stage_params(plans[s], block, embedding, head) for s in held)
        flight = in_flight(c.schedule, rank, c.stages, c.microbatches, c.virtual)
        named = f"stage {rank}" if c.virtual == 1 else f"rank {rank} (stages {list(held)})"
        lines.append(
            f"  {named}: {format_count(params, 1)} parameters, "
            f"{format_bytes(params * ADAMW_STATE_BYTES // shard)} model state, "
            f"activations of {flight:g} micro-batch(es) in flight"
        )
        cross = pipeline_cross_node(c, rank, params)
        worst = max(worst, cross, key=lambda x: x.total)
    total = n_layers * block + embedding + head
    fsdp, hsdp = flat_cross_node(c, total, False), flat_cross_node(c, total, True)
    lines += [
        f"across nodes per rank per step ({c.nodes} nodes of {c.ranks_per_node}):",
        f"  pipeline {c.stages} stages{'' if c.virtual == 1 else f' x {c.virtual} virtual'}: "
        f"{format_bytes(worst.total)} "
        f"(activation sends {format_bytes(worst.sends)}, "
        f"FSDP inside a stage {format_bytes(worst.fsdp)})",
        f"  FSDP over all {c.world} ranks, no PP: {format_bytes(fsdp.total)}",
        f"  HSDP (shard in a node), no PP: {format_bytes(hsdp.total)} "
        f"(model state {format_bytes(total * ADAMW_STATE_BYTES // c.ranks_per_node)} per rank)",
    ]
    return lines


def plan_lines(spec, node_counts, layout) -> list[str]:
    """:func:`format_pipeline_traffic` for a run spec on nodes of
    ``node_counts`` ranks (equal nodes; others print nothing) and its mesh."""
    model, cfg, train = spec.model, spec.distributed, spec.train
    if len(set(node_counts)) != 1 or not hasattr(model, "block_params"):
        return []
    dp = layout.size([a for a in layout.axis_names if a.startswith("dp")])
    rows = train.global_batch_size or train.micro_batch_size * train.grad_accum * dp
    embedding = model.vocab_size * model.dim
    cluster = PipelineCluster(
        nodes=len(node_counts),
        ranks_per_node=node_counts[0],
        stages=cfg.pipeline_parallel_size,
        tp=layout.axis_size("tp") if "tp" in layout.axis_names else 1,
        microbatches=cfg.pipeline_microbatches or cfg.pipeline_parallel_size,
        schedule=cfg.pipeline_schedule,
        rows=rows,
        seq_len=model.seq_len,
        dim=model.dim,
        mixed_precision=cfg.use_mixed_precision,
        reduce_fp32=cfg.fsdp_reduce_dtype == "fp32",
        reshard_after_forward=cfg.sharding_strategy.reshard_after_forward,
        micro_batch_size=train.micro_batch_size,
        virtual=cfg.pipeline_virtual_stages,
    )
    head = model.embedding_params() - embedding
    return format_pipeline_traffic(cluster, model.n_layers, model.block_params(), embedding, head)
