"""``train.objective`` and ``train.dpo:``: what the trainer optimises.

Next to the rest of the ``train:`` section::

    train:
      objective: dpo                  # sft (default) | dpo | reward
      dpo:
        loss_type: sigmoid            # sigmoid | ipo | hinge | robust | simpo | orpo
        beta: 0.1
        label_smoothing: 0.0          # robust and simpo only
        simpo_gamma: 0.5              # simpo's target margin
        reference: adapters           # adapters | precompute | frozen

``dpo`` and ``reward`` train on ``data.format: preference`` pairs
(docs/preference.md); the names and formulas are TRL's. The reference
model of DPO: ``adapters`` is the LoRA model with its adapters disabled (no
second copy), ``frozen`` a second sharded copy of the base never stepped,
``precompute`` one forward pass over the pairs before the first step, its
log-probs kept per pair and in the checkpoint. ``simpo`` and ``orpo`` need no
reference. Every check here names the field, the value and the rule, and
runs in ``validate`` / ``plan`` before Ray starts. Nothing here imports torch.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ray_fsdp_backend.settings.checks import build_checked

OBJECTIVES = ("sft", "dpo", "reward", "grpo")
PREFERENCE_OBJECTIVES = ("dpo", "reward")
PREFERENCE_FORMAT = "preference"
"""``data.format`` of ``{prompt, chosen, rejected}`` records (``rfb.preference_dataset``)."""
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")
"""Loss types that compare the policy's two answers only: no reference model."""
SMOOTHED = ("robust", "simpo")
"""Loss types that take ``label_smoothing``."""


class Reference(enum.Enum):
    """Where DPO's reference log-probs come from."""

    ADAPTERS = "adapters"
    """The policy's own sharded LoRA model with its adapters disabled."""
    PRECOMPUTE = "precompute"
    """One forward pass before the first step, stored per pair."""
    FROZEN = "frozen"
    """A second sharded copy of the base, never stepped."""


REFERENCES = tuple(r.value for r in Reference)


@dataclass(frozen=True)
class DPOOptions:
    """The ``train.dpo:`` section (TRL's ``DPOConfig`` names)."""

    loss_type: str = "sigmoid"
    """``sigmoid`` (DPO), ``ipo``, ``hinge``, ``robust`` (label smoothing),
    and the reference-free ``simpo`` and ``orpo`` (docs/preference.md)."""
    beta: float = 0.1
    """The temperature of the implicit reward ``beta * (log pi - log pi_ref)``
    (ORPO: the weight of its odds-ratio term; SimPO: of the length-normalised
    log-prob)."""
    label_smoothing: float = 0.0
    """The assumed fraction of flipped labels, ``0 <= eps < 0.5``; ``robust``
    and ``simpo`` only."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin."""
    reference: str | None = None
    """``adapters`` | ``precompute`` | ``frozen``; None: ``adapters`` with
    ``model.lora``, else ``precompute``. Ignored by (and refused with)
    ``simpo`` / ``orpo``."""

    @property
    def reference_free(self) -> bool:
        return self.loss_type in REFERENCE_FREE

    def resolve_reference(self, lora: bool) -> Reference | None:
        """The reference to build: None for a reference-free loss."""
        if self.reference_free:
            return None
        if self.reference is None:
            return Reference.ADAPTERS if lora else Reference.PRECOMPUTE
        return Reference(self.reference)

    @classmethod
    def from_dict(cls, values: Any) -> DPOOptions:
        """Raises ValueError naming ``dpo.<key>``, its value and the rule."""
        if isinstance(values, DPOOptions):
            return values
        if not isinstance(values, Mapping):
            raise ValueError(f"dpo={values!r} must be a mapping of loss_type, beta, ...")
        options = build_checked(cls, "train.dpo", values, _dpo_field_problem)
        if options.label_smoothing and options.loss_type not in SMOOTHED:
            raise ValueError(
                f"dpo.label_smoothing={options.label_smoothing} with dpo.loss_type="
                f"{options.loss_type!r}: only {' and '.join(SMOOTHED)} smooth their labels"
            )
        if options.reference_free and options.reference is not None:
            raise ValueError(
                f"dpo.reference={options.reference!r} with dpo.loss_type={options.loss_type!r}: "
                f"{', '.join(REFERENCE_FREE)} use no reference model; remove dpo.reference"
            )
        return options


def _dpo_field_problem(key: str, value: Any) -> str | None:
    """What is wrong with one ``train.dpo`` field's value (None: nothing)."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if key == "loss_type" and value not in DPO_LOSS_TYPES:
        return f"is not one of {', '.join(DPO_LOSS_TYPES)}"
    if key == "reference" and value is not None and value not in REFERENCES:
        return f"is not one of {', '.join(REFERENCES)} or null"
    if key in ("beta", "simpo_gamma") and not (is_number and math.isfinite(value)):
        return "must be a number"
    if key == "beta" and value <= 0:
        return "must be positive"
    if key == "simpo_gamma" and value < 0:
        return "must be a non-negative number"
    if key == "label_smoothing" and not (is_number and 0 <= value < 0.5):
        return "must be a number in [0, 0.5)"
    return None


def preference_errors(train, data, model, dist) -> list[str]:
    """``train.objective`` against the data, the model and the layout."""
    if train is None:
        return []
    objective, errors = train.objective, []
    preference = objective in PREFERENCE_OBJECTIVES
    if data is not None and preference != (data.format == PREFERENCE_FORMAT):
        if preference:
            errors.append(
                f"train.objective={objective!r} needs data.format={PREFERENCE_FORMAT!r} "
                f"(records of prompt, chosen, rejected), got data.format={data.format!r}"
            )
        else:
            errors.append(
                f"data.format={data.format!r} with train.objective={objective!r}: preference "
                "pairs train a preference objective; set train.objective to dpo or reward"
            )
    if preference and dist is not None and dist.pipeline_parallel_size > 1:
        errors.append(
            f"train.objective={objective!r} with distributed.pipeline_parallel_size="
            f"{dist.pipeline_parallel_size}: not supported, since a pair's chosen and rejected "
            "documents must share one micro-batch and the per-pair loss is not a sum over "
            "tokens each pipeline stage could add up; use FSDP / tp / cp instead"
        )
    lora = getattr(model, "lora", None) is not None
    if objective == "dpo" and train.dpo.reference == Reference.ADAPTERS.value and not lora:
        errors.append(
            "train.dpo.reference='adapters' needs model.lora: the reference is the LoRA model "
            "with its adapters disabled; full fine-tuning uses precompute or frozen"
        )
    if objective == "reward":
        errors += reward_errors(model, dist)
    return errors


def reward_errors(model, dist) -> list[str]:
    """What ``train.objective: reward`` (a scalar head on the decoder) needs."""
    if model is not None and not hasattr(model, "pretrained"):
        return [
            "train.objective='reward' needs model.pretrained: the reward model is a "
            "pretrained decoder with a scalar head (AutoModelForSequenceClassification)"
        ]
    errors = []
    if dist is not None and dist.tensor_parallel_size > 1:
        errors.append(
            f"train.objective='reward' with distributed.tensor_parallel_size="
            f"{dist.tensor_parallel_size}: not supported (the scalar head has no tp plan); "
            "use FSDP / HSDP / cp"
        )
    if getattr(model, "export_format", "hf") == "peft":
        errors.append(
            "train.objective='reward' with model.export_format='peft': the score head "
            "trains whole, not as an adapter, and a PEFT adapter directory would lose it; "
            "use export_format: hf (adapters merged, score.weight beside them)"
        )
    return errors
