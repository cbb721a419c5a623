"""Per-sequence sums of per-token values on packed rows, across cp shards.

A packed row holds several sequences; ``sequence_ids`` names each token's
row-local sequence (0, 1, ...; -1 counts for nothing: padding, or a token
whose target is ignored). :func:`sequence_sums` adds a ``[rows, seq]``
tensor by those ids into ``[rows, S]`` and counts the tokens the same way.
Under context parallelism each rank holds a slice of every row: the sums
and counts of the slices are all-reduced over the cp group with an
autograd-aware all-reduce, so every cp rank gets the whole sequences' sums
and its backward sends each rank the gradient of its own tokens.

The gradient convention: the all-reduce's backward sums the ranks' gradients
(``torch.distributed.nn.functional.all_reduce``), so a loss computed
identically on every cp rank from the sums gives each rank ``cp`` times its
tokens' share; averaged over the cp ranks (as FSDP and DDP average over
dp x cp) that is exactly one process's gradient of the same loss.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_reduce


class SequenceSums(NamedTuple):
    sums: torch.Tensor
    """``[rows, S]`` (fp32): each sequence's sum of the values."""
    counts: torch.Tensor
    """``[rows, S]`` (fp32): each sequence's tokens (ids not -1)."""


def sequence_sums(
    values: torch.Tensor,
    sequence_ids: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    num_sequences: int | None = None,
) -> SequenceSums:
    """Per-row sums of ``values`` by row-local sequence id, over ``group``.

    ``S`` is ``num_sequences`` when given, else the largest id + 1 over the
    group's slices (:func:`sequences_per_row`: one all-reduce and one host
    read, since ``S`` is a shape). One all-reduce of the stacked sums and
    counts over ``group`` (none without one), differentiable in ``values``.

    Args:
        values: ``[rows, seq]`` per-token values (e.g. log-probs, 0 where
            the target is ignored).
        sequence_ids: ``[rows, seq]`` int ids; -1 counts for nothing; ids at
            or past ``S`` are an error (``scatter_add`` raises on CPU).
        group: the process group whose ranks hold slices of the same rows
            (the cp group); None: this rank holds whole rows.
        num_sequences: ``S``; None derives it as above.

    Returns:
        :class:`SequenceSums` of ``[rows, S]`` fp32 sums and counts.

    Raises:
        ValueError: ``values`` and ``sequence_ids`` of different shapes.
    """
    if values.shape != sequence_ids.shape or values.ndim != 2:
        raise ValueError(
            f"values {tuple(values.shape)} and sequence_ids {tuple(sequence_ids.shape)} "
            "must both be [rows, seq]"
        )
    if num_sequences is None:
        num_sequences = int(sequences_per_row(sequence_ids, group=group).max().clamp_min(0))
    rows = values.shape[0]
    kept = sequence_ids >= 0
    # Ignored tokens go to a spare last column, then dropped: no host sync.
    index = torch.where(kept, sequence_ids, num_sequences).long()
    stacked = torch.stack((values.float(), kept.float()))  # [2, rows, seq]
    out = stacked.new_zeros(2, rows, num_sequences + 1)
    out = out.scatter_add(2, index.unsqueeze(0).expand_as(stacked), stacked)[..., :num_sequences]
    if group is not None and dist.get_world_size(group) > 1:
        out = all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return SequenceSums(out[0], out[1].detach())


def sequences_per_row(
    sequence_ids: torch.Tensor, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``[rows]`` int64: each row's largest sequence id + 1 (0 for a row of
    padding), over the slices of ``group`` (one all-reduce, no host read)."""
    counts = sequence_ids.max(dim=1).values.clamp_min(-1) + 1
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
    return counts
