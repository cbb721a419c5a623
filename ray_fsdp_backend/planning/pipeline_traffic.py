"""PURE: the bytes one optimizer step moves, with and without pipeline
parallelism, and the part that crosses nodes (``ray-fsdp plan``'s number that
makes the choice). No torch.distributed.

Per rank and per step, with ``reshard_after_forward`` off under PP (as the
backend sets it: a stage runs several micro-batches' forwards before their
backwards):

- P2P: a stage sends each micro-batch's output activations to the next stage
  and the gradient of its input back to the previous one: ``rows x seq x dim``
  values of the step's rows this dp rank runs, once per direction it has a
  neighbour in.
- FSDP2 inside the stage: every unit is all-gathered once (the first
  micro-batch's forward; it stays unsharded until the last backward) and its
  gradient reduce-scattered once (the last backward), over the stage's shard
  group of ``n`` ranks; a rank sends and receives ``(n - 1) / n`` of each
  (a ring). HSDP adds the all-reduce of the shard over the replicas:
  ``2 (r - 1) / r`` of the rank's gradient shard.

A collective crosses nodes when its group spans nodes; a P2P send crosses
when the next stage is on another node. Without PP the same model is one
stage whose every unit is all-gathered ``micro_batches`` times (twice under
``reshard_after_forward``) over the whole data-parallel group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def padded_numel(shape: Sequence[int], shards: int) -> int:
    """Elements FSDP2 all-gathers for a tensor of ``shape`` over ``shards``
    ranks: dim 0 padded to a multiple of ``shards``."""
    if not shape:
        return shards  # a scalar is a 1-element tensor padded to one per rank
    return math.ceil(shape[0] / shards) * shards * math.prod(shape[1:])


@dataclass(frozen=True)
class StageVolumes:
    """What one rank's collectives and sends carry in one step, in bytes:
    ``sends`` (P2P activations and input gradients it sends), ``all_gather``
    (the unsharded units it gathers: the collectives' outputs) and
    ``reduce_scatter`` (the gradients it reduces: the collectives' inputs)."""

    sends: int
    all_gather: int
    reduce_scatter: int


def stage_volumes(
    param_numels: Iterable[int],
    *,
    stage: int,
    stages: int,
    activation_values: int,
    gathers: int = 1,
    param_bytes: int = 2,
    reduce_bytes: int = 4,
    activation_bytes: int = 2,
) -> StageVolumes:
    """The step's volumes of a rank of ``stage`` of ``stages`` holding units of
    ``param_numels`` (as :func:`padded_numel` gives them), all-gathered
    ``gathers`` times a step; ``activation_values``: ``rows x seq x dim`` of
    the step's rows this rank runs (every micro-batch together)."""
    numel = sum(param_numels)
    neighbours = (stage > 0) + (stage < stages - 1)
    return StageVolumes(
        sends=neighbours * activation_values * activation_bytes,
        all_gather=gathers * numel * param_bytes,
        reduce_scatter=numel * reduce_bytes,
    )


@dataclass(frozen=True)
class CrossNode:
    """Bytes one rank sends across nodes in one step: ``sends`` (P2P to a
    stage on another node), ``fsdp`` (all-gather and reduce-scatter over a
    shard group spanning nodes) and ``replicate`` (HSDP's all-reduce over
    replicas on other nodes)."""

    sends: int
    fsdp: int
    replicate: int

    @property
    def total(self) -> int:
        return self.sends + self.fsdp + self.replicate


def cross_node_bytes(
    volumes: StageVolumes,
    *,
    shard: int,
    shard_spans_nodes: bool,
    replicas: int = 1,
) -> CrossNode:
    """The part of ``volumes`` a rank sends across nodes (its sends all
    crossing: the caller counts the boundaries that do): ring collectives move
    ``(n - 1) / n`` of their tensor per rank over a group of ``n``; ``shard``
    ranks shard the units (spanning nodes or not), ``replicas`` (HSDP, across
    nodes) all-reduce each rank's gradient shard."""
    fsdp = 0
    if shard_spans_nodes and shard > 1:
        fsdp = (volumes.all_gather + volumes.reduce_scatter) * (shard - 1) // shard
    grad_shard = volumes.reduce_scatter // shard
    replicate = 2 * grad_shard * (replicas - 1) // replicas if replicas > 1 else 0
    return CrossNode(sends=volumes.sends, fsdp=fsdp, replicate=replicate)


__all__ = [
    "CrossNode",
    "StageVolumes",
    "cross_node_bytes",
    "padded_numel",
    "stage_volumes",
]
