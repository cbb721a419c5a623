"""Online RL on one Ray cluster: the policy trainer's side of a GRPO / PPO loop.

- :mod:`.losses`: GRPO's advantages, the KL estimators, the clipped policy
  loss with truncated importance sampling, each written once.
- :mod:`.grpo`: rollout samples as the trainer's rows, and one policy update
  on any layout (``ctx.sequence_log_probs``; the reference as disabled adapters).
- :mod:`.prompts`: prompt records checked and rendered (the data door's templates).
- :mod:`.rewards`: ``module:function`` rewards run in Ray tasks.
- :mod:`.rollout_hf`, :mod:`.rollout_vllm`: the rollout engines (Ray actors
  that import nothing of this package); :mod:`.fleet`: sampling across them
  and the weight sync from ``ctx.stream_weights``, through :mod:`.transport`
  (Ray's object store, or a :mod:`.weight_group`: gloo / NCCL).

docs/rl.md has the loop and the engine contract verl / NeMo-RL adapters map to.
"""

from ray_fsdp_backend.compat.optional_imports import lazy_exports

_EXPORTS = {
    "PolicyLoss": "losses",
    "grpo_advantages": "losses",
    "kl_penalty": "losses",
    "loss_count": "losses",
    "policy_loss": "losses",
    "policy_update": "grpo",
    "rollout_rows": "grpo",
    "RolloutFleet": "fleet",
    "sync_weights": "fleet",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)  # prompts and the schema import no torch
