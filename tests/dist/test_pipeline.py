"""Pipeline parallelism on real gloo ranks against one process (issue 47).

One spawned job on 4 ranks, mesh ``pp 2 x dp_shard 2``: a tiny
transformers Llama and the built-in decoder, each with 3 layers (stages of 1
and 2 layers: the balanced split), under the 1F1B and GPipe schedules; Qwen2, Mistral, Gemma 3
(scaled embedding, per-layer-type rotary, capped logits), Qwen2-MoE
(experts and a shared expert in each layer) and Qwen3-MoE at ep 2 inside
each stage; the decoder at ``pp 2 x tp 2``; and with 2 virtual stages per
rank (4 and 5 layers, 4 stages), interleaved 1F1B and interleaved zero
bubble. The MoE layers' expert load (``ctx.router_stats``, each stage
counting its own layers) equals one process's. Every rank holds only its
stage's (stages') parameters, under their
original names; 3 AdamW steps of
``ctx.pipeline_step`` plus ``ctx.clip_grad_norm`` (max_norm 0.5, so it
clips) give one process's loss and pre-clip norm (1e-5) and parameters
(1e-4 absolute: AdamW's normalised updates) on the whole
batch, whose labels hold -100 targets unevenly.
"""

from __future__ import annotations

import copy
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ray_fsdp_backend.context_parallel.sequence import shift_labels
from ray_fsdp_backend.models.decoder import ModelConfig, Transformer
from ray_fsdp_backend.pipeline import plan_stages
from ray_fsdp_backend.pipeline.step import pipeline_eval
from ray_fsdp_backend.planning.pipeline_schedules import stage_indices
from ray_fsdp_backend.runtime.worker import setup_process_context
from ray_fsdp_backend.settings.config import FSDPSettings
from ray_fsdp_backend.trainer.loop.train import run_training
from ray_fsdp_backend.trainer.schema.spec import load_spec
from tests.dist.harness import run_ranks
from tests.hf_models import VOCAB, save_tiny_pretrained, tiny_config

SEQ, ROWS, STEPS, MAX_NORM = 16, 8, 3, 0.5
CPU_TINY = Path(__file__).resolve().parents[2] / "examples" / "cpu_tiny.yaml"
TRAIN_OVERRIDES = [
    "model.dim=32",
    "model.n_layers=3",
    "model.n_heads=4",
    "model.seq_len=64",
    "model.tie_embeddings=false",
    "train.steps=3",
    "train.grad_accum=2",
    "train.log_every=1",
    "train.warmup_steps=1",
    "data.packing=true",
]
V2 = {"pipeline_virtual_stages": 2}
CASES = {
    "llama 1f1b": ("llama", "1f1b", 2),
    "llama gpipe": ("llama", "gpipe", 4),
    "decoder 1f1b": ("decoder", "1f1b", 4),
    "decoder gpipe": ("decoder", "gpipe", 2),
    "decoder 1f1b tp2": ("decoder", "1f1b", 2, {"tensor_parallel_size": 2}),
    # Packed rows: position_ids restart per document, reaching every stage.
    "llama packed 1f1b": ("llama", "1f1b", 2, {}, True),
    "decoder packed gpipe": ("decoder", "gpipe", 2, {}, True),
    "qwen2 1f1b": ("qwen2", "1f1b", 2),
    "mistral packed 1f1b": ("mistral", "1f1b", 2, {}, True),
    # Gemma 3: embedding scale, per-layer-type rotary and windows, capped logits.
    "gemma3 packed 1f1b": ("gemma3_text", "1f1b", 2, {}, True),
    # Mixture of experts (4 experts, top 2, a shared expert), FSDP2 over each stage's dp.
    "qwen2_moe gpipe": ("qwen2_moe", "gpipe", 2),
    # Expert parallelism inside each stage: ep 2 over the stage's 2 dp ranks.
    "qwen3_moe ep2 packed 1f1b": ("qwen3_moe", "1f1b", 2, {"expert_parallel_size": 2}, True),
    # Two virtual stages per rank (4 stages over 2 ranks; 5 layers: stages of
    # 1, 1, 2, 1), loop placement: rank 0 holds stages 0 and 2.
    "llama interleaved_1f1b v2": ("llama", "interleaved_1f1b", 2, V2, False, 4),
    "decoder packed interleaved_1f1b v2": ("decoder", "interleaved_1f1b", 4, V2, True, 5),
    "llama interleaved_zero_bubble v2": ("llama", "interleaved_zero_bubble", 2, V2, False, 4),
    "decoder packed interleaved_zero_bubble v2": (
        "decoder",
        "interleaved_zero_bubble",
        2,
        V2,
        True,
        5,
    ),
}


def family_is_moe(case: str) -> bool:
    return "moe" in CASES[case][0]


def _model(family: str, layers: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "decoder":
        cfg = ModelConfig(
            dim=32,
            n_layers=layers,
            n_heads=4,
            n_kv_heads=2,
            seq_len=SEQ,
            vocab_size=VOCAB,
            tie_embeddings=False,
        )
        return Transformer(cfg)
    import transformers as tf

    if family == "llama":
        config = tiny_config("llama")
        config.num_hidden_layers = layers
    else:  # sliding windows (6) shorter than SEQ, so their masks matter
        from tests.zoo_families import family_config

        sliding = {
            "mistral": dict(sliding_window=6),  # every layer
            "qwen2": dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
            "gemma3_text": dict(
                sliding_window=6,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                final_logit_softcapping=0.5,  # a cap that bites (logits reach ~0.4)
            ),
            "qwen2_moe": {},
            "qwen3_moe": {},
        }[family]
        name = {"qwen2": "qwen2_tied"}.get(family, family)  # the zoo's Qwen2, untied here
        config = family_config(
            name, num_hidden_layers=layers, vocab_size=VOCAB, tie_word_embeddings=False, **sliding
        )
    model = tf.AutoModelForCausalLM.from_config(config)
    # Without a cache transformers' mask builders split packed rows into their
    # documents (position_ids restarting), as the stages do.
    model.config.use_cache = False
    return model


def _batch(packed: bool = False) -> dict[str, torch.Tensor]:
    """ROWS rows; row i ignores its first 3i targets mod SEQ+2 (row 6: none
    valid). ``packed``: each row holds documents restarting at positions
    (row i: at 5 + i % 3 and 11), the position_ids every stage gets."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    for i in range(ROWS):
        labels[i, : (3 * i) % (SEQ + 2)] = -100
    batch = {"input_ids": ids, "labels": labels}
    if packed:
        positions = torch.arange(SEQ).repeat(ROWS, 1)
        for i in range(ROWS):
            for start in (5 + i % 3, 11):
                positions[i, start:] -= positions[i, start].clone()
        batch["position_ids"] = positions
    return batch


def _logits(model, ids, positions=None):
    out = model(ids, position_ids=positions)
    return out if isinstance(out, torch.Tensor) else out.logits


def _reference(model, packed=False) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process, the whole batch: the mean over every valid target."""
    batch, opt = _batch(packed), torch.optim.AdamW(model.parameters(), lr=1e-2)
    # Per document: a packed document's last token predicts nothing.
    labels = shift_labels(batch["labels"], batch.get("position_ids"))
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        logits = _logits(model, batch["input_ids"], batch.get("position_ids"))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        losses.append(float(loss.detach()))
        opt.step()
    return losses, norms, {k: v.detach().clone() for k, v in model.named_parameters()}


def _held_out(model, packed: bool) -> float:
    """The token sum of the loss of ``model`` on the batch, forward only."""
    batch = _batch(packed)
    with torch.no_grad():
        logits = _logits(model, batch["input_ids"], batch.get("position_ids"))
        labels = shift_labels(batch["labels"], batch.get("position_ids")).flatten()
        return float(F.cross_entropy(logits.flatten(0, 1), labels, reduction="sum"))


def _expected_names(full: torch.nn.Module, indices: tuple[int, ...], count: int) -> set[str]:
    """The parameters a rank holding stages ``indices`` of ``count`` keeps."""
    layers = [n for n in dict(full.named_modules()) if n.endswith("layers")][0]
    plans = plan_stages(len(full.get_submodule(layers)), count)
    held = {f"{layers}.{i}." for s in indices for i in plans[s].layers}
    first, last = 0 in indices, count - 1 in indices
    names = set()
    for name, _ in full.named_parameters():
        in_layers = name.startswith(f"{layers}.")
        head = any(k in name for k in ("lm_head", "output", "norm.weight")) and ".layers." not in (
            f".{name}"
        )
        if in_layers:
            keep = any(name.startswith(h) for h in held)
        elif "embed" in name:
            keep = first
        else:
            keep = last and head
        if keep:
            names.add(name)
    return names


def _run_case(
    family: str,
    schedule: str,
    micro: int,
    extra: dict | None = None,
    packed: bool = False,
    layers: int = 3,
) -> dict:
    from ray_fsdp_backend.metrics.router import RouterStats

    full = _model(family, layers)
    trained = copy.deepcopy(full)
    ref_router = RouterStats(trained)  # an MoE's per-layer expert load over the 3 steps
    ref_losses, ref_norms, ref_params = _reference(trained, packed)
    ref_load = ref_router.collect()
    ref_held_out = _held_out(trained, packed)
    settings = FSDPSettings(
        use_fsdp=True,
        use_mixed_precision=False,
        pipeline_parallel_size=2,
        pipeline_schedule=schedule,
        pipeline_microbatches=micro,
        **(extra or {}),
    )
    ctx = setup_process_context(settings, torch.device("cpu"))
    virtual = settings.pipeline_virtual_stages
    held = stage_indices(ctx.pp_rank, 2, virtual, schedule)
    model = ctx.wrap(copy.deepcopy(full))
    names = {n for n, _ in model.named_parameters()}
    router = ctx.router_stats(model)  # each stage counts its own layers
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = ROWS // ctx.dp_size
    mine = {k: v[ctx.dp_rank * rows : (ctx.dp_rank + 1) * rows] for k, v in _batch(packed).items()}
    errors = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = ctx.pipeline_step(model, mine)
        norm = ctx.clip_grad_norm(model, MAX_NORM)
        opt.step()
        # The rank's loss is its dp share; the mean over the dp ranks is the step's.
        mean = loss.clone()
        dist.all_reduce(mean)
        mean = float(mean) / dist.get_world_size()
        errors.append(abs(mean - ref_losses[step]) / ref_losses[step])
        errors.append(abs(float(norm) - ref_norms[step]) / ref_norms[step])
    load = router.collect()
    # Forward only through the stages (pipeline_eval): the token sum on every rank.
    held_out = pipeline_eval(ctx, model, mine)
    dist.all_reduce(held_out)
    held_out = float(held_out) * ctx.dp_size / dist.get_world_size()  # one copy per dp rank
    errors.append(abs(held_out - ref_held_out) / ref_held_out)
    params = 0.0
    for name, p in model.named_parameters():
        whole = p.full_tensor() if isinstance(p, DTensor) else p
        params = max(params, float((whole - ref_params[name]).abs().max()))
    return {
        "errors": errors,
        "params": params,
        "load": (load, ref_load),
        "names_ok": names == _expected_names(full, held, 2 * virtual),
        "held": len(names),
        "all": len(ref_params),
    }


def _train(extra: dict, micro: int) -> dict[str, list[float]]:
    """``run_training`` (the trainer's loop) on examples/cpu_tiny.yaml made
    tiny, with packed rows and 2 accumulated micro-batches of ``micro`` rows
    per dp rank; the logged loss and grad norm of each step."""
    settings = FSDPSettings(use_fsdp=True, use_mixed_precision=False, **extra)
    ctx = setup_process_context(settings, torch.device("cpu"))
    spec = load_spec(CPU_TINY, [*TRAIN_OVERRIDES, f"train.micro_batch_size={micro}"])
    history = run_training(ctx, spec, report=lambda metrics: None, resume=False)
    return {key: [m[key] for m in history] for key in ("loss", "grad_norm")}


def _load_and_export(pretrained: str, export: str) -> dict:
    """A tiny Llama checkpoint loaded into pp 2 x dp 2 stages, then exported."""
    from ray_fsdp_backend.hf.models import build_causal_lm

    settings = FSDPSettings(use_fsdp=True, use_mixed_precision=False, pipeline_parallel_size=2)
    ctx = setup_process_context(settings, torch.device("cpu"))
    model = ctx.wrap(build_causal_lm(pretrained))
    reader = ctx.load_pretrained(model, pretrained)
    ctx.export_model(model, export)
    return {"bytes": reader.bytes_read, "names": sorted(n for n, _ in model.named_parameters())}


def _caught(fn, *args):
    """``fn(*args)``, or its traceback: a case that raises on every rank (the
    usual way) fails its own test, and the spawn goes on to the next case."""
    try:
        return fn(*args)
    except Exception:
        return {"error": traceback.format_exc()}


def _trainer_runs() -> dict:
    # pp 2 x dp 2 (each dp rank 2 rows a micro-batch) against pp 1 x dp 4 (1
    # row): the same global rows, so the same losses.
    return {
        "pp2": _train(dict(pipeline_parallel_size=2, pipeline_microbatches=2), 2),
        "pp1": _train({}, 1),
    }


def _checks(rank, world, pretrained, export):
    results = {name: _caught(_run_case, *case) for name, case in CASES.items()}
    results["load export"] = _caught(_load_and_export, pretrained, export)
    results["trainer"] = _caught(_trainer_runs)
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    return gathered


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    return save_tiny_pretrained("llama", root / "pretrained"), str(root / "export")


@pytest.fixture(scope="module")
def results(checkpoint):
    return run_ranks(_checks, 4, *checkpoint)


def _tolerances(case: str) -> tuple[float, float]:
    """(relative loss / norm error, absolute parameter error). Packed rows'
    targets stop at each document's end (issue 55: they crossed documents
    before, in the stages and in this reference alike): step 1 still agrees
    to 1e-7, but over 3 AdamW steps the rounding grows to 3.3e-5 in the
    step-3 norm and 4.3e-4 in the weights (decoder, interleaved 1F1B, V 2;
    Gemma 3: 1.5e-4), measured, so packed cases get 5e-5 and 1e-3: a wrong
    gradient still moves a weight by the learning rate, 1e-2 a step."""
    packed = CASES[case][4] if len(CASES[case]) > 4 else False
    return (5e-5, 1e-3) if packed else (1e-5, 1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_steps_equal_one_process(results, case):
    rel, absolute = _tolerances(case)
    for rank, per_rank in enumerate(results):
        got = per_rank[case]
        assert "error" not in got, got.get("error")
        assert max(got["errors"][:2]) < 1e-5, (rank, got["errors"])  # step 1: as strict as ever
        assert max(got["errors"]) < rel, (rank, got["errors"])
        # AdamW divides by the gradients' root mean square: float noise of 1e-7
        # in a tiny gradient moves a weight by ~1e-5 over 3 steps of lr 1e-2.
        assert got["params"] < absolute, (rank, got["params"])
        load, ref_load = got["load"]  # every MoE layer's, on every rank; {} for dense models
        assert load == pytest.approx(ref_load, abs=1e-9), (rank, load, ref_load)
        assert len(load) == 3 * family_is_moe(case), (rank, load)


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_holds_only_its_stage_under_original_names(results, case):
    for rank, per_rank in enumerate(results):
        got = per_rank[case]
        assert "error" not in got, got.get("error")
        assert got["names_ok"], rank
        assert 0 < got["held"] < got["all"], (rank, got["held"], got["all"])


def test_trainer_loop_under_pipeline_equals_pp1(results):
    """``ray-fsdp train``'s loop at pp 2 x dp 2 (packed rows: their
    position_ids through both stages) logs pp 1 x dp 4's losses and norms."""
    for rank, per_rank in enumerate(results):
        assert "error" not in per_rank["trainer"], per_rank["trainer"]["error"]
        got, ref = per_rank["trainer"]["pp2"], per_rank["trainer"]["pp1"]
        for key in ("loss", "grad_norm"):
            assert len(got[key]) == len(ref[key]) == 3, (rank, key)
            for a, b in zip(got[key], ref[key], strict=True):
                assert abs(a - b) / abs(b) < 1e-5, (rank, key, got[key], ref[key])


def test_each_stage_reads_only_its_tensors_and_the_export_is_whole(results, checkpoint):
    """``load_pretrained`` on pp 2 x dp 2 stages: each rank reads only byte
    ranges of its stage's tensors, each byte of the checkpoint once over the
    ranks; ``export_model`` from the stages writes the whole model, which
    transformers loads with the checkpoint's weights and logits."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    pretrained, export = checkpoint
    sizes = {}
    for path in Path(pretrained).glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                sizes[key] = t.numel() * t.element_size()
    by_stage: dict[tuple, int] = {}
    for per_rank in results:
        got = per_rank["load export"]
        assert "error" not in got, got["error"]
        stage_bytes = sum(sizes[n] for n in got["names"])
        assert 0 < got["bytes"] <= stage_bytes < sum(sizes.values()), got
        by_stage[tuple(got["names"])] = by_stage.get(tuple(got["names"]), 0) + got["bytes"]
    assert len(by_stage) == 2
    assert sum(by_stage.values()) == sum(sizes.values())
    original = AutoModelForCausalLM.from_pretrained(pretrained).eval()
    exported = AutoModelForCausalLM.from_pretrained(export).eval()
    ids = _batch()["input_ids"]
    with torch.no_grad():
        assert torch.equal(original(ids).logits, exported(ids).logits)
