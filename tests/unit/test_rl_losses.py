"""The RL losses against hand-written references of TRL 1.16 ``GRPOTrainer``'s
code path (its loss is a trainer method, not a function), value and gradient."""

from __future__ import annotations

import pytest
import torch

import ray_fsdp_backend as rfb
from ray_fsdp_backend.rl.losses import grpo_advantages, kl_penalty, policy_loss

B, T, MAX_TOKENS = 6, 9, 12


def samples(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    rollout = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1
    mask = torch.ones(B, T, dtype=torch.float64)
    for row, length in enumerate((9, 4, 7, 1, 9, 2)):  # ragged responses, padding after
        mask[row, length:] = 0
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    return logp, old, ref, rollout, mask, advantages


def trl_reference(logp, old, ref, rollout, mask, adv, *, eps_low, eps_high, beta, cap, loss_type):
    """TRL 1.16 ``GRPOTrainer._compute_loss`` (token-level importance
    sampling), with vLLM's ``token_truncate`` correction when ``cap``."""
    adv = adv.unsqueeze(1)
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if cap is not None:
        per_token_loss = per_token_loss * torch.clamp(torch.exp(old - rollout), max=cap)
    if beta:
        per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    return (per_token_loss * mask).sum() / (per_token_loss.size(0) * MAX_TOKENS)  # dr_grpo


@pytest.mark.parametrize(
    ("normalisation", "trl_type"), [("sequence", "grpo"), ("token", "bnpo"), ("fixed", "dr_grpo")]
)
@pytest.mark.parametrize(
    "options",
    [
        {"clip_low": 0.2, "clip_high": None, "kl_coef": 0.0, "tis_cap": None},
        {"clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.04, "tis_cap": None},  # DAPO's clip
        {"clip_low": 0.1, "clip_high": 0.1, "kl_coef": 0.1, "tis_cap": 1.05},
    ],
    ids=["ppo_clip", "clip_higher_kl", "kl_tis"],
)
def test_policy_loss_equals_trl_value_and_gradient(normalisation, trl_type, options):
    logp, old, ref, rollout, mask, adv = samples()
    out = policy_loss(
        logp, old, adv, mask, ref_log_probs=ref, rollout_log_probs=rollout,
        normalisation=normalisation, max_tokens=MAX_TOKENS, **options,
    )  # fmt: skip
    ours = out.total / out.count
    (grad,) = torch.autograd.grad(ours, logp)
    high = options["clip_high"] or options["clip_low"]
    expected = trl_reference(
        logp, old, ref, rollout, mask, adv, eps_low=options["clip_low"], eps_high=high,
        beta=options["kl_coef"], cap=options["tis_cap"], loss_type=trl_type,
    )  # fmt: skip
    (expected_grad,) = torch.autograd.grad(expected, logp)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)
    assert grad[mask == 0].abs().max() == 0  # padding takes no gradient


def test_sums_over_micro_batches_divided_by_the_step_count_equal_the_whole_batch():
    """Split into micro-batches, sum(total) / sum(count) is the whole batch's
    loss: what the trainer's global-count division relies on."""
    logp, old, ref, rollout, mask, adv = samples(1)
    for normalisation in ("token", "sequence", "fixed"):
        kw = {"ref_log_probs": ref, "kl_coef": 0.05, "normalisation": normalisation}
        whole = policy_loss(logp, old, adv, mask, max_tokens=MAX_TOKENS, **kw)
        parts = [
            policy_loss(
                logp[s],
                old[s],
                adv[s],
                mask[s],
                max_tokens=MAX_TOKENS,
                **{**kw, "ref_log_probs": ref[s]},
            )  # fmt: skip
            for s in (slice(0, 2), slice(2, 5), slice(5, 6))
        ]
        split = sum(p.total for p in parts) / sum(p.count for p in parts)
        torch.testing.assert_close(split, whole.total / whole.count, rtol=1e-12, atol=0)


def test_clip_fraction_counts_the_tokens_whose_gradient_the_clip_removed():
    logp, old, _, _, mask, adv = samples(2)
    out = policy_loss(logp, old, adv, mask, clip_low=0.1)
    (grad,) = torch.autograd.grad(out.total, logp)
    zero_grad_tokens = ((grad == 0) & (mask == 1)).sum()
    assert 0 < out.clip_fraction < 1
    assert out.clip_fraction == pytest.approx(float(zero_grad_tokens / mask.sum()))


def test_first_update_of_a_rollout_batch_is_the_policy_gradient():
    """With old == current (ratio 1) the clipped surrogate's gradient is
    ``-A`` per token: REINFORCE with the group baseline."""
    logp, _, _, _, mask, adv = samples(3)
    out = policy_loss(logp, logp.detach(), adv, mask, normalisation="token")
    (grad,) = torch.autograd.grad(out.total, logp)
    torch.testing.assert_close(grad, -adv.unsqueeze(1) * mask)
    assert out.clip_fraction == 0


def test_grpo_advantages_equal_trl_group_normalisation():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 2.0, -1.0, 0.0, 3.0])
    groups = rewards.view(-1, 4)
    mean = groups.mean(1).repeat_interleave(4)
    std = groups.std(1).repeat_interleave(4)  # TRL's nanstd is unbiased too
    torch.testing.assert_close(grpo_advantages(rewards, 4), (rewards - mean) / (std + 1e-4))
    torch.testing.assert_close(grpo_advantages(rewards, 4, scale=False), rewards - mean)
    assert grpo_advantages(rewards, 4)[4:8].abs().max() == 0  # a group all alike learns nothing
    assert rfb.grpo_advantages is grpo_advantages and rfb.policy_loss is policy_loss


def test_kl_estimators():
    g = torch.Generator().manual_seed(4)
    logp, ref = -torch.rand(50, generator=g) * 2, -torch.rand(50, generator=g) * 2
    log_r = logp - ref
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), log_r)
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), log_r.square() / 2)
    torch.testing.assert_close(
        kl_penalty(logp, ref, "k3"), torch.exp(ref - logp) - (ref - logp) - 1
    )
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    # All three estimate KL(p || q) from samples of p: on a categorical, their
    # expectations under p are the exact KL for k1 and k3.
    p = torch.softmax(torch.randn(10, generator=g), 0)
    q = torch.softmax(torch.randn(10, generator=g), 0)
    exact = (p * (p.log() - q.log())).sum()
    for estimator in ("k1", "k3"):
        expectation = (p * kl_penalty(p.log(), q.log(), estimator)).sum()
        torch.testing.assert_close(expectation, exact)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"normalisation": "mean"}, "normalisation='mean' is not one of token, sequence, fixed"),
        ({"normalisation": "fixed"}, "needs max_tokens"),
        ({"kl_coef": 0.1}, "needs ref_log_probs"),
        ({"tis_cap": 2.0}, "needs rollout_log_probs"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    logp, old, _, _, mask, adv = samples()
    with pytest.raises(ValueError, match=message):
        policy_loss(logp, old, adv, mask, **kwargs)


def test_bad_groups_are_named():
    with pytest.raises(ValueError, match="whole number of groups of group_size=4"):
        grpo_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="estimator='k4' is not one of k1, k2, k3"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")
