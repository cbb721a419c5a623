"""The trainer's DPO step (``train.objective: dpo``) on gloo ranks against
one process running each pair alone.

Pairs of random token documents (a prompt, a chosen and a rejected
response; the loss on the responses only) are packed by
``ray_fsdp_backend.preference.packing`` into 64-token rows, several pairs a
row, 4 rows a step. The real step (``train_step`` with the run's
``DPOObjective``: ``rfb.pair_log_probs`` through the chunked head,
``rfb.dpo_loss``, the step's sum over its global pair count) trains a tiny
pretrained Llama 3 AdamW steps at dp 2 and tp 2 (the reference
``precompute``d before the first step, on rows dealt to the ranks the other
way round, so each rank looks up pairs another rank computed), and at dp 2
with ``reference: frozen`` (a second sharded copy). One process runs the
same steps feeding every pair on its own (positions 0..n-1) through
``F.log_softmax`` of the full logits, against a frozen deep copy, with the
sigmoid DPO loss written out: loss and pre-clip gradient norm agree to 1e-5
at every step, and so do the ``rewards/*`` metrics of the step.

LoRA: the same at dp 2 with ``reference: adapters`` (the policy with its
adapters disabled) equals ``reference: frozen`` (a separate copy of the
base), and after the first step the loss is no longer log 2 (a reference
equal to the policy would keep it there).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ray_fsdp_backend.preference.packing import pack_pairs
from ray_fsdp_backend.runtime.worker import setup_process_context
from ray_fsdp_backend.settings.config import FSDPSettings
from ray_fsdp_backend.trainer.data.sft_batches import to_micro_batch
from ray_fsdp_backend.trainer.loop.optim import build_optimizer
from ray_fsdp_backend.trainer.loop.pretrained import build_pretrained
from ray_fsdp_backend.trainer.loop.step import build_objective, train_step
from ray_fsdp_backend.trainer.schema.lora import LoraOptions
from ray_fsdp_backend.trainer.schema.options import (
    DataOptions,
    LoggingOptions,
    RunOptions,
    ScalingOptions,
    TrainOptions,
)
from ray_fsdp_backend.trainer.schema.preference import DPOOptions
from ray_fsdp_backend.trainer.schema.pretrained import PretrainedModelConfig
from ray_fsdp_backend.trainer.schema.spec import RunSpec
from tests.dist.harness import run_ranks

SEQ, STEPS, ROWS, BETA, LR = 64, 3, 4, 0.5, 1e-2
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


def _pair(rng, vocab):
    prompt = rng.integers(4, vocab, rng.integers(3, 9))
    docs = []
    for _ in range(2):
        response = rng.integers(4, vocab, rng.integers(2, 10))
        ids = np.concatenate([prompt, response])
        labels = np.concatenate([np.full(len(prompt), -100), response])
        docs.append((ids, labels))
    return tuple(docs)


def _steps(vocab):
    """Each step's packed rows (exactly ROWS, several pairs a row) and its pairs."""
    rng = np.random.default_rng(3)
    pairs = [_pair(rng, vocab) for _ in range(200)]
    steps, at = [], 0
    for _ in range(STEPS):
        take = 1
        while _row_count(pairs[at : at + take + 1]) <= ROWS:
            take += 1
        indices = list(range(at, at + take))
        rows = pack_pairs(pairs[at : at + take], indices, SEQ, 0)
        assert len(rows["input_ids"]) == ROWS and take >= 2 * ROWS
        steps.append(({k: torch.from_numpy(v) for k, v in rows.items()}, pairs[at : at + take]))
        at += take
    return steps


def _row_count(pairs) -> int:
    return len(pack_pairs(pairs, list(range(len(pairs))), SEQ, 0)["input_ids"])


def _spec(path: str, reference: str | None, lora: bool) -> RunSpec:
    model = PretrainedModelConfig(
        pretrained=path,
        seq_len=SEQ,
        lora=LoraOptions(r=4, alpha=8, target_modules=("q_proj", "v_proj")) if lora else None,
    )
    train = TrainOptions(
        steps=STEPS,
        micro_batch_size=ROWS,
        lr=LR,
        weight_decay=0.0,
        warmup_steps=0,
        max_grad_norm=0,
        objective="dpo",
        dpo=DPOOptions(beta=BETA, reference=reference),
    )
    return RunSpec(
        distributed=FSDPSettings(),
        model=model,
        train=train,
        data=DataOptions(format="preference", packing=True),
        scaling=ScalingOptions(),
        run=RunOptions(),
        logging=LoggingOptions(),
    )


class _Rows:
    """This rank's micro-batch of each step, as ``SftBatches`` gives them."""

    def __init__(self, steps, ctx, grad_accum: int) -> None:
        per = ROWS // ctx.dp_size // grad_accum
        self.batches = [
            to_micro_batch(
                {k: v[(ctx.dp_rank * grad_accum + m) * per :][:per] for k, v in rows.items()}
            )
            for rows, _ in steps
            for m in range(grad_accum)
        ]

    def next_batch(self):
        return self.batches.pop(0)


def _distributed(ctx, path, steps, reference, lora=False, grad_accum=1):
    spec = _spec(path, reference, lora)
    spec = dataclasses.replace(
        spec,
        train=dataclasses.replace(
            spec.train, grad_accum=grad_accum, micro_batch_size=ROWS // ctx.dp_size // grad_accum
        ),
    )
    torch.manual_seed(0)
    model = build_pretrained(ctx, spec.model)
    optimizer = build_optimizer(model, spec)
    objective = build_objective(ctx, model, spec)
    # precompute reads the rows dealt the other way round: pairs another rank looks up
    flipped = [({k: v.flip(0) for k, v in rows.items()}, pairs) for rows, pairs in steps]
    objective.before_training(ctx, model, lambda: _Rows(flipped, ctx, 1).batches, None)
    rows, out = _Rows(steps, ctx, grad_accum), []
    for _ in range(STEPS):
        result = train_step(ctx, model, optimizer, rows, spec, objective=objective)
        values = [result.loss, *(result.stats[k] for k in METRICS)]
        mean = torch.stack([v.detach() for v in values])
        torch.distributed.all_reduce(mean)
        out.append([float(v) / ctx.world_size for v in mean] + [float(result.grad_norm)])
    return out


def _sums(model, pair):
    """Chosen and rejected log-prob sums of one pair, each document alone."""
    out = []
    for ids, labels in pair:
        ids, labels = torch.from_numpy(ids)[None], torch.from_numpy(labels)
        logits = model(ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0, :-1]
        log_probs = F.log_softmax(logits.float(), -1)
        targets = labels[1:]
        valid = targets != -100
        out.append(log_probs[valid].gather(1, targets[valid][:, None]).sum())
    return out


def _reference(path, steps):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    frozen = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    out = []
    for _, pairs in steps:
        losses, chosen, rejected = [], [], []
        for pair in pairs:
            pc, pr = _sums(model, pair)
            with torch.no_grad():
                rc, rr = _sums(frozen, pair)
            c, r = BETA * (pc - rc), BETA * (pr - rr)
            losses.append(-F.logsigmoid(c - r))
            chosen.append(c.detach())
            rejected.append(r.detach())
        loss = torch.stack(losses).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        opt.step()
        opt.zero_grad()
        c, r = torch.stack(chosen), torch.stack(rejected)
        metrics = [c.mean(), r.mean(), (c - r).mean(), (c > r).float().mean()]
        out.append([float(loss), *(float(m) for m in metrics), float(norm)])
    return out


def _vocab(path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).vocab_size


def _checks(rank, world, path):
    steps = _steps(_vocab(path))
    results = {"reference": _reference(path, steps)}
    fsdp = FSDPSettings(use_fsdp=True, use_mixed_precision=False)
    ctx = setup_process_context(fsdp, torch.device("cpu"))
    results["dp2 precompute"] = _distributed(ctx, path, steps, "precompute")
    results["dp2 frozen, 2 micro-batches"] = _distributed(ctx, path, steps, "frozen", grad_accum=2)
    results["lora adapters"] = _distributed(ctx, path, steps, "adapters", lora=True)
    results["lora frozen"] = _distributed(ctx, path, steps, "frozen", lora=True)
    tp = dataclasses.replace(fsdp, tensor_parallel_size=2)
    ctx = setup_process_context(tp, torch.device("cpu"))
    results["tp2 precompute"] = _distributed(ctx, path, steps, "precompute")
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained

    path = save_tiny_pretrained("llama", tmp_path_factory.mktemp("llama") / "ckpt")
    return run_ranks(_checks, 2, path)


def _assert_close(got, want, rel=1e-5, atol=1e-6):
    for step, (g_row, w_row) in enumerate(zip(got, want, strict=True)):
        for g, w in zip(g_row, w_row, strict=True):
            assert abs(g - w) <= atol + rel * abs(w), (step, got, want)


@pytest.mark.parametrize(
    "layout", ["dp2 precompute", "dp2 frozen, 2 micro-batches", "tp2 precompute"]
)
def test_packed_pairs_train_as_each_pair_alone(results, layout):
    _assert_close(results[layout], results["reference"])


def test_lora_disabled_adapters_equal_a_frozen_copy(results):
    adapters, frozen = results["lora adapters"], results["lora frozen"]
    _assert_close(adapters, frozen)
    assert abs(adapters[0][0] - math.log(2)) < 1e-6  # B = 0: the policy is the reference
    assert all(abs(step[0] - math.log(2)) > 1e-4 for step in adapters[1:])
