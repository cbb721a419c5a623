"""PURE pipeline decisions: the mesh with ``pp`` outermost, the layers of each
stage, the micro-batch count and the schedule's bubble. No torch.distributed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ray_fsdp_backend.planning.pipeline_schedules import bubble_fraction, stage_indices
from ray_fsdp_backend.planning.topology import PP_AXIS, MeshLayout, Topology


def pipeline_mesh_layout(
    stages: int, topology: Topology, stage_layout: Callable[[Topology], MeshLayout]
) -> MeshLayout:
    """The mesh ``(pp, *inner)``: the node-major ranks cut into ``stages``
    consecutive groups (whole nodes each when the node count allows: one
    stage per node group), each laid out by ``stage_layout`` (the
    data- and model-parallel layout of its own ranks).

    Raises:
        ValueError: ``stages`` does not divide the world size, or the stages'
            inner layouts differ (unequal nodes).
    """
    world = topology.world_size
    if world % stages:
        raise ValueError(
            f"pipeline_parallel_size={stages} must divide the world size {world} "
            f"(workers per node {list(topology.workers_per_node)})"
        )
    per = world // stages
    order = topology.ranks_node_major
    inner = [
        stage_layout(_sub_topology(topology, order[s * per : (s + 1) * per])) for s in range(stages)
    ]
    first = inner[0]
    for s, layout in enumerate(inner):
        if (layout.axis_names, layout.shape) != (first.axis_names, first.shape):
            raise ValueError(
                f"pipeline_parallel_size={stages}: stage {s} gets mesh "
                f"{dict(zip(layout.axis_names, layout.shape, strict=True))}, stage 0 "
                f"{dict(zip(first.axis_names, first.shape, strict=True))}; every stage needs "
                "the same layout (equal nodes)"
            )
    return MeshLayout(
        axis_names=(PP_AXIS, *first.axis_names),
        shape=(stages, *first.shape),
        ranks=tuple(r for layout in inner for r in layout.ranks),
        expert_parallel_size=first.expert_parallel_size,
    )


def _sub_topology(topology: Topology, ranks: Sequence[int]) -> Topology:
    """``topology`` restricted to ``ranks`` (nodes keep their order)."""
    keep = set(ranks)
    nodes = tuple(tuple(r for r in node if r in keep) for node in topology.nodes)
    return Topology(nodes=tuple(n for n in nodes if n))


@dataclass(frozen=True)
class StagePlan:
    """Which layers stage ``stage`` of ``stages`` holds: ``layers`` (indices
    into the decoder's layer list), the embedding on the first stage, the
    final norm and head on the last."""

    stage: int
    stages: int
    layers: tuple[int, ...]

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


def balanced_split(n_layers: int, stages: int) -> list[int]:
    """Layers per stage, balanced with the embedding and the head counted as a
    layer each (as torchtitan's ``generate_llm_fqn_per_model_part``): every
    stage gets one layer, then each further layer goes to the stage with the
    least load (its layers, plus one on the first and one on the last stage),
    the LATER stage on a tie. Extra layers so land on the last stages, which
    under 1F1B keep the fewest micro-batches in flight (``P - r``): 30 layers
    on 4 stages are 7, 8, 8, 7 (peak 7 x 4 = 28 layer-micro-batches on stage
    0; an even split with the remainder first, 8, 8, 7, 7, peaks at 32).

    Raises:
        ValueError: more stages than layers.
    """
    if stages > n_layers:
        raise ValueError(
            f"{stages} pipeline stages (pipeline_parallel_size x pipeline_virtual_stages) "
            f"exceeds the model's {n_layers} layers: "
            "every stage needs at least one layer"
        )
    split = [1] * stages
    ends = [(s == 0) + (s == stages - 1) for s in range(stages)]
    for _ in range(n_layers - stages):
        lightest = min(range(stages), key=lambda s: (split[s] + ends[s], -s))
        split[lightest] += 1
    return split


def plan_stages(
    n_layers: int, stages: int, split: Sequence[int] | str | None = None
) -> list[StagePlan]:
    """Layers per stage: ``split`` (``distributed.pipeline_split``: layer
    counts, one per stage, summing to ``n_layers``) or, for None or
    ``"auto"``, :func:`balanced_split`.

    Raises:
        ValueError: more stages than layers, or a ``split`` that does not
            give every stage a layer and sum to ``n_layers``.
    """
    if split is None or split == "auto":
        split = balanced_split(n_layers, stages)
    split = list(split)
    if len(split) != stages or sum(split) != n_layers or min(split) < 1:
        raise ValueError(
            f"distributed.pipeline_split={split} must give each of the {stages} stages at least "
            f"one layer and sum to the model's {n_layers} layers"
        )
    starts = [sum(split[:s]) for s in range(stages)]
    return [
        StagePlan(stage=s, stages=stages, layers=tuple(range(a, a + n)))
        for s, (a, n) in enumerate(zip(starts, split, strict=True))
    ]


def tied_embeddings_error(model: str) -> str:
    """The refusal of a model (class name ``model``) whose input and output
    embeddings are one tensor: the first and last stage would each hold it."""
    return (
        f"{model} ties its input and output embeddings "
        "(tie_embeddings / tie_word_embeddings): under pipeline_parallel_size > 1 they sit "
        "on the first and last stage; untie them to train with pipeline parallelism"
    )


def resolve_microbatches(configured: int | None, stages: int, rows: int | None = None) -> int:
    """``pipeline_microbatches`` resolved (None: the stage count), checked
    against the step's ``rows`` when given.

    Raises:
        ValueError: ``rows`` not divisible by the micro-batch count.
    """
    micro = stages if configured is None else configured
    if rows is not None and rows % micro:
        raise ValueError(
            f"pipeline_microbatches={micro}: the step's batch of {rows} rows must split into "
            f"{micro} equal micro-batches"
        )
    return micro


def format_pipeline_plan(
    stages: int,
    n_layers: int,
    schedule: str,
    microbatches: int | None,
    groups,
    virtual: int = 1,
    split: Sequence[int] | str = "auto",
) -> list[str]:
    """``ray-fsdp plan``'s pipeline lines: the stages' layers (with virtual
    stages, the stages each pipeline rank holds), the pp groups (one rank of
    each stage) and the schedule's bubble."""
    micro = resolve_microbatches(microbatches, stages)
    count = stages * virtual
    plans = plan_stages(n_layers, count, split)
    parts = []
    for plan in plans:
        ends = ["embedding"] * plan.first + ["norm, head"] * plan.last
        extra = f" + {', '.join(ends)}" if ends else ""
        parts.append(f"{plan.stage}: layers {plan.layers[0]}-{plan.layers[-1]}{extra}")
    held = ""
    if virtual > 1:
        ranks = [list(stage_indices(r, stages, virtual, schedule)) for r in range(stages)]
        held = f"; pipeline rank r holds stages {dict(enumerate(ranks))}"
    bubble = bubble_fraction(stages, micro, schedule, virtual)
    lines = [
        f"pipeline: {count} stages ({'; '.join(parts)}){held}; {schedule}, {micro} "
        f"micro-batches: bubble {bubble:.1%} of each step",
        f"pp groups ({len(groups)}; activations to the next stage, gradients back):",
    ]
    return lines + [f"  {list(g)}" for g in groups]
