"""What a transformers model's forward must receive under context parallelism.

Under cp a transformers model sees one shard of each row, and three of its
ordinary inputs would silently compute something else there (measured on
Qwen3 at cp 2, transformers 5.25):

- ``labels`` without ``shift_labels``: transformers shifts ``labels`` inside
  the shard, so a rank would drop its last target and, with the labels
  ``ctx.shard_sequence`` returns (already shifted over the whole row), learn
  the token two places ahead. ``shard_sequence`` also returns them as
  ``shift_labels``, transformers' name for targets it takes as they are
  (``ForCausalLMLoss``), so ``model(**batch)`` is exact; ``labels`` arriving
  without them are refused.
- an ``attention_mask`` that hides a token before a visible one (left or
  middle padding): transformers builds no mask for the registered attention
  name, so it would be ignored. Right padding needs no mask (causal
  attention never lets a real token see a later pad) and is accepted.
- no ``position_ids``: transformers would make ``0 .. seq/cp - 1`` on every
  rank, and rotary embeddings and the document spans would be wrong.

:func:`install_input_checks` hooks every outermost transformers model; the
checks run before its forward, on every cp rank alike (the mask check
gathers the mask over the cp group), so all ranks refuse together.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from ray_fsdp_backend.context_parallel.sequence import HF_SHIFTED_LABELS
from ray_fsdp_backend.context_parallel.ulysses import gather_sequence


def install_input_checks(hf_models: list[nn.Module], group) -> None:
    """Refuse, before each forward of the outermost of ``hf_models``, the
    inputs cp cannot compute (see the module docstring); ``group``: the cp
    group the attention mask is gathered over."""
    for model in outermost(hf_models):
        hook = functools.partial(_check_forward, group=group)
        model.register_forward_pre_hook(hook, with_kwargs=True)


def outermost(models: list[nn.Module]) -> list[nn.Module]:
    """The models of ``models`` that no other one of them contains (a
    ``...ForCausalLM``, not its inner ``...Model``)."""
    inner = {id(m) for outer in models for m in outer.modules() if m is not outer}
    return [m for m in models if id(m) not in inner]


def _check_forward(module: nn.Module, args: tuple, kwargs: dict, *, group) -> None:
    inputs = forward_arguments(module, args, kwargs)
    check_cp_inputs(type(module).__name__, inputs, group)


def forward_arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict:
    """``module.forward``'s arguments by name, positional ones included."""
    names = _positional_names(type(module))
    return {**dict(zip(names, args, strict=False)), **kwargs}


@functools.cache
def _positional_names(cls: type) -> tuple[str, ...]:
    params = list(inspect.signature(cls.forward).parameters.values())[1:]  # self
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def check_cp_inputs(model_name: str, inputs: dict, group) -> None:
    """Raise ValueError for the inputs of one forward under cp that would
    compute something else than one process on whole rows: ``labels``
    without ``shift_labels``, no ``position_ids``, or an ``attention_mask``
    (gathered over ``group``) with a hidden token before a visible one."""
    if inputs.get("labels") is not None and inputs.get(HF_SHIFTED_LABELS) is None:
        raise ValueError(
            f"context parallelism: {model_name} got labels= without {HF_SHIFTED_LABELS}=; "
            "transformers would shift them again inside this rank's shard (the model learns "
            "the token two ahead, or drops each shard's last target). Pass the batch "
            f"ctx.shard_sequence returns (model(**batch): labels and {HF_SHIFTED_LABELS}, "
            "shifted over the whole row), or compute the loss from the logits"
        )
    if inputs.get("position_ids") is None and _has_tokens(inputs):
        raise ValueError(
            f"context parallelism: {model_name} got no position_ids; every cp rank would "
            "number its shard 0..seq/cp-1 (wrong rotary positions and documents). Pass the "
            "position_ids ctx.shard_sequence returns"
        )
    mask = inputs.get("attention_mask")
    if mask is not None:
        refuse_hidden_prefix(model_name, mask, group)


def _has_tokens(inputs: dict) -> bool:
    return inputs.get("input_ids") is not None or inputs.get("inputs_embeds") is not None


def refuse_hidden_prefix(model_name: str, mask, group) -> None:
    """Accept a 2-D ``[batch, seq/cp]`` 0/1 mask whose whole rows (gathered
    over ``group``) never show a token after a hidden one (no padding, or
    padding at the end only); refuse anything else by name."""
    if not torch.is_tensor(mask) or mask.ndim != 2:
        shape = tuple(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
        raise ValueError(
            f"context parallelism: {model_name} got attention_mask of shape {shape}; under cp "
            "only a 2-D [batch, seq] padding mask is taken (transformers builds no mask for "
            "the cp attention: document masks come from position_ids)"
        )
    rows = gather_sequence(mask.to(torch.int32), group) if group is not None else mask
    hidden_before_visible = (torch.diff(rows.to(torch.int32), dim=-1) > 0).any(dim=-1)
    if bool(hidden_before_visible.any()):
        bad = hidden_before_visible.nonzero().flatten().tolist()
        raise ValueError(
            f"context parallelism: {model_name} got an attention_mask that hides tokens "
            f"before visible ones (left or middle padding) in rows {bad}; the cp attention "
            "computes causal attention without a padding mask. Pad at the end of each row "
            "(label -100), where causal attention never lets a real token see a pad"
        )
