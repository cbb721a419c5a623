"""What the trainer optimises (``train.objective``): one :class:`Objective`
chosen once per run (:func:`~ray_fsdp_backend.trainer.loop.step.build_objective`),
the seam the train step and the held-out evaluation call per micro-batch.

An objective gives two things: the step's divisor (:meth:`Objective.count`,
one all-reduce: the valid tokens of the step for ``sft``, its pairs for
``dpo`` / ``reward``) and one micro-batch's *sum* of per-unit losses
(:meth:`Objective.micro_batch`), with sums of the metrics it logs. The step
divides each micro-batch's sum by the step's count, so the gradient is that
of the mean over the step's tokens (or pairs) whatever the layout and the
accumulation, and the metrics divided the same way are means over the
step's pairs once averaged over the ranks (``StepMeter.measure``).

Both counts follow ``ctx.global_token_count``: summed over every rank and
divided by the world size. A pair's sums are whole on every rank of a tp x
cp group (``rfb.pair_log_probs`` reduces them over the cp group), so its
count is the step's pairs over the dp size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ray_fsdp_backend.trainer.loop.loss import micro_batch_loss
from ray_fsdp_backend.trainer.schema.spec import RunSpec


class MicroBatchResult(NamedTuple):
    """One micro-batch's share of the step, before the step's division."""

    total: torch.Tensor
    """The sum of the micro-batch's per-unit losses (tokens or pairs), 0-d fp32."""
    aux_loss: torch.Tensor | None = None
    """A mixture-of-experts model's auxiliary loss (logged, not trained)."""
    stats: dict[str, torch.Tensor] | None = None
    """Sums over the micro-batch's units of what the objective logs
    (``rewards/chosen``, ...), divided by the step's count like the loss."""


class Objective:
    """The next-token cross-entropy (``train.objective: sft``): the token sum
    of a micro-batch over the step's valid targets."""

    def __init__(self, spec: RunSpec, head) -> None:
        self.spec, self.head = spec, head

    def count(self, ctx, micro_batches: list[dict]) -> torch.Tensor:
        """The step's divisor; one all-reduce."""
        return ctx.global_token_count([batch["targets"] for batch in micro_batches])

    def micro_batch(self, ctx, model: nn.Module, batch: dict) -> MicroBatchResult:
        """Forward of one micro-batch as ``ctx.shard_sequence`` returned it;
        the step runs it under ``ctx.sequence_region()`` and ``ctx.loss_parallel()``."""
        chunk = self.spec.train.loss_chunk_tokens
        token_sum, aux = micro_batch_loss(
            model,
            batch["input_ids"],
            batch["targets"],
            position_ids=model_positions(ctx, self.spec, batch),
            head=self.head,
            chunk_tokens=chunk,
            compile=self.spec.distributed.compiles_on(ctx.device.type),
        )
        return MicroBatchResult(token_sum, aux)

    def before_training(self, ctx, model: nn.Module, rows, held_out_rows) -> None:
        """Work before the first step (``dpo``'s precomputed reference):
        ``rows()`` / ``held_out_rows()`` give this rank's training / held-out
        micro-batches (``held_out_rows`` None without a held-out set)."""

    def state_dict(self) -> dict:
        """What the checkpoint keeps of the objective (its extra state)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        del state


def global_pair_count(pair_counts: list[torch.Tensor]) -> torch.Tensor:
    """The step's pairs over every dp rank divided by the dp size (each rank
    of a tp x cp group counts its group's pairs): ``pair_counts`` holds this
    rank's count per micro-batch. One all-reduce; at least 1."""
    count = torch.stack(pair_counts).sum().to(torch.float32)
    if not dist.is_initialized():
        return count.clamp(min=1.0)
    dist.all_reduce(count, op=dist.ReduceOp.SUM)
    # Summed over every rank, each dp rank's pairs appear tp x cp times.
    return count.clamp(min=1.0) / dist.get_world_size()


def pair_indices(ctx, batch: dict) -> torch.Tensor:
    """``[rows, pairs]``: the ``pair_index`` of pair ``p`` of each row (its
    sequences ``2p`` and ``2p + 1``), -1 where a row has fewer pairs; whole
    rows under cp (a MAX over the cp group)."""
    sequence_ids, index = batch["sequence_ids"], batch["pair_index"]
    valid = sequence_ids >= 0
    pairs = int(sequence_ids.max().clamp(min=-1)) // 2 + 1
    if ctx.cp_size > 1:  # a row's pairs may lie on another cp rank: agree on the width
        width = torch.tensor([pairs], device=sequence_ids.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=ctx.cp_group)
        pairs = int(width)
    # one spare column: padding tokens scatter -1 into column 0 of a row without pairs
    out = torch.full((len(sequence_ids), pairs + 1), -1, dtype=torch.long, device=index.device)
    slot = torch.where(valid, sequence_ids // 2, pairs)
    out.scatter_reduce_(1, slot, torch.where(valid, index, -1).long(), reduce="amax")
    out = out[:, :pairs]
    if ctx.cp_size > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=ctx.cp_group)
    return out


def local_value(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``value``: under ``loss_parallel`` the loss is a
    DTensor replicated over the tp group, which a plain tensor cannot add."""
    return value.to_local() if isinstance(value, DTensor) else value


def model_positions(ctx, spec: RunSpec, batch: dict) -> torch.Tensor | None:
    """The ``position_ids`` the model needs: packed rows' (document masks)
    and a cp shard's (its offsets); None for whole unpacked rows, whose
    attention then takes the causal kernel without inspecting the positions
    on the host (that check, per layer, would sync every step)."""
    if spec.data.packing or ctx.cp_size > 1:
        return batch["position_ids"]
    return None
