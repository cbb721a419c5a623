"""Packed SFT rows train exactly as each conversation on its own (docs/sft.md).

Chat records of mixed lengths are rendered with a ChatML tokenizer and packed
by ``ray_fsdp_backend.sft`` into 128-token rows (first-fit decreasing, padding
at row ends, loss only on the answers). One spawned job on 4 gloo ranks
trains 3 AdamW steps on those rows at dp 2 x tp 2 and at dp_shard 2 x cp 2
(Ulysses: each cp rank holds half of every packed row), with the loss rule
``token_sum / ctx.global_token_count``. One process runs the same 3 steps
feeding every conversation as its own unpadded sequence (positions 0..n-1,
its own mask, the same labels) and taking the mean over every target of the
step. Loss and pre-clip norm agree to 1e-5 at every step; the rows are
really packed (several documents a row), so attention or a target crossing
documents would show.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ray_fsdp_backend.context_parallel.sequence import shift_labels
from ray_fsdp_backend.models.decoder import ModelConfig, Transformer
from ray_fsdp_backend.runtime.worker import setup_process_context
from ray_fsdp_backend.settings.config import FSDPSettings
from ray_fsdp_backend.sft.packing import PackCounts, pack_documents
from ray_fsdp_backend.sft.records import SFTOptions
from ray_fsdp_backend.sft.render import render_record
from tests import sft_tokenizers as st
from tests.dist.harness import run_ranks, train_step

SEQ, STEPS, ROWS = 128, 3, 4  # ROWS global rows a step
LAYOUTS = {
    "dp2 x tp2": dict(tensor_parallel_size=2),
    "dp_shard2 x cp2": dict(context_parallel_size=2, context_parallel_backend="ulysses"),
}


def _documents():
    """Rendered chat documents, and the packed rows of each step (whole
    documents never span steps: each step packs its own documents)."""
    tok = st.tokenizer("chatml")
    options = SFTOptions.build(format="chat", seq_len=SEQ)
    docs = []
    for i, messages in enumerate(st.random_conversations(200, seed=5)):
        turns = [m for m in messages if m["role"] != "system"][:2]
        short = [{**m, "content": " ".join(m["content"].split()[: 1 + i % 4])} for m in turns]
        docs.extend(render_record({"messages": short}, tok, options, f"record {i}"))
    steps, at = [], 0
    for _ in range(STEPS):
        counts = PackCounts()
        for take in range(1, len(docs) - at):
            rows = pack_documents(docs[at : at + take], SEQ, tok.pad_token_id, counts=PackCounts())
            if len(rows["input_ids"]) > ROWS:
                break
        rows = pack_documents(docs[at : at + take - 1], SEQ, tok.pad_token_id, counts=counts)
        assert len(rows["input_ids"]) == ROWS and counts.documents >= 2 * ROWS
        steps.append(({k: torch.from_numpy(v) for k, v in rows.items()}, docs[at : at + take - 1]))
        at += take - 1
    return steps


def _decoder() -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=400, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=SEQ)
    return Transformer(config)


def _token_sum(model, batch) -> torch.Tensor:
    logits = model(batch["input_ids"], position_ids=batch["position_ids"])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="sum")


def _reference(steps):
    """One process, every document on its own, the step's mean over its targets."""
    model = _decoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for _, docs in steps:
        total = torch.zeros(())
        count = 0
        for ids, labels in docs:
            labels = labels.copy()
            labels[0] = -100  # predicted by no token of its own document
            batch = {
                "input_ids": torch.from_numpy(ids)[None],
                "labels": shift_labels(torch.from_numpy(labels)[None]),
                "position_ids": torch.arange(len(ids))[None],
            }
            total = total + _token_sum(model, batch)
            count += int((batch["labels"] != -100).sum())
        out.append(train_step(model, total / count, opt))
    return out


def _distributed(ctx, steps):
    model = ctx.wrap(_decoder())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per = ROWS // ctx.dp_size
    out = []
    for rows, _ in steps:
        mine = {k: v[ctx.dp_rank * per : (ctx.dp_rank + 1) * per] for k, v in rows.items()}
        batch = ctx.shard_sequence(mine)
        count = ctx.global_token_count(batch["labels"])
        with ctx.sequence_region(), ctx.loss_parallel():
            loss = _token_sum(model, batch) / count
        out.append(train_step(model, loss, opt, ctx))
    return out


def _checks(rank, world):
    steps = _documents()
    results = {"reference": _reference(steps)}
    for name, extra in LAYOUTS.items():
        settings = {"use_fsdp": True, "use_mixed_precision": False, **extra}
        ctx = setup_process_context(FSDPSettings(**settings), torch.device("cpu"))
        results[name] = _distributed(ctx, steps)
    rows = steps[0][0]
    results["documents_per_row"] = float(
        np.mean([(r == 0).sum() for r in rows["position_ids"].numpy()])
    )
    return results


@pytest.fixture(scope="module")
def results():
    return run_ranks(_checks, 4)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_rows_train_as_each_document_alone(results, layout):
    for (loss, norm), (ref_loss, ref_norm) in zip(
        results[layout], results["reference"], strict=True
    ):
        assert abs(loss - ref_loss) / ref_loss < 1e-5, (layout, loss, ref_loss)
        assert abs(norm - ref_norm) / ref_norm < 1e-5, (layout, norm, ref_norm)


def test_the_rows_are_really_packed(results):
    assert results["documents_per_row"] >= 2  # so crossing documents would change the loss
