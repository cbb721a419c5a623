"""The output head the fused loss and log-probs take, found on any causal LM.

:func:`resolve_loss_head` finds a model's head (the example decoder's or a
transformers causal LM's ``get_output_embeddings()``) with the logit
soft-cap and scale its config applies; :func:`prepare_loss` also keeps the
head's FSDP unit gathered after forward, since the head's weight is used
after the model's forward returns; :func:`head_hidden_states` runs the model
with the head computing one position a row (:func:`capture_head_input`) and
returns the head's input, scaled as the model scales its logits. The
trainer's loss (``trainer/loop/loss.py``) and ``ctx.sequence_log_probs`` use
these.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

_logger = logging.getLogger(__name__)


class HeadInput:
    """What :func:`capture_head_input` saw: the head's input ``hidden``."""

    hidden: torch.Tensor | None = None


@contextlib.contextmanager
def capture_head_input(head: nn.Module) -> Iterator[HeadInput]:
    """While open, every call of the output ``head`` keeps its input in the
    yielded :class:`HeadInput` and computes the first position of each row
    only (its input becomes the ``[..., :1, :]`` slice; an empty one fails
    DTensor's sharding propagation under tp, torch 2.13): the model's forward
    runs whole but makes ``batch x vocab`` logits, not ``tokens x vocab``.
    The hook runs after the head's own pre-hooks (a tp head's input is then
    the ``Replicate`` DTensor its weight takes)."""
    captured = HeadInput()

    def hook(_module, args):
        captured.hidden = args[0]
        return (args[0][..., :1, :], *args[1:])

    handle = head.register_forward_pre_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


class LossHead(NamedTuple):
    """The output head and how the model turns its output into logits."""

    module: nn.Linear
    softcap: float | None = None
    """Gemma 2/3's ``final_logit_softcapping``."""
    scale: float = 1.0
    """A factor on the logits (Cohere's ``logit_scale``, 1 / Granite's
    ``logits_scaling``), applied to the hidden states instead."""


def resolve_loss_head(model: nn.Module) -> LossHead | None:
    """The head the fused loss takes: the model's ``get_output_embeddings()``
    when it is a bias-free ``nn.Linear``, with the logit soft-cap and scale of
    a transformers config; None (full logits) otherwise. A DDP wrapper is
    looked through (its ``module``)."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        return None
    config = getattr(model, "config", None)
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:
        scale = float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:
        scale = 1.0 / float(config.logits_scaling)
    return LossHead(head, getattr(config, "final_logit_softcapping", None), scale)


def prepare_loss(model: nn.Module, chunk_tokens: int) -> LossHead | None:
    """The head for the fused loss (None: full logits, also for
    ``chunk_tokens == 0``), its FSDP unit set to keep the weight gathered
    after forward. Logs why a model takes the full-logits path."""
    if chunk_tokens == 0:
        return None
    head = resolve_loss_head(model)
    if head is None:
        _logger.info(
            "train.loss_chunk_tokens=%d: %s's output head is not a bias-free nn.Linear "
            "(a LoRA adapter on it?): the loss takes the full logits",
            chunk_tokens,
            type(model).__name__,
        )
        return None
    return keep_head_gathered(model, head)


def keep_head_gathered(model: nn.Module, head: LossHead) -> LossHead:
    """Set the FSDP unit that holds ``head`` (innermost) to keep its
    weights gathered after forward, where the fused kernel uses the head's
    weight (torch's own default for a root unit; its weights are gathered
    again at the start of backward anyway). Returns ``head``."""
    owner = _owning_fsdp_unit(model, head.module)
    if owner is not None:
        owner.set_reshard_after_forward(False, recurse=False)
    return head


def _owning_fsdp_unit(model: nn.Module, head: nn.Module) -> FSDPModule | None:
    """The innermost FSDP module whose subtree holds ``head``."""
    owner = None
    for module in model.modules():
        if isinstance(module, FSDPModule) and any(m is head for m in module.modules()):
            owner = module  # modules() walks outer to inner
    return owner


def head_hidden_states(
    model: nn.Module, head: LossHead, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, Any]:
    """Run ``model(*args, **kwargs)`` with ``head`` computing one position a
    row; return the head's input (times :attr:`LossHead.scale`) and the
    model's output (its ``aux_loss``; its logits are ``[batch, 1, vocab]``)."""
    with capture_head_input(head.module) as captured:
        output = model(*args, **kwargs)
    hidden = captured.hidden if head.scale == 1.0 else captured.hidden * head.scale
    return hidden, output
