"""``model.lora:``: train LoRA adapters on a frozen pretrained base.

Next to ``model.pretrained`` in a training YAML::

    model:
      pretrained: /data/llama-3-8b
      base_dtype: bf16                 # the frozen base; adapters stay fp32
      lora: {r: 8, alpha: 16, dropout: 0.0, target_modules: [q_proj, v_proj]}
      # lora.base_quantization: nf4   # QLoRA: a 4-bit base (needs torchao)
      export: /mnt/shared/llama-3-8b-lora
      export_format: peft              # adapters only; hf: merged into the base

The worker builds the base on the meta device, wraps it with ``peft``'s
``get_peft_model`` (the adapters trainable, the base frozen), and lets the
backend shard, initialise (PEFT's init: ``lora_B`` zeros) and load it; only
the adapters get gradients, optimizer state and checkpoint space.
``peft`` (and torch) are imported on use only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class LoraOptions:
    """The ``model.lora:`` section (``peft.LoraConfig`` under these names)."""

    r: int = 8
    """Rank of every adapter."""
    alpha: float = 16
    """Scale numerator: the update is ``alpha / r * B A``."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    """Names (last component) of the linear layers that get adapters."""
    base_quantization: str | None = None
    """``nf4``: QLoRA, the frozen base's linear weights in 4-bit NF4 (``torchao``),
    each rank quantising its own shard (docs/lora.md); None: the base as read."""

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LoraOptions:
        """Raises ValueError naming ``model.lora.<key>`` and its value."""
        if not isinstance(values, Mapping):
            raise ValueError(f"model.lora={values!r} must be a mapping of r, alpha, ...")
        known = [f.name for f in fields(cls)]
        unknown = [k for k in values if k not in known]
        if unknown:
            raise ValueError(f"model.lora: unknown key(s) {unknown}; valid keys: {known}")
        r, alpha = values.get("r", 8), values.get("alpha", 16)
        dropout, targets = (
            values.get("dropout", 0.0),
            values.get("target_modules", cls.target_modules),
        )
        if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
            raise ValueError(f"model.lora.r={r!r} must be a positive int")
        if not _is_number(alpha) or alpha <= 0:
            raise ValueError(f"model.lora.alpha={alpha!r} must be a positive number")
        if not _is_number(dropout) or not 0 <= dropout < 1:
            raise ValueError(f"model.lora.dropout={dropout!r} must be in [0, 1)")
        if isinstance(targets, str) or not targets or not all(isinstance(t, str) for t in targets):
            raise ValueError(
                f"model.lora.target_modules={targets!r} must be a non-empty list of module names"
            )
        quantization = values.get("base_quantization")
        if quantization not in (None, "nf4"):
            raise ValueError(
                f"model.lora.base_quantization={quantization!r} is not one of nf4 "
                "(or leave it out for the base as read)"
            )
        return cls(
            r=r,
            alpha=alpha,
            dropout=float(dropout),
            target_modules=tuple(targets),
            base_quantization=quantization,
        )

    def peft_kwargs(self) -> dict[str, Any]:
        """``peft.LoraConfig``'s keyword arguments for these options (plain
        values: a rollout engine in another environment builds the same config)."""
        return dict(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
        )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def apply_lora(base: nn.Module, options: LoraOptions) -> nn.Module:
    """``base`` (on any device, meta included) with LoRA adapters, as
    ``peft.get_peft_model`` builds it: adapters trainable, the rest frozen.

    Raises:
        ValueError: a target module matches no layer of ``base`` (naming the
            key, the value and the model's linear layer names).
    """
    from peft import LoraConfig, get_peft_model

    check_targets(base, options.target_modules)
    return get_peft_model(base, LoraConfig(**options.peft_kwargs()))


def check_targets(base: nn.Module, targets: tuple[str, ...]) -> None:
    """Raise ``ValueError`` when a target names no linear layer of ``base``
    (:func:`~ray_fsdp_backend.hf.check.lora_target_errors`)."""
    from ray_fsdp_backend.hf.check import lora_target_errors

    errors = lora_target_errors(base, targets)
    if errors:
        raise ValueError(errors[0])
