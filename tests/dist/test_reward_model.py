"""A Bradley-Terry reward model on packed pairs equals transformers' classifier
run one sequence at a time (issue 56, docs/preference.md "Reward models").

A tiny Llama causal-LM checkpoint becomes a reward model
(``build_sequence_classifier``: its decoder loaded, ``lm_head`` not, a fresh
``score`` head). One spawned job on 4 gloo ranks, at HSDP 2 x 2 and at
dp_shard 2 x cp 2 (Ulysses: each cp rank holds half of every packed row),
scores hand-packed rows (2 or 3 pairs a row, padding at the end) with
``pair_scores``, trains nothing but takes the Bradley-Terry loss's gradient,
and exports in the ``AutoModelForSequenceClassification`` layout. In this
process ``from_pretrained`` loads the export, scores each document alone
(its own pooling at the last token) and computes the hand-written loss
``-logsigmoid(chosen - rejected)`` over every pair: scores, loss and the
gradient norm agree to 1e-5 (fp32). The export's decoder is the checkpoint's
and its head is what one process initialises from the same seed.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ray_fsdp_backend.runtime.worker import setup_process_context
from ray_fsdp_backend.trainer.schema.spec import build_spec
from tests.dist.harness import run_ranks
from tests.hf_models import VOCAB, save_tiny_pretrained

pytest.importorskip("transformers")

SEQ, ROWS, SEED = 48, 4, 7
LAYOUTS = {
    "hsdp2 x 2": dict(fsdp_sharding_strategy="hybrid_shard", fsdp_hsdp_replicate_size=2),
    "dp_shard2 x cp2": dict(context_parallel_size=2, context_parallel_backend="ulysses"),
}


def _pairs() -> list[list[tuple[list[int], list[int]]]]:
    """Each row's pairs: (chosen document, rejected document), a shared prompt."""
    g = torch.Generator().manual_seed(SEED)
    rows = []
    for row in range(ROWS):
        pairs, used = [], 0
        for _ in range(2 + row % 2):
            prompt = torch.randint(3, VOCAB, (2 + row,), generator=g).tolist()
            chosen = prompt + torch.randint(3, VOCAB, (2,), generator=g).tolist()
            rejected = prompt + torch.randint(3, VOCAB, (3,), generator=g).tolist()
            pairs.append((chosen, rejected))
            used += len(chosen) + len(rejected)
        assert used < SEQ
        rows.append(pairs)
    return rows


def _packed(rows) -> dict[str, torch.Tensor]:
    """The rows as ``rfb.preference_dataset`` makes them (its padding: a
    document of its own at the row's end, sequence id -1)."""
    out = {k: torch.full((ROWS, SEQ), -1, dtype=torch.long) for k in ("sequence_ids", "pair_index")}
    out["input_ids"] = torch.zeros((ROWS, SEQ), dtype=torch.long)
    out["position_ids"] = torch.zeros((ROWS, SEQ), dtype=torch.long)
    index = 0
    for r, pairs in enumerate(rows):
        at = 0
        for p, pair in enumerate(pairs):
            for s, doc in enumerate(pair):
                out["input_ids"][r, at : at + len(doc)] = torch.tensor(doc)
                out["position_ids"][r, at : at + len(doc)] = torch.arange(len(doc))
                out["sequence_ids"][r, at : at + len(doc)] = 2 * p + s
                out["pair_index"][r, at : at + len(doc)] = index
                at += len(doc)
            index += 1
        out["position_ids"][r, at:] = torch.arange(SEQ - at)
    out["labels"] = torch.full((ROWS, SEQ), -100, dtype=torch.long)
    return out


def _spec(path, extra, **model):
    """The trainer's run spec of a reward model at this layout (its data
    only for the checks: the rows here are packed by hand)."""
    pairs = os.path.join(path, "pairs.jsonl")
    return build_spec({
        "distributed": {"use_fsdp": True, "use_mixed_precision": False, **extra},
        "model": {"pretrained": path, "seq_len": SEQ, **model},
        "train": {"objective": "reward", "micro_batch_size": 1, "seed": SEED},
        "data": {"format": "preference", "path": pairs},
        "scaling": {"num_workers": 4, "use_gpu": False},
    })  # fmt: skip


def _layout(path, export, name, extra, rows):
    from ray_fsdp_backend.preference.reward import pair_scores
    from ray_fsdp_backend.trainer.loop.pretrained import build_pretrained
    from ray_fsdp_backend.trainer.loop.step import accumulate, build_objective

    spec = _spec(path, extra)
    ctx = setup_process_context(spec.distributed, torch.device("cpu"))
    torch.manual_seed(SEED)  # as setup_run seeds the build
    model = build_pretrained(ctx, spec.model, reward=True)
    per = ROWS // ctx.dp_size
    packed = _packed(rows)
    mine = {k: v[ctx.dp_rank * per : (ctx.dp_rank + 1) * per] for k, v in packed.items()}
    batch = ctx.shard_sequence(mine)
    with torch.no_grad():
        chosen, rejected = pair_scores(ctx, model, batch)
    # The trainer's step: the objective's loss sum over the step's pair count, backward.
    total, _, stats = accumulate(ctx, model, [batch], build_objective(ctx, model, spec))
    norm = ctx.clip_grad_norm(model, None)
    dist.all_reduce(total)
    scores = [None] * dist.get_world_size()
    dist.all_gather_object(scores, (ctx.dp_rank, ctx.cp_rank, chosen.tolist(), rejected.tolist()))
    if export is not None:
        ctx.export_model(model, export)
    for value in stats.values():
        dist.all_reduce(value)
    return {
        "loss": float(total) / dist.get_world_size(),
        "stats": {k: float(v) / dist.get_world_size() for k, v in stats.items()},
        "norm": float(norm),
        "scores": sorted(s for s in scores if s[1] == 0),
    }


def _lora(path, export, rows):
    """LoRA (full_shard over 4 ranks): one AdamW step of the trainer's
    objective, then the pairs' scores and the merged export."""
    from ray_fsdp_backend.preference.reward import pair_scores
    from ray_fsdp_backend.trainer.loop.pretrained import build_pretrained
    from ray_fsdp_backend.trainer.loop.step import accumulate, build_objective

    spec = _spec(path, {}, lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    ctx = setup_process_context(spec.distributed, torch.device("cpu"))
    torch.manual_seed(SEED)
    model = build_pretrained(ctx, spec.model, reward=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    mine = {k: v[ctx.dp_rank : ctx.dp_rank + 1] for k, v in _packed(rows).items()}
    batch = ctx.shard_sequence(mine)
    accumulate(ctx, model, [batch], build_objective(ctx, model, spec))
    opt.step()
    with torch.no_grad():
        chosen, rejected = pair_scores(ctx, model, batch)
    scores = [None] * dist.get_world_size()
    dist.all_gather_object(scores, (ctx.dp_rank, 0, chosen.tolist(), rejected.tolist()))
    ctx.export_model(model, export)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return {"scores": sorted(scores), "trainable": names}


def _checks(rank, world, path, export):
    rows = _pairs()
    results = {
        name: _layout(path, export if i == 0 else None, name, extra, rows)
        for i, (name, extra) in enumerate(LAYOUTS.items())
    }
    results["lora"] = _lora(path, export + "-lora", rows)
    return results


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    path = save_tiny_pretrained("llama", str(tmp_path_factory.mktemp("llama")))
    with open(os.path.join(path, "pairs.jsonl"), "w") as f:  # for the spec's data checks
        for i in range(200):
            f.write(json.dumps({"prompt": f"q{i}", "chosen": "yes", "rejected": "no"}) + "\n")
    export = os.path.join(str(tmp_path_factory.mktemp("export")), "reward")
    return {"path": path, "export": export, **run_ranks(_checks, 4, path, export)}


def _reference(export):
    """Scores, loss and gradient norm of the exported classifier, every
    document alone, the hand-written Bradley-Terry mean over all pairs."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(export, dtype=torch.float32)
    assert model.config.architectures == ["LlamaForSequenceClassification"]
    chosen, rejected = [], []
    for pairs in _pairs():
        for c, r in pairs:
            chosen.append(model(torch.tensor([c])).logits[0, 0])
            rejected.append(model(torch.tensor([r])).logits[0, 0])
    chosen, rejected = torch.stack(chosen), torch.stack(rejected)
    loss = -F.logsigmoid(chosen - rejected).mean()
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    return chosen.detach(), rejected.detach(), float(loss.detach()), float(norm)


def _gathered(scores) -> tuple[torch.Tensor, torch.Tensor]:
    chosen = torch.tensor([c for _, _, cs, _ in scores for c in cs])
    return chosen, torch.tensor([r for _, _, _, rs in scores for r in rs])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_scores_equal_the_classifier_one_sequence_at_a_time(spawned, layout):
    chosen, rejected, loss, norm = _reference(spawned["export"])
    got = spawned[layout]
    got_chosen, got_rejected = _gathered(got["scores"])
    torch.testing.assert_close(got_chosen, chosen, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_rejected, rejected, atol=1e-5, rtol=1e-5)
    assert abs(got["loss"] - loss) / loss < 1e-5, (got["loss"], loss)
    margins = chosen - rejected
    want = {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/margins": margins.mean(),
        "rewards/accuracies": (margins > 0).float().mean(),
    }
    for key, value in want.items():
        assert abs(got["stats"][key] - float(value)) < 1e-5, (key, got["stats"][key], value)
    assert abs(got["norm"] - norm) / norm < 1e-5, (got["norm"], norm)


def test_export_is_a_sequence_classifier_of_the_checkpoints_decoder(spawned):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ray_fsdp_backend.hf.models import build_sequence_classifier
    from ray_fsdp_backend.strategies.blocks import materialize_meta_module

    config = json.load(open(os.path.join(spawned["export"], "config.json")))
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert len(config["id2label"]) == 1 and config["pad_token_id"] is not None
    exported = {}
    for name in os.listdir(spawned["export"]):
        if name.endswith(".safetensors"):
            exported.update(load_file(os.path.join(spawned["export"], name)))
    causal = AutoModelForCausalLM.from_pretrained(spawned["path"]).state_dict()
    decoder = {k: v for k, v in causal.items() if k.startswith("model.")}
    assert set(exported) == set(decoder) | {"score.weight"}
    for key, value in decoder.items():
        torch.testing.assert_close(exported[key], value, atol=0, rtol=0, msg=key)
    torch.manual_seed(SEED)  # one process, the run's seed: the same head
    alone = build_sequence_classifier(spawned["path"])
    materialize_meta_module(alone, "cpu")
    torch.testing.assert_close(exported["score.weight"], alone.score.weight, atol=0, rtol=0)
    std = float(alone.score.weight.detach().std())
    assert 0.005 < std < 0.05  # normal(0, initializer_range=0.02)


def test_lora_trains_the_score_head_whole_and_exports_it_merged(spawned):
    lora = spawned["lora"]
    assert "base_model.model.score.weight" in lora["trainable"]
    assert not any("modules_to_save" in n for n in lora["trainable"])
    assert all("lora_" in n for n in lora["trainable"] if not n.endswith("score.weight"))
    chosen, rejected, _, _ = _reference(spawned["export"] + "-lora")  # adapters merged
    got_chosen, got_rejected = _gathered(lora["scores"])
    torch.testing.assert_close(got_chosen, chosen, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_rejected, rejected, atol=1e-5, rtol=1e-5)
    before, _, _, _ = _reference(spawned["export"])  # the same seed, not stepped
    assert (chosen - before).abs().max() > 1e-3  # the step moved the scores
