"""Preference losses as functions of per-sequence log-prob sums.

Each loss is written once, on ``[pairs]`` tensors: the summed log-probs of
each pair's chosen and rejected response under the policy (and the
reference), and, where a loss normalises by length, each response's token
count. Nothing here looks at logits or batches, so the same functions serve
the trainer, a user's loop and the tests (:func:`pair_log_probs
<ray_fsdp_backend.preference.log_probs.pair_log_probs>` makes the sums).

The formulas and parameter names are TRL 1.16's: ``DPOTrainer`` (sigmoid,
ipo, hinge, robust), ``CPOTrainer``'s SimPO, ``ORPOTrainer``'s odds ratio and
``RewardTrainer``'s Bradley-Terry loss. The losses come back per pair, not
reduced: divide their sum by the step's pair count (every rank's, as
``ctx.global_token_count`` does for tokens).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo")
"""The ``loss_type`` values of :func:`dpo_loss`."""

REFERENCE_FREE = ("simpo", "orpo")
"""Loss types that take no reference log-probs."""

LENGTH_NORMALISED = ("ipo", "simpo", "orpo")
"""Loss types that need ``chosen_lengths`` and ``rejected_lengths``."""


class PreferenceLoss(NamedTuple):
    """Per-pair losses and the rewards users watch (``rewards/chosen``, ...)."""

    losses: torch.Tensor
    """``[pairs]`` fp32, differentiable; the step's loss is their sum over
    the step's pair count."""
    chosen_rewards: torch.Tensor
    """``[pairs]``, detached: the implicit (DPO) or scored (reward model)
    reward of each chosen response."""
    rejected_rewards: torch.Tensor
    """``[pairs]``, detached: the same for each rejected response."""


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None,
    ref_rejected: torch.Tensor | None,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    simpo_gamma: float = 0.5,
    chosen_nll: torch.Tensor | None = None,
) -> PreferenceLoss:
    """The per-pair loss of the DPO family from per-sequence log-prob sums.

    With the log-ratios ``c = policy_chosen - ref_chosen`` and
    ``r = policy_rejected - ref_rejected`` (TRL's ``DPOTrainer``):

    - ``sigmoid`` (DPO): ``-logsigmoid(beta * (c - r))``.
    - ``hinge`` (SLiC): ``relu(1 - beta * (c - r))``.
    - ``ipo``: ``(c / chosen_lengths - r / rejected_lengths - 1 / (2 beta))^2``
      (TRL normalises IPO's log-ratios by each response's token count).
    - ``robust`` (rDPO): ``(-(1 - ls) logsigmoid(beta d) + ls logsigmoid(-beta d))
      / (1 - 2 ls)`` with ``d = c - r`` and ``ls = label_smoothing``.

    The rewards of these are ``beta * c`` and ``beta * r``. Reference-free,
    on the mean log-probs ``pc = policy_chosen / chosen_lengths`` and
    ``pr = policy_rejected / rejected_lengths`` (rewards ``beta * pc``,
    ``beta * pr``):

    - ``simpo`` (TRL's ``CPOTrainer``, ``cpo_alpha=0``): with
      ``x = beta * (pc - pr - simpo_gamma / beta)``,
      ``-(1 - ls) logsigmoid(x) - ls logsigmoid(-x)``.
    - ``orpo`` (TRL's ``ORPOTrainer``): ``chosen_nll - beta *
      logsigmoid(log_odds)`` with ``log_odds = (pc - pr) - (log(1 - e^pc) -
      log(1 - e^pr))``; ``chosen_nll`` defaults to ``-pc`` (the chosen
      response's mean NLL; TRL's is the token mean over the chosen's prompt
      and response tokens of the whole batch: pass it to match).

    Args:
        policy_chosen, policy_rejected: ``[pairs]`` summed log-probs of each
            pair's responses under the policy (differentiable).
        ref_chosen, ref_rejected: the same under the reference model (no
            gradient flows through them); None for ``simpo`` and ``orpo``.
        loss_type: one of :data:`LOSS_TYPES`.
        beta: the loss's temperature (IPO's tau, ORPO's lambda).
        label_smoothing: the assumed rate of flipped labels for ``robust``
            and ``simpo`` (below 0.5); must be 0 for the other types.
        chosen_lengths, rejected_lengths: ``[pairs]`` response token counts
            (the targets summed), needed by ``ipo``, ``simpo`` and ``orpo``.
        simpo_gamma: SimPO's target reward margin.
        chosen_nll: ORPO's NLL term per pair (see above).

    Returns:
        :class:`PreferenceLoss` with ``[pairs]`` losses and detached rewards.

    Raises:
        ValueError: an unknown ``loss_type``, a ``beta`` not above 0, a
            ``label_smoothing`` outside ``[0, 0.5)`` or given to a type that
            ignores it, missing reference log-probs or lengths, or tensors of
            different shapes.
    """
    _check_dpo_arguments(loss_type, beta, label_smoothing)
    if loss_type in LENGTH_NORMALISED and (chosen_lengths is None or rejected_lengths is None):
        raise ValueError(f"loss_type={loss_type!r} needs chosen_lengths and rejected_lengths")
    if loss_type in REFERENCE_FREE:
        return _reference_free_loss(
            policy_chosen / chosen_lengths.clamp_min(1),
            policy_rejected / rejected_lengths.clamp_min(1),
            loss_type=loss_type,
            beta=beta,
            label_smoothing=label_smoothing,
            simpo_gamma=simpo_gamma,
            chosen_nll=chosen_nll,
        )
    if ref_chosen is None or ref_rejected is None:
        raise ValueError(f"loss_type={loss_type!r} needs ref_chosen and ref_rejected log-probs")
    _check_shapes(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    chosen = policy_chosen - ref_chosen.detach()
    rejected = policy_rejected - ref_rejected.detach()
    if loss_type == "ipo":
        delta = chosen / chosen_lengths.clamp_min(1) - rejected / rejected_lengths.clamp_min(1)
        losses = (delta - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * (chosen - rejected))
    else:  # sigmoid is robust with no smoothing
        losses = _smoothed_sigmoid(beta * (chosen - rejected), label_smoothing, robust=True)
    return PreferenceLoss(losses, beta * chosen.detach(), beta * rejected.detach())


def _reference_free_loss(
    chosen, rejected, *, loss_type, beta, label_smoothing, simpo_gamma, chosen_nll
) -> PreferenceLoss:
    """SimPO and ORPO on mean log-probs ``chosen`` and ``rejected``."""
    _check_shapes(chosen, rejected)
    if loss_type == "simpo":
        logits = beta * (chosen - rejected - simpo_gamma / beta)
        losses = _smoothed_sigmoid(logits, label_smoothing, robust=False)
    else:
        log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
        nll = -chosen if chosen_nll is None else chosen_nll
        losses = nll - beta * F.logsigmoid(log_odds)
    return PreferenceLoss(losses, beta * chosen.detach(), beta * rejected.detach())


def _smoothed_sigmoid(logits: torch.Tensor, smoothing: float, *, robust: bool) -> torch.Tensor:
    """``-(1 - s) logsigmoid(x) -/+ s logsigmoid(-x)``: conservative (cDPO,
    SimPO: minus) or robust (rDPO: plus, over ``1 - 2 s``)."""
    clean = -(1 - smoothing) * F.logsigmoid(logits)
    if smoothing == 0:
        return clean
    flipped = smoothing * F.logsigmoid(-logits)
    if robust:
        return (clean + flipped) / (1 - 2 * smoothing)
    return clean - flipped


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable on both sides of ``-log 2``."""
    return torch.where(
        x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x))
    )


def _check_dpo_arguments(loss_type: str, beta: float, label_smoothing: float) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    if isinstance(beta, bool) or not float(beta) > 0:
        raise ValueError(f"beta={beta!r} must be a number above 0")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing={label_smoothing!r} must lie in [0, 0.5)")
    if label_smoothing and loss_type not in ("robust", "simpo"):
        raise ValueError(
            f"label_smoothing={label_smoothing!r} with loss_type={loss_type!r}: only robust "
            "and simpo take label smoothing (TRL 1.16's sigmoid, ipo, hinge and orpo ignore it)"
        )


def _check_shapes(*tensors: torch.Tensor) -> None:
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) > 1:
        raise ValueError(f"per-pair tensors of different shapes {sorted(shapes)}: one value a pair")


def reward_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    *,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> PreferenceLoss:
    """The Bradley-Terry loss of a reward model, per pair (TRL's
    ``RewardTrainer``): ``-logsigmoid(chosen - rejected - margin)``, plus
    ``center_rewards_coefficient * (chosen + rejected)^2`` when given (its
    mean over pairs is TRL's ``mean((chosen + rejected)^2)`` term, which
    keeps the scores centred on 0).

    Args:
        chosen_scores, rejected_scores: ``[pairs]`` scalar scores of each
            pair's responses (differentiable).
        margin: ``[pairs]`` how far the chosen should score above the
            rejected (TRL's ``margin`` column); None: 0.
        center_rewards_coefficient: weight of the centring term; None: off.

    Returns:
        :class:`PreferenceLoss`; the rewards are the detached scores.

    Raises:
        ValueError: tensors of different shapes.
    """
    _check_shapes(chosen_scores, rejected_scores, *(() if margin is None else (margin,)))
    difference = chosen_scores - rejected_scores
    losses = -F.logsigmoid(difference if margin is None else difference - margin)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen_scores + rejected_scores) ** 2
    return PreferenceLoss(losses, chosen_scores.detach(), rejected_scores.detach())
