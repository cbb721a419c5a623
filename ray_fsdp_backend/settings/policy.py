"""The policy loss's settings of online RL (``train.grpo:`` in YAML), checked; no torch.

Shared by the library (:mod:`ray_fsdp_backend.rl.grpo`), which takes a
:class:`PolicyOptions`, and the trainer's schema, which builds one from the
YAML and checks it before Ray starts (``ray-fsdp validate`` / ``plan``).
The names follow TRL's ``GRPOConfig`` where it has one (``epsilon`` is
``clip_low`` here, ``epsilon_high`` ``clip_high``, ``beta`` ``kl_coef``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ray_fsdp_backend.settings.checks import build_checked

KL_ESTIMATORS = ("k1", "k2", "k3")
NORMALISATIONS = ("token", "sequence", "fixed")


@dataclass(frozen=True)
class PolicyOptions:
    """How the policy is updated on a batch of scored samples (docs/rl.md)."""

    group_size: int = 8
    """Responses sampled per prompt (GRPO's G, TRL's ``num_generations``)."""
    prompts_per_step: int = 4
    """Prompts sampled per step: ``prompts_per_step x group_size`` rows,
    split over the data-parallel ranks."""
    scale_advantages: bool = True
    """Divide each group's advantages by its reward std (False: Dr. GRPO)."""
    clip_low: float = 0.2
    """PPO's clip: the ratio is kept in ``[1 - clip_low, 1 + clip_high]``."""
    clip_high: float | None = None
    """DAPO's clip-higher (None: ``clip_low``)."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference in the loss: the base, as the LoRA
    model with its adapters disabled, or in a full fine-tune a frozen copy
    of the base sharded like the policy (its memory again)."""
    kl_estimator: str = "k3"
    """``k1`` | ``k2`` | ``k3`` (Schulman's estimators; TRL's is k3)."""
    kl_bias_correction: bool = False
    """Weight each token's KL term by its importance ratio (DeepSeek-V3.2's
    unbiased KL gradient when ``updates`` > 1 or the rollout is off-policy;
    TRL's ``use_bias_correction_kl``, whose default is true)."""
    normalisation: str = "token"
    """``token`` (DAPO: the mean over every response token of the step),
    ``sequence`` (GRPO: per response, then over responses), ``fixed``
    (Dr. GRPO: the token sum over responses x ``max_tokens``)."""
    tis_cap: float | None = 2.0
    """Truncated importance sampling of the trainer / rollout mismatch:
    each token weighted by ``min(p_trainer / p_rollout, tis_cap)``; None: off."""
    updates: int = 1
    """Optimizer steps on each rollout batch (PPO epochs; > 1 makes the
    ratio and its clip matter)."""

    @classmethod
    def from_dict(cls, values: Any, section: str = "train.grpo") -> PolicyOptions:
        """Raises ValueError naming ``<section>.<key>``, its value and the rule."""
        if isinstance(values, PolicyOptions):
            return values
        if not isinstance(values, Mapping):
            raise ValueError(f"{section}={values!r} must be a mapping of group_size, ...")
        return build_checked(cls, section, values, _field_problem)


def _field_problem(key: str, value: Any) -> str | None:
    """What is wrong with one field's value (None: nothing)."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    is_number = (is_int or isinstance(value, float)) and math.isfinite(value)
    if key == "group_size" and not (is_int and value >= 2):
        return "must be an int >= 2 (a group of one has no baseline)"
    if key in ("prompts_per_step", "updates") and not (is_int and value >= 1):
        return "must be an int >= 1"
    if key in ("scale_advantages", "kl_bias_correction") and not isinstance(value, bool):
        return "must be true or false"
    if key == "clip_low" and not (is_number and 0 < value < 1):
        return "must be a number in (0, 1)"
    if key == "clip_high" and value is not None and not (is_number and value > 0):
        return "must be a positive number or null"
    if key == "kl_coef" and not (is_number and value >= 0):
        return "must be a number >= 0"
    if key == "kl_estimator" and value not in KL_ESTIMATORS:
        return f"is not one of {', '.join(KL_ESTIMATORS)}"
    if key == "normalisation" and value not in NORMALISATIONS:
        return f"is not one of {', '.join(NORMALISATIONS)}"
    if key == "tis_cap" and value is not None and not (is_number and value >= 1):
        return "must be a number >= 1 or null"
    return None
