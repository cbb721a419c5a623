"""``train.objective: reward``: a Bradley-Terry reward model on preference pairs.

The model is the checkpoint's decoder with a scalar ``score`` head
(:func:`~ray_fsdp_backend.trainer.loop.pretrained.build_pretrained` with
``reward=True``). Per micro-batch: each pair's chosen and rejected score, the
head's value at each document's last token
(:func:`~ray_fsdp_backend.preference.reward.pair_scores`), and
``rfb.reward_loss``'s per-pair ``-logsigmoid(chosen - rejected)`` summed; the
step divides by its pairs (one all-reduce), as for DPO. The scores are the
``rewards/*`` metrics (TRL's ``RewardTrainer`` logs the same: the accuracy is
the chosen scored above the rejected).
"""

from __future__ import annotations

import torch
from torch import nn

from ray_fsdp_backend.trainer.loop.dpo import DPOObjective, reward_sums
from ray_fsdp_backend.trainer.loop.objectives import (
    MicroBatchResult,
    Objective,
    global_pair_count,
    pair_indices,
)
from ray_fsdp_backend.trainer.schema.spec import RunSpec


class RewardObjective(Objective):
    """``rfb.reward_loss`` over each micro-batch's pairs (docs/preference.md)."""

    def __init__(self, spec: RunSpec) -> None:
        super().__init__(spec, None)
        from ray_fsdp_backend.preference.losses import reward_loss
        from ray_fsdp_backend.preference.reward import pair_scores

        self._pair_scores, self._reward_loss = pair_scores, reward_loss

    def count(self, ctx, micro_batches: list[dict]) -> torch.Tensor:
        return global_pair_count([(pair_indices(ctx, b) >= 0).sum() for b in micro_batches])

    def micro_batch(self, ctx, model: nn.Module, batch: dict, split: str = "train"):
        del split  # the same loss on the held-out pairs
        chosen, rejected = self._pair_scores(ctx, model, batch)
        result = self._reward_loss(chosen, rejected)
        return MicroBatchResult(result.losses.sum(), None, reward_sums(result))

    # The held-out pass of the DPO family: eval_loss and eval/rewards/* over every pair.
    evaluate = DPOObjective.evaluate
