"""``rfb.dpo_loss`` and ``rfb.reward_loss`` against the published formulas
and against TRL 1.16 on the same model and pairs, value and gradients, fp32.

Three pairs of a tiny transformers Llama, tokenised by TRL's ``DPOTrainer``.
Our side packs the six sequences into one row (``sequence_ids`` 0..5, a
padding tail) and takes the log-probs from the fused head
(``linear_token_log_probs`` over chunks of 5 tokens) and ``sum_pairs``; the
reference side runs each sequence alone through the model's whole logits
(``F.log_softmax``) and a hand-written formula; TRL's side is
``DPOTrainer.compute_loss`` (sigmoid, ipo, hinge, robust: the same model's
gradients), ``CPOTrainer.cpo_loss`` (SimPO) and
``ORPOTrainer.odds_ratio_loss`` (ORPO's odds-ratio term: the gradient with
respect to the per-pair log-probs), and ``RewardTrainer.compute_loss`` (a
scalar-head model, with a margin and centring). All within 1e-5.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import ray_fsdp_backend as rfb
from ray_fsdp_backend.context_parallel.sequence import shift_labels
from ray_fsdp_backend.ops.head import head_hidden_states, resolve_loss_head
from ray_fsdp_backend.preference.log_probs import sum_pairs

trl = pytest.importorskip("trl", reason="TRL (the test extra) is the losses' reference")
transformers = pytest.importorskip("transformers")

PAIRS = [
    {"prompt": "the cat", "chosen": " sat on the mat", "rejected": " ran"},
    {"prompt": "a dog is", "chosen": " happy", "rejected": " not a cat at all"},
    {"prompt": "one two", "chosen": " three four", "rejected": " five"},
]
BETA, SMOOTHING, GAMMA = 0.3, 0.1, 0.4
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny chat Llama's path, its policy and a reference whose weights
    differ (so the log-ratios are not all 0)."""
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained

    path = save_tiny_pretrained("llama", tmp_path_factory.mktemp("tiny"), chat=True)
    policy = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for param in reference.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    return SimpleNamespace(path=path, policy=policy, reference=reference)


def _trl_dpo(tiny, loss_type: str):
    """TRL's loss and gradients, and the collated batch it computed them on."""
    from datasets import Dataset

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny.path)
    args = trl.DPOConfig(
        output_dir=str(tiny.path) + "-trl",
        beta=BETA,
        loss_type=[loss_type],
        label_smoothing=SMOOTHING if loss_type == "robust" else 0.0,
        report_to=[],
        use_cpu=True,
        bf16=False,  # TrainingArguments' default on this machine: a bf16 reference forward
        per_device_train_batch_size=len(PAIRS),
    )
    model = copy.deepcopy(tiny.policy)
    trainer = trl.DPOTrainer(
        model,
        ref_model=copy.deepcopy(tiny.reference),
        args=args,
        train_dataset=Dataset.from_list(PAIRS),
        processing_class=tokenizer,
    )
    batch = next(iter(trainer.get_train_dataloader()))
    model.train()
    loss = trainer.compute_loss(model, dict(batch))
    loss.backward()
    return loss.detach(), _grads(model), batch


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _sequences(batch):
    """TRL's batch (chosen rows, then rejected rows) as 1-D (tokens, labels)
    per sequence in pair order: chosen 0, rejected 0, chosen 1, ..."""
    half = batch["input_ids"].shape[0] // 2
    out = []
    for pair in range(half):
        for row in (pair, half + pair):
            n = int(batch["attention_mask"][row].sum())
            tokens = batch["input_ids"][row, :n]
            labels = torch.where(batch["completion_mask"][row, :n] == 1, tokens, -100)
            out.append((tokens, labels))
    return out


def _packed(batch, padding: int = 3):
    """One packed row of every sequence, ``sequence_ids`` 0..5, then padding."""
    seqs = _sequences(batch)
    tokens = torch.cat([t for t, _ in seqs] + [torch.zeros(padding, dtype=torch.long)])
    labels = torch.cat([lab for _, lab in seqs] + [torch.full((padding,), -100)])
    positions = torch.cat([torch.arange(len(t)) for t, _ in seqs] + [torch.arange(padding)])
    ids = torch.cat([torch.full((len(t),), i) for i, (t, _) in enumerate(seqs)])
    ids = torch.cat([ids, torch.full((padding,), -1)])
    position_ids = positions[None]
    return tokens[None], shift_labels(labels[None], position_ids), position_ids, ids[None]


def _fused_pair_sums(model, batch):
    """Our path: the packed row through the fused head and ``sum_pairs``."""
    inputs, targets, position_ids, ids = _packed(batch)
    head = resolve_loss_head(model)
    hidden, _ = head_hidden_states(model, head, inputs, position_ids=position_ids, use_cache=False)
    log_probs = rfb.linear_token_log_probs(hidden, head.module.weight, targets, chunk_size=5)
    return sum_pairs(log_probs, targets, ids)


def _full_logits_pair_sums(model, batch):
    """The reference path: each sequence alone, ``F.log_softmax`` of its whole logits."""
    sums, counts = [], []
    for tokens, labels in _sequences(batch):
        logits = model(tokens[None], use_cache=False).logits[0].float()
        targets = shift_labels(labels[None])[0]
        valid = targets != -100
        picked = F.log_softmax(logits, -1).gather(-1, targets.clamp_min(0)[:, None])[:, 0]
        sums.append(picked[valid].sum())
        counts.append(valid.sum().float())
    sums, counts = torch.stack(sums), torch.stack(counts)
    return sums[0::2], sums[1::2], counts[0::2], counts[1::2]


def _published(loss_type, c, r, ref_c, ref_r, len_c, len_r):
    """The formulas as the papers (and TRL) write them, one pair at a time."""
    d = (c - ref_c) - (r - ref_r)
    pc, pr = c / len_c, r / len_r
    if loss_type == "sigmoid":
        return -F.logsigmoid(BETA * d)
    if loss_type == "hinge":
        return torch.relu(1 - BETA * d)
    if loss_type == "ipo":
        return ((c - ref_c) / len_c - (r - ref_r) / len_r - 1 / (2 * BETA)) ** 2
    if loss_type == "robust":
        e = SMOOTHING
        return (-(1 - e) * F.logsigmoid(BETA * d) + e * F.logsigmoid(-BETA * d)) / (1 - 2 * e)
    if loss_type == "simpo":
        x = BETA * (pc - pr) - GAMMA
        return -(1 - SMOOTHING) * F.logsigmoid(x) - SMOOTHING * F.logsigmoid(-x)
    log_odds = (pc - pr) - (torch.log(1 - torch.exp(pc)) - torch.log(1 - torch.exp(pr)))
    return -pc - BETA * F.logsigmoid(log_odds)  # orpo


def _ours(loss_type, policy, reference, **kw):
    """``rfb.dpo_loss`` on our sums; its mean over the pairs."""
    smoothing = SMOOTHING if loss_type in ("robust", "simpo") else 0.0
    ref = (None, None) if loss_type in ("simpo", "orpo") else (reference.chosen, reference.rejected)
    out = rfb.dpo_loss(
        policy.chosen,
        policy.rejected,
        *ref,
        loss_type=loss_type,
        beta=BETA,
        label_smoothing=smoothing,
        chosen_lengths=policy.chosen_tokens,
        rejected_lengths=policy.rejected_tokens,
        simpo_gamma=GAMMA,
        **kw,
    )
    return out


def _our_loss_and_grads(tiny, batch, loss_type):
    model = copy.deepcopy(tiny.policy)
    policy = _fused_pair_sums(model, batch)
    with torch.no_grad():
        reference = _fused_pair_sums(tiny.reference, batch)
    out = _ours(loss_type, policy, reference)
    loss = out.losses.mean()
    loss.backward()
    return loss.detach(), _grads(model), out


def _assert_grads_close(got: dict, want: dict, what: str):
    assert got.keys() == want.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=f"{what}: {name}")


@pytest.fixture(scope="module")
def trl_batch(tiny):
    return _trl_dpo(tiny, "sigmoid")[2]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust", "simpo", "orpo"])
def test_each_loss_equals_the_published_formula_on_full_logits(tiny, trl_batch, loss_type):
    got_loss, got_grads, got = _our_loss_and_grads(tiny, trl_batch, loss_type)
    model = copy.deepcopy(tiny.policy)
    c, r, len_c, len_r = _full_logits_pair_sums(model, trl_batch)
    with torch.no_grad():
        ref_c, ref_r, _, _ = _full_logits_pair_sums(tiny.reference, trl_batch)
    want = _published(loss_type, c, r, ref_c, ref_r, len_c, len_r).mean()
    want.backward()
    torch.testing.assert_close(got_loss, want.detach(), **TOL)
    _assert_grads_close(got_grads, _grads(model), loss_type)
    # The rewards: beta x the log-ratio (DPO), beta x the mean log-prob (reference-free).
    if loss_type in ("simpo", "orpo"):
        rewards = (BETA * c / len_c, BETA * r / len_r)
    else:
        rewards = (BETA * (c - ref_c), BETA * (r - ref_r))
    torch.testing.assert_close(got.chosen_rewards, rewards[0].detach(), **TOL)
    torch.testing.assert_close(got.rejected_rewards, rewards[1].detach(), **TOL)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust"])
def test_dpo_losses_equal_trl_dpo_trainer(tiny, loss_type):
    """TRL's ``DPOTrainer.compute_loss`` on the same model and pairs: the
    same loss (TRL's mean over the pairs) and the same model gradients."""
    trl_loss, trl_grads, batch = _trl_dpo(tiny, loss_type)
    got_loss, got_grads, _ = _our_loss_and_grads(tiny, batch, loss_type)
    torch.testing.assert_close(got_loss, trl_loss, **TOL)
    _assert_grads_close(got_grads, trl_grads, loss_type)


def _leaf_pairs(seed=0):
    """Per-pair log-prob sums (leaves) and lengths for the reference-free losses."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([3.0, 7.0, 5.0, 1.0])
    chosen = (-torch.rand(4, generator=gen) * 2 - 0.05) * lengths
    rejected = (-torch.rand(4, generator=gen) * 2 - 0.05) * lengths.flip(0)
    return (
        SimpleNamespace(
            chosen=chosen.requires_grad_(),
            rejected=rejected.requires_grad_(),
            chosen_tokens=lengths,
            rejected_tokens=lengths.flip(0),
        ),
        lengths,
    )


def _trl_self(loss_type):
    """The attributes TRL's loss methods read from their trainer."""
    return SimpleNamespace(
        alpha=0.0,
        loss_type=loss_type,
        beta=BETA,
        label_smoothing=SMOOTHING,
        simpo_gamma=GAMMA,
        accelerator=SimpleNamespace(device=torch.device("cpu")),
    )


def test_simpo_equals_trl_cpo_loss():
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    pairs, _ = _leaf_pairs()
    ours = _ours("simpo", pairs, None)
    mean_c, mean_r = pairs.chosen / pairs.chosen_tokens, pairs.rejected / pairs.rejected_tokens
    theirs = CPOTrainer.cpo_loss(_trl_self("simpo"), mean_c, mean_r)
    for got, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got, want, **TOL)
    got_grads = torch.autograd.grad(ours.losses.sum(), (pairs.chosen, pairs.rejected))
    want_grads = torch.autograd.grad(theirs[0].sum(), (pairs.chosen, pairs.rejected))
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_orpo_odds_ratio_equals_trl_orpo():
    """ORPO's odds-ratio term is TRL's (``odds_ratio_loss``, ``losses`` =
    ``beta * logsigmoid(log_odds)``, subtracted from the NLL), and with TRL's
    NLL passed the per-pair losses average to TRL's loss."""
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    pairs, _ = _leaf_pairs(1)
    mean_c, mean_r = pairs.chosen / pairs.chosen_tokens, pairs.rejected / pairs.rejected_tokens
    theirs = ORPOTrainer.odds_ratio_loss(_trl_self("orpo"), mean_c, mean_r)
    nll = torch.tensor(1.75)  # TRL's batch NLL, a scalar
    ours = _ours("orpo", pairs, None, chosen_nll=nll.expand(4))
    torch.testing.assert_close(ours.losses.mean(), nll - theirs[0].mean(), **TOL)
    torch.testing.assert_close(ours.chosen_rewards, theirs[1], **TOL)
    torch.testing.assert_close(ours.rejected_rewards, theirs[2], **TOL)
    got = torch.autograd.grad(ours.losses.mean(), (pairs.chosen, pairs.rejected))
    want = torch.autograd.grad(-theirs[0].mean(), (pairs.chosen, pairs.rejected))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)


def test_reward_loss_equals_trl_reward_trainer(tiny):
    """A scalar-head Llama under TRL's ``RewardTrainer.compute_loss`` with
    a margin column and ``center_rewards_coefficient``: our loss on the same
    model's scores, its mean, and the model's gradients; and the formula."""
    from datasets import Dataset

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny.path)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        tiny.path, num_labels=1, dtype=torch.float32
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    records = [
        {"chosen": p["prompt"] + p["chosen"], "rejected": p["prompt"] + p["rejected"], "margin": m}
        for p, m in zip(PAIRS, (0.5, 0.0, 1.5), strict=True)
    ]
    args = trl.RewardConfig(
        output_dir=str(tiny.path) + "-reward",
        center_rewards_coefficient=0.01,
        report_to=[],
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=len(PAIRS),
    )
    trainer = trl.RewardTrainer(
        copy.deepcopy(model),
        args=args,
        train_dataset=Dataset.from_list(records),
        processing_class=tokenizer,
    )
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    want = trainer.compute_loss(trainer.model, dict(batch))
    want.backward()

    ours_model = copy.deepcopy(model).train()
    scores = ours_model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    ).logits.squeeze(-1)
    chosen, rejected = scores.chunk(2)
    out = rfb.reward_loss(chosen, rejected, margin=batch["margin"], center_rewards_coefficient=0.01)
    got = out.losses.mean()
    got.backward()
    torch.testing.assert_close(got, want.detach(), **TOL)
    _assert_grads_close(_grads(ours_model), _grads(trainer.model), "reward")
    formula = -F.logsigmoid(chosen - rejected - batch["margin"]) + 0.01 * (chosen + rejected) ** 2
    torch.testing.assert_close(out.losses, formula, **TOL)
    assert out.chosen_rewards.requires_grad is False


def test_refusals_name_the_argument():
    pairs, _ = _leaf_pairs()
    c, r = pairs.chosen, pairs.rejected
    with pytest.raises(ValueError, match=r"loss_type='kto' is not one of sigmoid, ipo"):
        rfb.dpo_loss(c, r, c, r, loss_type="kto")
    with pytest.raises(ValueError, match=r"beta=0 must be a number above 0"):
        rfb.dpo_loss(c, r, c, r, beta=0)
    with pytest.raises(ValueError, match=r"label_smoothing=0.5 must lie in \[0, 0.5\)"):
        rfb.dpo_loss(c, r, c, r, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match=r"label_smoothing=0.1 with loss_type='sigmoid'"):
        rfb.dpo_loss(c, r, c, r, label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"loss_type='ipo' needs chosen_lengths"):
        rfb.dpo_loss(c, r, c, r, loss_type="ipo")
    with pytest.raises(ValueError, match=r"loss_type='sigmoid' needs ref_chosen"):
        rfb.dpo_loss(c, r, None, None)
    with pytest.raises(ValueError, match=r"different shapes"):
        rfb.dpo_loss(c, r[:2], c, r)
