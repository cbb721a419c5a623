"""Online RL on one Ray cluster: the policy trainer's losses (GRPO, PPO-clip,
the KL to a reference, truncated importance sampling).

:mod:`.losses` holds the objectives, each written once on per-token tensors
(docs/rl.md)."""

from ray_fsdp_backend.rl.losses import (
    KL_ESTIMATORS,
    NORMALISATIONS,
    PolicyLoss,
    grpo_advantages,
    kl_penalty,
    policy_loss,
)

__all__ = [
    "KL_ESTIMATORS",
    "NORMALISATIONS",
    "PolicyLoss",
    "grpo_advantages",
    "kl_penalty",
    "policy_loss",
]
