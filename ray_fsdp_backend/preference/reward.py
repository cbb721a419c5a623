"""A Bradley-Terry reward model's scores on packed preference rows.

The model is the pretrained decoder with a scalar head (transformers'
``*ForSequenceClassification``, ``num_labels=1``, the head named ``score``:
:func:`~ray_fsdp_backend.hf.models.build_sequence_classifier`). A sequence's
score is the head's value at its *last* token. transformers pools that
token itself as the last one that is not ``pad_token_id``, once per row: on
a packed row (several documents, chosen and rejected of each pair) that is
one token of the last document, so its pooled output is never used here.
:func:`pair_scores` takes the head's per-token output (a forward hook on
``score``) and keeps, per row-local ``sequence_ids``, the value at the
sequence's largest ``position_ids`` (positions restart at 0 with every
document, so that is its last token on every layout). Under context
parallelism a sequence's last token lies on one cp rank: the largest
positions are agreed over the cp group (a MAX) and the scores summed over it
(an all-reduce whose backward sums too, as the pairs' log-prob sums are).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ray_fsdp_backend.compat.peft import peft_base, unwrap
from ray_fsdp_backend.hf.models import SCORE_HEAD
from ray_fsdp_backend.ops.head import LossHead, keep_head_gathered
from ray_fsdp_backend.ops.sequences import sequence_sums
from ray_fsdp_backend.planning.topology import CP_AXIS


def score_head(model: nn.Module) -> nn.Module:
    """The scalar head (``score``) of a reward model (wrapped, or a PEFT model).

    Raises:
        ValueError: the model has no ``score`` linear layer with one output.
    """
    base = peft_base(unwrap(model))
    head = getattr(base, SCORE_HEAD, None)
    if not isinstance(head, nn.Linear) or head.out_features != 1:
        raise ValueError(
            f"{type(base).__name__} has no {SCORE_HEAD!r} head with one output: a reward model "
            "is built with build_sequence_classifier (AutoModelForSequenceClassification, "
            "num_labels=1)"
        )
    return head


def token_scores(ctx, model: nn.Module, batch: dict) -> torch.Tensor:
    """The head's value at every token, ``[rows, seq]`` fp32, from one forward
    of ``batch`` (as ``ctx.shard_sequence`` returned it; its ``position_ids``
    passed to the model, which keeps packed documents apart)."""
    head = score_head(model)
    # The loss uses the head's per-token output, not the output of the FSDP
    # unit holding it: keep its weight gathered for backward.
    keep_head_gathered(model, LossHead(head))
    captured: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    finally:
        hook.remove()
    return captured[0][..., 0].float()


def sequence_scores(ctx, values: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores, present)``, each ``[rows, S]``: the value of ``values``
    (``[rows, seq]``) at each row-local sequence's last token, and whether
    the row has that sequence; ``S`` is even and the same on every cp rank
    (the whole row's length, rounded up). Summed over the cp group."""
    sequence_ids, positions = batch["sequence_ids"], batch["position_ids"].expand_as(values)
    width = values.shape[1] * ctx.cp_size
    width += width % 2
    valid = sequence_ids >= 0
    slot = torch.where(valid, sequence_ids, 0).long()
    last = torch.full((values.shape[0], width), -1, dtype=positions.dtype, device=values.device)
    last.scatter_reduce_(1, slot, torch.where(valid, positions, -1), reduce="amax")
    group = ctx.mesh[CP_AXIS].get_group() if ctx.cp_size > 1 else None
    if group is not None:
        dist.all_reduce(last, op=dist.ReduceOp.MAX, group=group)
    at_last = valid & (positions == last.gather(1, slot))
    ids = torch.where(at_last, sequence_ids, -1)  # each sequence: its last token alone
    sums = sequence_sums(values, ids, group=group, num_sequences=width)
    return sums.sums, sums.counts > 0


def pair_scores(ctx, model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen, rejected)``, each ``[pairs]`` fp32: the reward model's score
    of each pair's chosen (sequence ``2p`` of its row) and rejected (``2p +
    1``) document, the micro-batch's pairs in row-major order, whole on every
    rank of a cp group. One forward of ``model``; differentiable."""
    scores, present = sequence_scores(ctx, token_scores(ctx, model, batch), batch)
    pairs = present[:, 0::2] & present[:, 1::2]
    return scores[:, 0::2][pairs], scores[:, 1::2][pairs]
