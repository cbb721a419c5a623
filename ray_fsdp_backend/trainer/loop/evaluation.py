"""The held-out loss: :func:`evaluate`.

The token mean over the whole held-out set: every rank sums the loss of
its share of the tokens (through the training step's own loss function,
so a change of the loss, say a chunked cross-entropy, reaches evaluation
too) and counts them, then one all-reduce of the two sums over all ranks
gives the mean. Ranks of a tensor-parallel group add the same pair, which
scales both sums alike and cancels; context-parallel ranks add disjoint
parts of each row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn


def evaluate(
    model: nn.Module,
    batches: Iterable,
    sums: Callable[[object], tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
) -> float:
    """The token-mean loss over ``batches``: ``sums(batch)`` returns one
    micro-batch's ``(loss token sum, valid token count)`` on this rank.
    Collective: every rank calls it with as many batches. Runs without
    gradients and in eval mode (dropout off), then restores the mode.
    NaN when the held-out set has no valid token."""
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                token_sum, count = sums(batch)
                totals += torch.stack([token_sum.double(), count.double()])
    finally:
        model.train(training)
    if dist.is_initialized():
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    token_sum, count = totals.tolist()
    return token_sum / count if count else float("nan")
