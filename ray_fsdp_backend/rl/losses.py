"""The policy-gradient losses of online RL, each written once, on per-token tensors.

The trainer of a GRPO / PPO / DAPO loop gets, for each sampled response,
its tokens' log-probs under the policy being trained (``log_probs``, with
gradient: ``ctx.sequence_log_probs``), under the policy that sampled them
(``old_log_probs``: recomputed by the trainer before the first update of a
rollout batch, or the rollout engine's own), optionally under the rollout
engine (``rollout_log_probs``: vLLM's, for the trainer/rollout mismatch) and
under a reference (``ref_log_probs``: the base with LoRA adapters disabled,
or a frozen copy), and one advantage per response. All per-token tensors
are ``[responses, tokens]`` with a ``mask`` of the response tokens (padding
and prompt tokens 0): TRL's and verl's layout.

:func:`policy_loss` returns a *sum* and the count it is a mean over, never
the mean itself: under gradient accumulation and data parallelism the mean
must be over the whole optimizer step, so the caller divides the sum of its
micro-batches by the step's global count (one all-reduce, as
``ctx.global_token_count`` does for tokens). ``normalisation`` picks the
mean:

- ``token``: over every response token of the step (DAPO; TRL's ``dapo`` /
  ``bnpo``): long responses weigh by their length.
- ``sequence``: each response's token mean, then the mean over responses
  (the original GRPO; TRL's ``grpo``): a response's tokens share one unit of
  weight, so long responses' tokens weigh less (Dr. GRPO's length bias).
- ``fixed``: the token sum over ``responses x max_tokens`` (Dr. GRPO; TRL's
  ``dr_grpo``): no length bias, a constant divisor.

The formulas are those of the papers and of TRL 1.16's ``GRPOTrainer``
(its loss is a method of the trainer, not a function, so the tests check
these against hand-written references on the same samples).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ray_fsdp_backend.settings.policy import KL_ESTIMATORS, NORMALISATIONS


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """GRPO's group-relative advantages: each response's reward minus the
    mean of its group's (the ``group_size`` responses to one prompt, which
    lie next to each other in ``rewards``), divided by the group's standard
    deviation (unbiased, as ``torch.std``; plus ``eps``) when ``scale``
    (Dr. GRPO drops the division: ``scale=False``).

    Args:
        rewards: ``[groups * group_size]`` rewards, group after group.
        group_size: responses sampled per prompt (GRPO's ``G``, TRL's
            ``num_generations``); 1 gives zero advantages.

    Raises:
        ValueError: ``rewards`` is not 1-D or not a whole number of groups.
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} are not a 1-D whole number of groups "
            f"of group_size={group_size}"
        )
    groups = rewards.float().view(-1, group_size)
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if scale and group_size > 1:
        advantages = advantages / (groups.std(dim=1, keepdim=True) + eps)
    return advantages.flatten()


def kl_penalty(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k3"
) -> torch.Tensor:
    """Per-token estimates of ``KL(policy || reference)`` from samples of
    the policy (Schulman's estimators): ``k1 = log r``, ``k2 = (log r)^2 / 2``,
    ``k3 = exp(-log r) + log r - 1`` with ``log r = log_probs -
    ref_log_probs``. ``k3`` (TRL's and DeepSeekMath's) is unbiased and never
    negative; ``k1`` is unbiased but noisy; ``k2`` is biased, low-variance."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator={estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")
    log_ratio = log_probs - ref_log_probs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.exp(-log_ratio) + log_ratio - 1.0


class PolicyLoss(NamedTuple):
    """One micro-batch's policy loss, as a sum and what it is a mean over."""

    total: torch.Tensor
    """The loss summed as ``normalisation`` says (0-d, with gradient)."""
    count: torch.Tensor
    """What ``total`` is to be divided by for this micro-batch alone
    (:func:`loss_count`). Sum it over the step's micro-batches and ranks for
    the step's mean."""
    clip_fraction: torch.Tensor
    """Share of response tokens whose ratio was clipped (no gradient)."""
    kl: torch.Tensor
    """Token mean of the KL estimate to the reference (0 without one)."""


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    ref_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_bias_correction: bool = False,
    rollout_log_probs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    normalisation: str = "token",
    max_tokens: int | None = None,
) -> PolicyLoss:
    """PPO's clipped surrogate with group (GRPO) or any other advantages.

    Per token: ``-min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)``
    with ``r = exp(log_probs - old_log_probs)``; DAPO's clip-higher is
    ``clip_high > clip_low``. With ``rollout_log_probs`` and ``tis_cap``,
    each token's loss is weighted by the truncated importance ratio
    ``min(exp(old_log_probs - rollout_log_probs), tis_cap)`` (no gradient),
    which corrects for the rollout engine sampling from a slightly different
    distribution than the trainer computes (TRL's ``token_truncate``). With
    ``kl_coef`` > 0 and ``ref_log_probs``, ``kl_coef`` times
    :func:`kl_penalty` is added per token (GRPO's KL in the loss, not the
    reward); ``kl_bias_correction`` weights it by the ratio ``r`` first
    (DeepSeek-V3.2's unbiased reverse-KL gradient off-policy; TRL's
    ``use_bias_correction_kl``, on by default there). The sum is then
    taken as ``normalisation`` says (module docstring).

    Args:
        log_probs: ``[responses, tokens]`` log-probs under the trained policy.
        old_log_probs: the same under the policy that sampled (no gradient);
            equal to ``log_probs.detach()`` on a rollout batch's first update.
        advantages: ``[responses]`` or ``[responses, tokens]``.
        mask: ``[responses, tokens]``, 1 on response tokens.
        max_tokens: the longest response allowed (``fixed`` only).

    Raises:
        ValueError: an unknown ``normalisation`` or ``kl_estimator``,
            ``fixed`` without ``max_tokens``, ``kl_coef`` without
            ``ref_log_probs``, ``tis_cap`` without ``rollout_log_probs``.
    """
    if normalisation not in NORMALISATIONS:
        raise ValueError(
            f"normalisation={normalisation!r} is not one of {', '.join(NORMALISATIONS)}"
        )
    if normalisation == "fixed" and not max_tokens:
        raise ValueError("normalisation='fixed' needs max_tokens (the longest response allowed)")
    if kl_coef and ref_log_probs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_log_probs (the reference's log-probs)")
    if tis_cap is not None and rollout_log_probs is None:
        raise ValueError(f"tis_cap={tis_cap} needs rollout_log_probs (the rollout engine's)")
    mask = mask.to(log_probs.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    high = clip_low if clip_high is None else clip_high
    ratio = torch.exp(log_probs - old_log_probs)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + high)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    if tis_cap is not None:
        per_token = per_token * torch.exp(old_log_probs - rollout_log_probs).clamp(max=tis_cap)
    kl = torch.zeros((), device=log_probs.device)
    tokens = mask.sum()
    if ref_log_probs is not None:
        kl_tokens = kl_penalty(log_probs, ref_log_probs, kl_estimator)
        if kl_coef:
            weighted = kl_tokens * ratio if kl_bias_correction else kl_tokens
            per_token = per_token + kl_coef * weighted
        kl = (kl_tokens.detach() * mask).sum() / tokens.clamp_min(1)
    # The clipped term is the one min() takes: its gradient is zero there.
    was_clipped = (clipped * advantages < ratio * advantages).to(mask.dtype)
    clip_fraction = (was_clipped * mask).sum().detach() / tokens.clamp_min(1)
    masked = per_token * mask
    if normalisation == "sequence":  # each response's token mean
        total = (masked.sum(dim=1) / mask.sum(dim=1).clamp_min(1)).sum()
    else:
        total = masked.sum()
    return PolicyLoss(total, loss_count(mask, normalisation, max_tokens), clip_fraction, kl)


def loss_count(mask: torch.Tensor, normalisation: str, max_tokens: int | None = None):
    """What :func:`policy_loss`'s ``total`` over responses ``mask`` is a mean
    over (fp32, 0-d, no gradient): their tokens (``token``), their number
    (``sequence``) or that times ``max_tokens`` (``fixed``). Known before the
    forward, so the step's global count is one all-reduce ahead of it."""
    if normalisation == "token":
        return mask.sum().to(torch.float32).detach()
    responses = torch.tensor(float(mask.shape[0]), device=mask.device)
    return responses if normalisation == "sequence" else responses * max_tokens
