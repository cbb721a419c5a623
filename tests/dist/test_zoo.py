"""Eight transformers 5.23 families under every layout, against one process.

Each family of ``tests/zoo_families.py`` (tiny configs, float32) trains 3
AdamW steps under FSDP2 (dp_shard 2), tp 2, cp 2 (Ulysses; packed rows of
several documents and unpacked rows) and LoRA on FSDP2; each step's loss
and pre-clip grad norm must equal one process on the same rows to 1e-4
relative. Families a layout cannot run must be refused by ``wrap`` by name
(``REFUSED``). Sensitivity: the reference with the window (Mistral) or the
soft-cap (Gemma 2) turned off differs from the cp run by far more than the
tolerance, so the window and soft-cap are truly computed, not dropped.

One gloo spawn of 2 ranks runs every layout (``setup_process_context`` per
layout); the ranks share the one-process references, each training every
other one before the layouts run. The loss under cp is the token-exact idiom
(token sum over ``ctx.global_token_count``); without cp every rank holds rows
with the same number of targets and takes its mean (FSDP averages the dp
ranks).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ray_fsdp_backend.context_parallel import pack_documents, shard_sequence
from ray_fsdp_backend.context_parallel.sequence import default_position_ids
from ray_fsdp_backend.runtime.worker import setup_process_context
from ray_fsdp_backend.settings.config import FSDPSettings
from tests.dist.harness import run_ranks, train_step
from tests.zoo_families import FAMILIES, SEQ, VOCAB, build_family

pytest.importorskip("transformers")

STEPS = 3
ROWS = 4
REL = 1e-4
LAYOUTS = {
    "fsdp": dict(),
    "tp": dict(tensor_parallel_size=2),
    "cp": dict(context_parallel_size=2),
    "lora": dict(),
}
SENSITIVITY = {"mistral": {"sliding_window": None}, "gemma2": {"attn_logit_softcapping": None}}
"""Per family, the config change that turns its window or soft-cap off."""
REFUSED = {"tp": ("gpt_oss",)}
"""Families a layout refuses at ``wrap`` (docs/parallelism.md says why)."""
MASKS_WITHOUT_POSITIONS = ("gpt_oss",)
"""Families whose one-process reference gets transformers' document masks
passed in (see :func:`_document_masks`)."""


def _rows(packed: bool, seed: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if packed:
        sizes = (7, 19, 3, 30, 11, 26, 40, 9)
        docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in sizes]
        return pack_documents(docs, SEQ, rows=ROWS)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    return {
        "input_ids": ids,
        "labels": ids.clone(),
        "position_ids": default_position_ids(ROWS, SEQ),
    }


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    return get_peft_model(model, config)


def _model(family: str, lora: bool, **overrides):
    model = build_family(family, **overrides)
    return _lora(model) if lora else model


def _document_masks(model, batch) -> dict[str, torch.Tensor]:
    """transformers' own per-document masks of packed rows, for a family
    whose model builds its masks without ``position_ids`` (gpt-oss in 5.23:
    one process would attend across documents; the cp kernel does not)."""
    from ray_fsdp_backend.compat.transformers import (
        create_causal_mask,
        create_sliding_window_causal_mask,
    )

    ids = batch["input_ids"]
    kwargs = dict(
        config=model.config,
        inputs_embeds=torch.empty(*ids.shape, model.config.hidden_size),
        attention_mask=None,
        cache=None,
        position_ids=batch["position_ids"],
    )
    return {
        "full_attention": create_causal_mask(**kwargs),
        "sliding_attention": create_sliding_window_causal_mask(**kwargs),
    }


def _train(model, batch, count, ctx=None) -> tuple[list[float], list[float]]:
    """3 AdamW steps of ``token_sum / count``: each step's loss (the mean over
    the ranks, which is the global token mean under the loss rule) and
    pre-clip grad norm."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    inputs = {k: batch[k] for k in ("input_ids", "position_ids", "attention_mask") if k in batch}
    losses, norms = [], []
    for _ in range(STEPS):
        logits = model(**inputs).logits
        flat = logits.float().flatten(0, 1)
        loss = F.cross_entropy(flat, batch["labels"].flatten(), reduction="sum") / count
        total, norm = train_step(model, loss, opt, ctx)
        losses.append(total)
        norms.append(norm)
    return losses, norms


def _reference(family: str, rows, lora: bool, **overrides):
    batch = shard_sequence(rows, 0, 1)
    count = (batch["labels"] != -100).sum()
    model = _model(family, lora, **overrides)
    if family in MASKS_WITHOUT_POSITIONS:
        batch["attention_mask"] = _document_masks(model, batch)
    return _train(model, batch, count)


def _distributed(ctx, family: str, rows, lora: bool):
    model = ctx.wrap(_model(family, lora))
    per = ROWS // ctx.dp_size
    mine = {k: v[ctx.dp_rank * per : (ctx.dp_rank + 1) * per] for k, v in rows.items()}
    batch = ctx.shard_sequence(mine)
    if ctx.cp_size > 1:
        count = ctx.global_token_count(batch["labels"])
    else:
        count = (batch["labels"] != -100).sum()  # equal on every dp rank: unpacked rows
    return _train(model, batch, count, ctx)


def _refusal(ctx, family: str) -> str:
    """The message ``wrap`` refuses ``family`` with (before any weight moves)."""
    model = build_family(family)
    before = {n: p.clone() for n, p in model.named_parameters()}
    try:
        ctx.wrap(model)
    except ValueError as err:
        unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        return f"{err} | unchanged={unchanged}"
    return "accepted"


def _references(rank: int, world: int) -> dict[tuple, tuple]:
    """Every one-process reference the layouts compare to, keyed by
    ``(family, packed, lora)``, and the sensitivity runs, keyed by
    ``("off", family)``: each rank trains every ``world``-th one and all
    ranks receive all of them (the same float32 CPU numbers as training
    them all on every rank, in half the CPU)."""
    keys = [(f, packed, layout == "lora") for layout in LAYOUTS for f in FAMILIES
            for packed in ((False, True) if layout == "cp" else (False,))
            if f not in REFUSED.get(layout, ())]  # fmt: skip
    keys = list(dict.fromkeys(keys)) + [("off", f) for f in SENSITIVITY]
    mine = {}
    for key in keys[rank::world]:
        if key[0] == "off":
            mine[key] = _reference(key[1], _rows(True), False, **SENSITIVITY[key[1]])
        else:
            mine[key] = _reference(key[0], _rows(key[1]), key[2])
    shares = [None] * world
    dist.all_gather_object(shares, mine)
    return {k: v for share in shares for k, v in share.items()}


def _zoo(rank, world) -> dict:
    """Every layout, family and row kind in one spawn; each one-process
    reference is trained once (by one rank) and shared by the layouts that
    compare to it."""
    references = _references(rank, world)
    results = {}
    for layout, options in LAYOUTS.items():
        settings = FSDPSettings(use_fsdp=True, use_mixed_precision=False, **options)
        ctx = setup_process_context(settings, torch.device("cpu"))
        lora = layout == "lora"
        for packed in (False, True) if layout == "cp" else (False,):
            for family in FAMILIES:
                if family in REFUSED.get(layout, ()):
                    results[(layout, family, "refused")] = _refusal(ctx, family)
                    continue
                results[(layout, family, packed)] = (
                    references[(family, packed, lora)],
                    _distributed(ctx, family, _rows(packed), lora),
                )
    for family in SENSITIVITY:
        results[("off", family)] = references[("off", family)]
    return results


@pytest.fixture(scope="module")
def zoo():
    return run_ranks(_zoo, 2)


def _close(a: list[float], b: list[float]) -> bool:
    return all(abs(x - y) <= REL * abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_family_trains_like_one_process(zoo, layout):
    failures = []
    for key, value in zoo.items():
        if key[0] != layout:
            continue
        if key[2] == "refused":
            assert "unchanged=True" in value and f"model_type='{key[1]}'" in value, value
            continue
        (ref_losses, ref_norms), (losses, norms) = value
        if not (_close(losses, ref_losses) and _close(norms, ref_norms)):
            failures.append(f"{key}: losses {losses} vs {ref_losses}, norms {norms} vs {ref_norms}")
        assert ref_losses[-1] < ref_losses[0], key  # it trains
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("family", list(SENSITIVITY))
def test_window_and_softcap_are_computed(zoo, family):
    """The cp run (packed rows) against the reference with the window or
    soft-cap off: far apart, so the kernel truly applies them."""
    off_losses, off_norms = zoo[("off", family)]
    _, (losses, norms) = zoo[("cp", family, True)]
    pairs = zip(losses + norms, off_losses + off_norms, strict=True)
    gap = max(abs(a - b) / abs(b) for a, b in pairs)
    assert gap > 100 * REL, gap
