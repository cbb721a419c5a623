"""PURE: ``ray-fsdp plan``'s pipeline lines beyond the stages: what one rank
of each stage holds (:func:`stage_memory`), and the bytes a step moves across
nodes with PP against FSDP and HSDP on the same cluster without PP
(:mod:`.pipeline_traffic`).

Under PP a rank holds more than its shard. The backend turns
``reshard_after_forward`` off, and torch 2.13's ``PipelineStage`` runs every
micro-batch's backward without gradient sync and without resharding
(``backward_maybe_with_nosync``), reducing and resharding once after the last
(``perform_reduce_grad``). So from the first forward to the last backward a
rank holds its stage's parameters unsharded in the compute dtype and their
gradients unsharded, accumulated in ``fsdp_reduce_dtype`` (FSDP2's
``to_accumulated_grad_if_needed``), on top of its sharded fp32 parameters,
gradients and AdamW moments, and the activations of its own layers for the
micro-batches the schedule keeps in flight. ``tests/dist/test_pipeline_memory.py``
measures the unsharded parameters and gradients a gloo pp rank holds against
:func:`stage_memory`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ray_fsdp_backend.planning.memory import (
    ActivationShape,
    estimate_activations,
    format_bytes,
    format_count,
)
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
    split: Sequence[int] | str = "auto"  # pipeline_split
    shard: int = 0  # ranks sharding a stage's state (dp_shard); 0: world / stages / tp
    activation: ActivationShape | None = None  # one pipeline micro-batch, a layer per n_layers
    checkpointing: bool = False

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def value_bytes(self) -> int:
        return 2 if self.mixed_precision else 4

    @property
    def reduce_bytes(self) -> int:
        return 4 if self.reduce_fp32 or not self.mixed_precision else 2

    @property
    def state_ranks(self) -> int:
        """Ranks one stage's sharded state is split over: its tp x dp_shard."""
        return self.tp * (self.shard or self.world // self.stages // self.tp)


@dataclass(frozen=True)
class StageMemory:
    """Bytes one rank of a pipeline stage holds, by kind: ``params`` and
    ``grads`` unsharded (compute and ``fsdp_reduce_dtype``) from the first
    forward to the last backward, ``state`` sharded (fp32 parameters,
    gradients and AdamW's moments), ``activations`` of the micro-batches in
    flight."""

    params: int
    grads: int
    state: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.state + self.activations


def stage_memory(
    params: int,
    *,
    tp: int = 1,
    shard: int = 1,
    value_bytes: int = 2,
    reduce_bytes: int = 4,
    activations: int = 0,
) -> StageMemory:
    """What a rank of a stage of ``params`` parameters holds: each tp rank
    ``1 / tp`` of every matrix (norms counted as split), unsharded in
    ``value_bytes`` with a gradient in ``reduce_bytes``; the fp32 + AdamW
    state over ``tp x shard`` ranks."""
    held = math.ceil(params / tp)
    return StageMemory(
        params=held * value_bytes,
        grads=held * reduce_bytes,
        state=math.ceil(params * ADAMW_STATE_BYTES / (tp * shard)),
        activations=activations,
    )


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


def _stage_activations(c: PipelineCluster, layers: int, flight: float) -> int:
    """Activations of ``layers`` of a stage for ``flight`` micro-batches
    (flash attention: a GPU's; the logits are the loss line's)."""
    if c.activation is None:
        return 0
    shape = replace(c.activation, n_layers=layers)
    per_micro = estimate_activations(
        shape,
        tp=c.tp,
        value_bytes=c.value_bytes,
        attention_scores=False,
        checkpointing=c.checkpointing,
        sequence_parallel=False,  # refused under PP: stages exchange whole sequences
        logits=False,
    )
    return int(per_micro * flight)


def _stage_label(plans: list[StagePlan]) -> str:
    ends = ["embedding"] * plans[0].first + ["norm, head"] * plans[-1].last
    spans = ", ".join(f"{p.layers[0]}-{p.layers[-1]}" for p in plans)
    return f"layers {spans}" + (f" + {', '.join(ends)}" if ends else "")


def format_pipeline_traffic(
    c: PipelineCluster, n_layers: int, block: int, embedding: int, head: int
) -> list[str]:
    """The per-stage memory lines (per GPU) and the cross-node comparison."""
    dtype = {2: "bf16", 4: "fp32"}
    rows = c.activation.micro_batch_size if c.activation else 0
    tp = f", tp {c.tp}" if c.tp > 1 else ""
    lines = [
        f"pipeline stages, per GPU (one rank of each stage{tp}): parameters "
        f"({dtype[c.value_bytes]}) and gradients ({dtype[c.reduce_bytes]}, fsdp_reduce_dtype) "
        "unsharded from the first forward to the last backward; sharded state (fp32 "
        f"parameters, gradients, AdamW moments over {c.state_ranks} ranks); activations of "
        f"the stage's own layers for the micro-batches {c.schedule} keeps in flight "
        f"({rows} row(s) x {c.seq_len} tokens each, flash attention"
        f"{', checkpointed' if c.checkpointing else ''}):"
    ]
    worst = CrossNode(0, 0, 0)
    plans = plan_stages(n_layers, c.stages * c.virtual, c.split)
    for rank in range(c.stages):
        held = [plans[s] for s in stage_indices(rank, c.stages, c.virtual, c.schedule)]
        params = sum(stage_params(p, block, embedding, head) for p in held)
        flight = in_flight(c.schedule, rank, c.stages, c.microbatches, c.virtual)
        layers = sum(len(p.layers) for p in held)
        mem = stage_memory(
            params,
            tp=c.tp,
            shard=c.state_ranks // c.tp,
            value_bytes=c.value_bytes,
            reduce_bytes=c.reduce_bytes,
            activations=_stage_activations(c, layers, flight),
        )
        cross = pipeline_cross_node(c, rank, params)
        worst = max(worst, cross, key=lambda x: x.total)
        named = (
            f"stage {rank}" if c.virtual == 1 else f"rank {rank}, stages {[p.stage for p in held]}"
        )
        lines.append(
            f"  {named} ({_stage_label(held)}; {format_count(params, 1)} parameters): "
            f"{format_bytes(mem.total)} = parameters {format_bytes(mem.params)} + gradients "
            f"{format_bytes(mem.grads)} + state {format_bytes(mem.state)} + activations "
            f"{format_bytes(mem.activations)} ({flight:g} micro-batch(es)); "
            f"{format_bytes(cross.total)} across nodes a step"
        )
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
    micro = cfg.pipeline_microbatches or cfg.pipeline_parallel_size
    shape = model.activation_shape(max(1, rows // dp // micro))
    cluster = PipelineCluster(
        nodes=len(node_counts),
        ranks_per_node=node_counts[0],
        stages=cfg.pipeline_parallel_size,
        tp=layout.axis_size("tp") if "tp" in layout.axis_names else 1,
        microbatches=micro,
        schedule=cfg.pipeline_schedule,
        rows=rows,
        seq_len=model.seq_len,
        dim=model.dim,
        mixed_precision=cfg.use_mixed_precision,
        reduce_fp32=cfg.fsdp_reduce_dtype == "fp32",
        reshard_after_forward=cfg.sharding_strategy.reshard_after_forward,
        micro_batch_size=train.micro_batch_size,
        virtual=cfg.pipeline_virtual_stages,
        split=cfg.pipeline_split,
        shard=layout.axis_size("dp_shard"),
        activation=shape,
        checkpointing=cfg.use_gradient_checkpointing,
    )
    head = model.embedding_params() - embedding
    return format_pipeline_traffic(cluster, model.n_layers, model.block_params(), embedding, head)
