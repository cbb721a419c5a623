"""One policy update of online RL on a batch of scored samples, on any layout the context built.

The loop around it (:mod:`ray_fsdp_backend.trainer.loop.grpo` for ``ray-fsdp
train``, or a user's own) samples responses from rollout engines, scores
them, and hands this module the prompts, samples and rewards:

1. :func:`rollout_rows` lays each (prompt, response) out as one row of the
   trainer's micro-batch convention (``input_ids``, shifted ``targets``
   that are -100 except on response tokens, ``position_ids``) with its
   GRPO advantage and the rollout engine's log-probs aligned with the
   targets; :func:`dp_share` gives each data-parallel rank its rows.
2. :func:`policy_update` runs ``ctx.sequence_log_probs`` (the chunked
   head: never the ``[tokens, vocab]`` logits) once without gradient for the
   old policy's log-probs and entropies (the trainer/rollout gap and the
   policy's entropy at the sampling temperature are measured there) and
   the reference's (when there is a KL term: ``reference``, a frozen copy
   of the base, or else the LoRA model with its adapters disabled), then
   one optimizer step per ``updates`` of :func:`~.losses.policy_loss` over
   the micro-batches, divided by the step's global count
   (``ctx.global_count``), so the gradient is the mean the normalisation
   names whatever the layout, clipped with ``ctx.clip_grad_norm``.

The engine contract verl and NeMo-RL take (train a batch with a loss,
log-probs of a batch, stream weights, offload / onload, a reference through
disabled adapters) is this module plus ``ctx.sequence_log_probs``,
``ctx.stream_weights``, ``ctx.offload`` / ``ctx.onload`` (docs/rl.md).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ray_fsdp_backend.compat.peft import is_peft_model, unwrap
from ray_fsdp_backend.context_parallel.sequence import IGNORE_INDEX
from ray_fsdp_backend.distributed.step_guard import step_if_finite
from ray_fsdp_backend.rl.losses import grpo_advantages, loss_count, policy_loss
from ray_fsdp_backend.settings.policy import PolicyOptions


def rollout_rows(
    prompts: list[list[int]],
    samples: list[list[dict]],
    rewards: torch.Tensor,
    seq_len: int,
    options: PolicyOptions,
) -> dict[str, torch.Tensor]:
    """One row per sample, prompt after prompt (``samples[i]`` holds
    ``options.group_size`` samples of ``prompts[i]``; ``rewards`` one per
    sample in that order), ``seq_len`` long: ``input_ids`` (prompt then
    response, then 0s), ``targets`` (the response's tokens at the positions
    that predict them, -100 elsewhere), ``position_ids``, ``rollout_log_probs``
    aligned with ``targets`` (0 elsewhere) and one ``advantages`` per row.

    Raises:
        ValueError: a prompt with a number of samples other than
            ``group_size``, or a prompt and response longer than ``seq_len``.
    """
    rows = []
    for i, (prompt, group) in enumerate(zip(prompts, samples, strict=True)):
        if len(group) != options.group_size:
            raise ValueError(
                f"prompt {i} has {len(group)} samples, not group_size={options.group_size}"
            )
        for sample in group:
            if len(prompt) + len(sample["token_ids"]) > seq_len:
                raise ValueError(
                    f"prompt {i} ({len(prompt)} tokens) and a {len(sample['token_ids'])}-token "
                    f"response exceed seq_len={seq_len}"
                )
            rows.append((prompt, sample))
    # The rows are built on the host, as a data loader's; policy_update moves
    # each micro-batch to the device.
    n = len(rows)
    input_ids = torch.zeros(n, seq_len, dtype=torch.long)  # host: rows
    targets = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.long)  # host: rows
    rollout_log_probs = torch.zeros(n, seq_len)  # host: rows
    for row, (prompt, sample) in enumerate(rows):
        response = sample["token_ids"]
        start, end = len(prompt), len(prompt) + len(response)
        # Position t predicts token t + 1: the response is predicted from the
        # prompt's last token onwards.
        input_ids[row, :end] = torch.tensor(prompt + response)  # host: rows
        targets[row, start - 1 : end - 1] = torch.tensor(response)  # host: rows
        rollout_log_probs[row, start - 1 : end - 1] = torch.tensor(  # host: rows
            sample["log_probs"]
        )
    return {
        "input_ids": input_ids,
        "targets": targets,
        "position_ids": torch.arange(seq_len).expand(n, seq_len).clone(),
        "rollout_log_probs": rollout_log_probs,
        "advantages": grpo_advantages(rewards, options.group_size, scale=options.scale_advantages),
    }


def dp_share(rows: dict[str, torch.Tensor], dp_rank: int, dp_size: int) -> dict:
    """Data-parallel rank ``dp_rank``'s contiguous block of ``rows``.

    Raises:
        ValueError: the rows do not split evenly over ``dp_size`` ranks."""
    n = len(rows["input_ids"])
    if n % dp_size:
        raise ValueError(f"{n} samples do not split over {dp_size} data-parallel ranks")
    per = n // dp_size
    return {k: v[dp_rank * per : (dp_rank + 1) * per] for k, v in rows.items()}


@contextlib.contextmanager
def reference_of(model: nn.Module):
    """While open, ``model`` computes as its reference: a PEFT model with its
    adapters disabled (the frozen base; no second copy).

    Raises:
        ValueError: ``model`` has no adapters (a full fine-tune's reference
            would be a frozen copy: not built for RL yet)."""
    inner = unwrap(model)
    if not is_peft_model(inner):
        raise ValueError(
            "a KL term needs the reference policy: with LoRA it is the base with the "
            "adapters disabled; a full fine-tune passes a frozen copy (policy_update's "
            "reference=)"
        )
    with inner.disable_adapter():
        yield


def policy_update(
    ctx,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: dict[str, torch.Tensor],
    options: PolicyOptions,
    *,
    micro_batch_size: int,
    temperature: float = 1.0,
    max_tokens: int | None = None,
    max_grad_norm: float | None = 1.0,
    chunk_tokens: int | None = None,
    reference: nn.Module | None = None,
) -> dict[str, torch.Tensor]:
    """``options.updates`` optimizer steps of the policy loss on this rank's
    ``rows`` (:func:`dp_share` of :func:`rollout_rows`), in micro-batches of
    ``micro_batch_size``. Collective: every rank calls it with as many rows.
    The KL term's reference (``options.kl_coef``) is ``reference``, a frozen
    model wrapped like ``model`` (a full fine-tune's base), or, None, the
    LoRA ``model`` with its adapters disabled (:func:`reference_of`).
    Returns 0-d device tensors (nothing read on the host): ``loss`` (this
    rank's share of the last update's loss), ``grad_norm``, ``skipped`` (1.0:
    the last update's norm was not finite, its step skipped), ``clip_fraction``,
    ``kl`` (0 without a KL term), ``log_prob_gap`` (the mean absolute
    difference between the trainer's and the rollout engine's log-probs of
    the sampled tokens, before the update) and ``entropy`` (the token mean of
    the policy's entropy at ``temperature`` over the response tokens, before
    the update, from the same chunked pass as the old log-probs)."""
    micro = [
        {k: v[i : i + micro_batch_size].to(ctx.device) for k, v in rows.items()}
        for i in range(0, len(rows["input_ids"]), micro_batch_size)
    ]

    def log_probs(batch, of: nn.Module = model, entropy: bool = False):
        return ctx.sequence_log_probs(
            of, batch, temperature=temperature, chunk_tokens=chunk_tokens, entropy=entropy
        )

    with torch.no_grad():
        for batch in micro:
            batch["mask"] = batch["targets"] != IGNORE_INDEX
            batch["old_log_probs"], batch["entropy"] = log_probs(batch, entropy=True)
            if options.kl_coef and reference is not None:
                batch["ref_log_probs"] = log_probs(batch, reference)
            elif options.kl_coef:
                with reference_of(model):
                    batch["ref_log_probs"] = log_probs(batch)
    gap = sum(
        ((b["old_log_probs"] - b["rollout_log_probs"]).abs() * b["mask"]).sum() for b in micro
    )
    entropy = sum(b["entropy"].sum() for b in micro)  # 0 off the response tokens
    divisor = ctx.global_count(
        sum(loss_count(b["mask"], options.normalisation, max_tokens) for b in micro)
    )
    for _ in range(options.updates):
        total = torch.zeros((), device=ctx.device)
        clipped, kl = torch.zeros((), device=ctx.device), torch.zeros((), device=ctx.device)
        for i, batch in enumerate(micro):
            sync = contextlib.nullcontext() if i == len(micro) - 1 else ctx.no_sync(model)
            with sync:
                out = policy_loss(
                    log_probs(batch),
                    batch["old_log_probs"],
                    batch["advantages"],
                    batch["mask"],
                    clip_low=options.clip_low,
                    clip_high=options.clip_high,
                    ref_log_probs=batch.get("ref_log_probs"),
                    kl_coef=options.kl_coef,
                    kl_estimator=options.kl_estimator,
                    kl_bias_correction=options.kl_bias_correction,
                    rollout_log_probs=batch["rollout_log_probs"],
                    tis_cap=options.tis_cap,
                    normalisation=options.normalisation,
                    max_tokens=max_tokens,
                )
                loss = out.total / divisor
                loss.backward()
            total += loss.detach()
            tokens = batch["mask"].sum()
            clipped += out.clip_fraction * tokens
            kl += out.kl * tokens
        grad_norm = ctx.clip_grad_norm(model, max_grad_norm, optimizer=optimizer)
        skipped = step_if_finite(optimizer, grad_norm)
        optimizer.zero_grad(set_to_none=True)
    tokens = sum(b["mask"].sum() for b in micro)
    clip_fraction, kl, gap, entropy = token_means(torch.stack([clipped, kl, gap, entropy]), tokens)
    return {
        "loss": total,
        "grad_norm": grad_norm,
        "skipped": skipped,
        "clip_fraction": clip_fraction,
        "kl": kl,
        "log_prob_gap": gap,
        "entropy": entropy,
    }


def token_means(sums: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``sums`` (per-token quantities summed over this rank's response
    tokens) as means over every response token of the step, on every rank:
    one all-reduce of the sums and the count (each tp group's appears tp
    times in both, which cancels)."""
    both = torch.cat([sums.float(), tokens.reshape(1).float()])
    if dist.is_initialized():
        dist.all_reduce(both)
    return both[:-1] / both[-1].clamp(min=1.0)
