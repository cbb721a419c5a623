"""``rfb.policy_loss`` on our log-probs equals TRL 1.16's own
``GRPOTrainer._compute_loss`` on the same model and samples, value and
gradients of every parameter, fp32.

TRL's side is the trainer's method itself (not a transcription: that is
``tests/unit/test_rl_losses.py``, in fp64): its forward over prompt +
completion ids at the sampling temperature, its importance ratios against
the given old log-probs, its clip, its k3 KL to the given reference
log-probs (plain, and weighted by the ratio: its ``use_bias_correction_kl``,
on by default in TRL 1.16) and its loss types. Our side is the fused head
(``rfb.linear_token_log_probs`` over chunks, never the whole logits) and
:func:`rfb.policy_loss` with the matching normalisation: ``grpo`` is our
``sequence``, ``bnpo`` our ``token``, ``dr_grpo`` our ``fixed``. The old
log-probs differ from the current ones so that some tokens are clipped
(checked), and completions are ragged (padding masked)."""

from __future__ import annotations

import copy

import pytest
import torch

import ray_fsdp_backend as rfb
from ray_fsdp_backend.ops.head import head_hidden_states, resolve_loss_head

trl = pytest.importorskip("trl", reason="TRL (the test extra) is the losses' reference")
transformers = pytest.importorskip("transformers")

PROMPT, COMPLETION, ROWS = 5, 6, 4
LENGTHS = (6, 3, 5, 1)  # completion tokens per row, padding after
TEMPERATURE, BETA, CLIP_LOW, CLIP_HIGH = 0.7, 0.04, 0.2, 0.28
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained

    path = save_tiny_pretrained("llama", tmp_path_factory.mktemp("tiny"), chat=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(3, vocab, (ROWS, PROMPT), generator=gen)
    completion_ids = torch.randint(3, vocab, (ROWS, COMPLETION), generator=gen)
    mask = torch.zeros(ROWS, COMPLETION, dtype=torch.long)
    for row, length in enumerate(LENGTHS):
        mask[row, :length] = 1
    with torch.no_grad():
        current = _our_log_probs(model, prompt_ids, completion_ids, mask)
    samples = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": mask,
        "advantages": torch.randn(ROWS, generator=gen),
        # The sampling policy a little off the current one: ratios away from 1.
        "old_per_token_logps": current + torch.randn(current.shape, generator=gen) * 0.3,
        "ref_per_token_logps": current + torch.randn(current.shape, generator=gen) * 0.2,
    }
    return path, model, samples


def _our_log_probs(model, prompt_ids, completion_ids, mask):
    """Each completion token's log-prob at the sampling temperature, from the
    fused head over the whole row (prompt targets ignored), ``[rows, completion]``."""
    inputs = torch.cat([prompt_ids, completion_ids], dim=1)
    targets = torch.full_like(inputs, -100)
    # Position t predicts token t + 1: the completion's tokens are the targets
    # of the positions one before them.
    targets[:, PROMPT - 1 : -1] = torch.where(mask == 1, completion_ids, -100)
    head = resolve_loss_head(model)
    hidden, _ = head_hidden_states(model, head, inputs, use_cache=False)
    log_probs = rfb.linear_token_log_probs(
        hidden, head.module.weight, targets, chunk_size=7, temperature=TEMPERATURE
    )
    return log_probs[:, PROMPT - 1 : -1]


def _trl_loss(path, model, samples, loss_type: str, bias_correction: bool):
    from datasets import Dataset

    args = trl.GRPOConfig(
        output_dir=str(path) + "-trl",
        per_device_train_batch_size=ROWS,
        num_generations=2,
        beta=BETA,
        epsilon=CLIP_LOW,
        epsilon_high=CLIP_HIGH,
        loss_type=loss_type,
        use_bias_correction_kl=bias_correction,
        temperature=TEMPERATURE,
        max_completion_length=COMPLETION,
        use_cpu=True,
        bf16=False,
        report_to=[],
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "hi"}] * ROWS),
        processing_class=transformers.AutoTokenizer.from_pretrained(path),
    )
    trainer.current_gradient_accumulation_steps = 1  # set by its training_step
    model.train()
    return trainer._compute_loss(model, dict(samples))


@pytest.mark.parametrize("bias_correction", [False, True], ids=["kl", "kl_times_ratio"])
@pytest.mark.parametrize(
    ("trl_type", "normalisation"), [("grpo", "sequence"), ("bnpo", "token"), ("dr_grpo", "fixed")]
)
def test_policy_loss_equals_trl_grpo_trainer(tiny, trl_type, normalisation, bias_correction):
    path, model, samples = tiny
    theirs_model, ours_model = copy.deepcopy(model), copy.deepcopy(model)
    theirs = _trl_loss(path, theirs_model, samples, trl_type, bias_correction)
    theirs.backward()

    mask = samples["completion_mask"]
    log_probs = _our_log_probs(ours_model, samples["prompt_ids"], samples["completion_ids"], mask)
    out = rfb.policy_loss(
        log_probs,
        samples["old_per_token_logps"],
        samples["advantages"],
        mask,
        clip_low=CLIP_LOW,
        clip_high=CLIP_HIGH,
        ref_log_probs=samples["ref_per_token_logps"],
        kl_coef=BETA,
        kl_estimator="k3",
        kl_bias_correction=bias_correction,
        normalisation=normalisation,
        max_tokens=COMPLETION,
    )
    ours = out.total / out.count
    ours.backward()

    assert 0 < out.clip_fraction < 1  # the clip is exercised
    torch.testing.assert_close(ours.detach(), theirs.detach(), **TOL)
    grads = dict(theirs_model.named_parameters())
    for name, param in ours_model.named_parameters():
        assert param.grad is not None and param.grad.abs().max() > 0, name
        torch.testing.assert_close(param.grad, grads[name].grad, **TOL, msg=name)
