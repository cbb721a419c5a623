"""Context parallelism in a user's own transformers loop, against one process.

One spawned job on 2 gloo ranks (one cp group, FSDP2 over it, through the
context the backend builds). For Qwen3 and Mistral (a sliding window):
``model(**ctx.shard_sequence(rows), num_items_in_batch=...)``, transformers'
own loss on the labels ``shard_sequence`` returns, takes one AdamW step with
the loss and pre-clip grad norm of one process's ``model(input_ids,
labels=...)`` on whole rows (-100 targets included); a right-padded
attention mask gives the real tokens one process's logits. The inputs cp
cannot compute are refused by name on every rank: ``labels=`` without
``shift_labels``, a left-padded mask (whose pads all sit on rank 0), and a
forward without ``position_ids``.
"""

from __future__ import annotations

import pytest
import torch

from ray_fsdp_backend.context_parallel.ulysses import gather_sequence
from ray_fsdp_backend.runtime.worker import setup_process_context
from ray_fsdp_backend.settings.config import FSDPSettings
from tests.dist.harness import run_ranks, train_step
from tests.zoo_families import SEQ, VOCAB, build_family

ROWS = 2
FAMILIES = ("qwen3", "mistral")


def _rows() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    labels[0, 5:9] = -100  # a prompt the loss skips
    return {"input_ids": ids, "labels": labels}


def _reference(family: str, rows) -> tuple[float, float]:
    model = build_family(family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(input_ids=rows["input_ids"], labels=rows["labels"]).loss
    return train_step(model, loss, opt)


def _user_loop(ctx, family: str, rows) -> tuple[float, float]:
    model = ctx.wrap(build_family(family))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = ctx.shard_sequence(rows)
    count = ctx.global_token_count(batch["labels"])  # the loss rule's divisor
    loss = model(**batch, num_items_in_batch=count).loss
    return train_step(model, loss, opt, ctx)


def _right_padding(ctx, family: str) -> float:
    """Max logit error on real tokens of right-padded rows with their mask."""
    rows = _rows()
    mask = torch.ones_like(rows["input_ids"])
    mask[1, SEQ - 6 :] = 0
    ref = build_family(family)(input_ids=rows["input_ids"], attention_mask=mask).logits
    model = ctx.wrap(build_family(family))
    batch = ctx.shard_sequence({**rows, "attention_mask": mask})
    logits = model(**{k: batch[k] for k in ("input_ids", "position_ids", "attention_mask")})
    whole = gather_sequence(logits.logits.detach(), ctx.mesh["cp"].get_group())
    return float((whole - ref.detach())[mask.bool()].abs().max())


def _refusals(ctx) -> dict[str, str]:
    """The error of each input cp cannot compute (every rank must raise)."""
    model = ctx.wrap(build_family("qwen3"))
    rows = _rows()
    batch = ctx.shard_sequence(rows)
    left = torch.ones(ROWS, SEQ, dtype=torch.long)
    left[0, :6] = 0  # six pads, all on cp rank 0
    left_batch = ctx.shard_sequence({**rows, "attention_mask": left})
    cases = {
        "labels": dict(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]
        ),
        "left_padding": {k: left_batch[k] for k in ("input_ids", "position_ids", "attention_mask")},
        "no_positions": dict(input_ids=batch["input_ids"]),
    }
    out = {}
    for name, inputs in cases.items():
        try:
            model(**inputs)
            out[name] = "accepted"
        except ValueError as err:
            out[name] = str(err)
    return out


def _job(rank, world) -> dict:
    settings = FSDPSettings(use_fsdp=True, use_mixed_precision=False, context_parallel_size=2)
    ctx = setup_process_context(settings, torch.device("cpu"))
    rows = _rows()
    out = {"refusals": _refusals(ctx)}
    for family in FAMILIES:
        out[family] = (_reference(family, rows), _user_loop(ctx, family, rows))
        out[f"{family}_padding"] = _right_padding(ctx, family)
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, out["refusals"])
    out["refusals_by_rank"] = gathered
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_job, 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loss_on_shards_equals_one_process(results, family):
    (ref_loss, ref_norm), (loss, norm) = results[family]
    assert loss == pytest.approx(ref_loss, abs=2e-6)
    assert norm == pytest.approx(ref_norm, rel=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_right_padding_mask_is_honoured(results, family):
    assert results[f"{family}_padding"] < 1e-5


def test_inputs_cp_cannot_compute_are_refused_on_every_rank(results):
    for refusals in results["refusals_by_rank"]:
        assert "labels= without shift_labels=" in refusals["labels"]
        assert "left or middle padding) in rows [0]" in refusals["left_padding"]
        assert "got no position_ids" in refusals["no_positions"]
