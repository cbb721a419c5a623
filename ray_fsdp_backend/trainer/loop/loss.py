"""The trainer's one loss: what the train step (and any eval) calls per micro-batch.

:func:`micro_batch_loss` runs the model on a micro-batch as
``ctx.shard_sequence`` returned it and gives the token-sum cross-entropy of
its ``targets`` (already shifted: target ``i`` is the token after input
``i``; -100 takes no loss) and a mixture-of-experts model's auxiliary loss.

With ``train.loss_chunk_tokens`` > 0 (the default) the logits are never
made whole: the output head's input is captured and the head computes the
first position of each row only
(:func:`~ray_fsdp_backend.ops.head.capture_head_input`), then
:func:`~ray_fsdp_backend.ops.loss.linear_cross_entropy` takes the hidden states
and the head's weight (tied or not; a tp head's vocabulary slice) chunk by
chunk. The model's forward is otherwise the one it has: the example
decoder and every transformers causal LM (its ``get_output_embeddings()``,
Gemma's ``final_logit_softcapping``, Cohere's ``logit_scale`` and Granite's
``logits_scaling`` applied as the model would). The head's weight is used
after the forward, so the FSDP unit that holds it keeps it gathered until
backward (:func:`~ray_fsdp_backend.ops.head.prepare_loss`; torch's own default for a root unit, and
the root's weights are gathered again at the start of backward anyway).
With ``distributed.compile`` on (``auto``: on CUDA workers) the fused
loss's per-chunk math is compiled too (``linear_cross_entropy(...,
compile=True)``). ``loss_chunk_tokens: 0`` computes ``F.cross_entropy``
on the whole fp32 logits, as before; a head that is not a plain bias-free
``nn.Linear`` (a LoRA adapter on it) takes that path too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ray_fsdp_backend.ops.head import LossHead, head_hidden_states
from ray_fsdp_backend.ops.loss import linear_cross_entropy


class MicroBatchLoss(NamedTuple):
    token_sum: torch.Tensor
    """Cross-entropy summed over the micro-batch's valid targets (fp32, 0-d)."""
    aux_loss: torch.Tensor | None
    """The model output's ``aux_loss`` (an MoE with ``output_router_logits``)."""


def micro_batch_loss(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    position_ids: torch.Tensor | None,
    head: LossHead | None,
    chunk_tokens: int,
    compile: bool = False,
) -> MicroBatchLoss:
    """The token-sum cross-entropy of one micro-batch and its aux loss.

    Args:
        model: the wrapped model (the example decoder or a transformers causal LM).
        inputs, targets: ``[batch, seq]`` token ids and shifted targets (-100: none).
        position_ids: what the model takes (packed rows, cp shards) or None.
        head: :func:`~ray_fsdp_backend.ops.head.prepare_loss`'s result; None: full logits.
        chunk_tokens: tokens per chunk of the fused loss.
        compile: compile the fused loss's per-chunk math (the run's
            ``distributed.compile``, resolved for the worker's device).
    """
    if head is None:
        output = model(inputs, position_ids=position_ids)
        logits = getattr(output, "logits", output)  # a transformers model's output
        token_sum = F.cross_entropy(
            logits.float().flatten(0, 1), targets.flatten(), reduction="sum"
        )
        return MicroBatchLoss(token_sum, getattr(output, "aux_loss", None))
    hidden, output = head_hidden_states(model, head, inputs, position_ids=position_ids)
    token_sum = linear_cross_entropy(
        hidden,
        head.module.weight,
        targets,
        chunk_size=chunk_tokens,
        softcap=head.softcap,
        compile=compile,
    )
    return MicroBatchLoss(token_sum, getattr(output, "aux_loss", None))
