"""Per-pair log-prob sums of a micro-batch of packed preference rows.

A row holds whole pairs (``sequence_ids``: pair ``p`` is sequences ``2p``,
the chosen, and ``2p + 1``, the rejected; -1 padding): the targets' log-probs
come from ``ctx.sequence_log_probs`` (the fused head, never the whole
logits), are summed per sequence over the row (all-reduced over the cp group
when cp splits the rows) and returned pair by pair in row-major order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from ray_fsdp_backend.context_parallel.sequence import IGNORE_INDEX
from ray_fsdp_backend.ops.sequences import sequence_sums, sequences_per_row

if TYPE_CHECKING:
    from ray_fsdp_backend.runtime.context import TrainContext


class PairLogProbs(NamedTuple):
    """Each pair's summed log-probs and target counts, ``[pairs]`` fp32."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def pair_log_probs(
    ctx: TrainContext, model: nn.Module, batch: dict[str, torch.Tensor], **kwargs: Any
) -> PairLogProbs:
    """The summed log-probs of every pair's chosen and rejected response in
    ``batch`` under ``model``.

    ``batch`` is a micro-batch as ``ctx.shard_sequence`` returned it, with
    ``input_ids``, ``targets`` (shifted; -100 on prompt and padding),
    ``position_ids`` and ``sequence_ids``. Only targets that are not -100
    count, so each sum is over its response's tokens. Under cp every rank of
    the cp group gets the whole pairs' sums (see
    :mod:`ray_fsdp_backend.ops.sequences` for the gradient). One host read
    (how many pairs each row holds) per call.

    Args:
        ctx: the worker's :class:`~ray_fsdp_backend.runtime.context.TrainContext`.
        model: the wrapped policy or reference model.
        batch: the micro-batch (see above).
        **kwargs: passed to ``ctx.sequence_log_probs`` (``temperature``,
            ``chunk_tokens``).

    Returns:
        :class:`PairLogProbs`, ``[pairs]`` each, pairs in row-major order.

    Raises:
        ValueError: ``batch`` without ``sequence_ids``, or a row whose
            sequence count is odd (a chosen without its rejected).
    """
    if "sequence_ids" not in batch:
        raise ValueError(
            f"batch has no 'sequence_ids' (keys: {sorted(batch)}): pair_log_probs needs "
            "preference rows (rfb.preference_dataset)"
        )
    token_log_probs = ctx.sequence_log_probs(model, batch, **kwargs)
    return sum_pairs(token_log_probs, batch["targets"], batch["sequence_ids"], ctx.cp_group)


def sum_pairs(
    token_log_probs: torch.Tensor,
    targets: torch.Tensor,
    sequence_ids: torch.Tensor,
    group: torch.distributed.ProcessGroup | None = None,
) -> PairLogProbs:
    """:func:`pair_log_probs` after the log-probs: ``[rows, seq]`` per-token
    log-probs summed by pair over ``group`` (the cp group, or None)."""
    sequence_ids = sequence_ids.long()
    per_row = sequences_per_row(sequence_ids, group=group).tolist()  # the one host read
    odd = [row for row, count in enumerate(per_row) if count % 2]
    if odd:
        raise ValueError(
            f"rows {odd} hold an odd number of sequences {[per_row[r] for r in odd]}: "
            "sequence_ids 2p and 2p + 1 are the chosen and rejected of pair p"
        )
    counted = torch.where(targets != IGNORE_INDEX, sequence_ids, -1)
    sums, counts = sequence_sums(
        token_log_probs, counted, group=group, num_sequences=max(per_row, default=0)
    )
    device = sums.device
    pairs = [(r, 2 * p) for r, n in enumerate(per_row) for p in range(n // 2)]
    rows = torch.tensor([r for r, _ in pairs], dtype=torch.long, device=device)
    chosen = torch.tensor([c for _, c in pairs], dtype=torch.long, device=device)
    return PairLogProbs(
        sums[rows, chosen], sums[rows, chosen + 1], counts[rows, chosen], counts[rows, chosen + 1]
    )
