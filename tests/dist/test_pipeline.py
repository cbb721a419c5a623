"""Pipeline parallelism on real gloo ranks against one process (issue 47).

One spawned job on 4 ranks, mesh ``pp 2 x dp_shard 2``: a tiny
transformers Llama and the built-in decoder, each with 3 layers (stages of 2
and 1 layers), under the 1F1B and GPipe schedules; and the decoder at
``pp 2 x tp 2``. Every rank holds only its stage's parameters, under their
original names; 3 AdamW steps of
``ctx.pipeline_step`` plus ``ctx.clip_grad_norm`` (max_norm 0.5, so it
clips) give one process's loss and pre-clip norm (1e-5) and parameters
(1e-4 absolute: AdamW's normalised updates) on the whole
batch, whose labels hold -100 targets unevenly.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ray_fsdp_backend._worker import setup_process_context
from ray_fsdp_backend.config import FSDPSettings
from ray_fsdp_backend.context_parallel.sequence import shift_labels
from ray_fsdp_backend.pipeline import plan_stages
from ray_fsdp_backend.trainer.model import ModelConfig, Transformer
from tests.dist.harness import run_ranks
from tests.hf_models import VOCAB, tiny_config

SEQ, ROWS, STEPS, MAX_NORM = 16, 8, 3, 0.5
CASES = {
    "llama 1f1b": ("llama", "1f1b", 2),
    "llama gpipe": ("llama", "gpipe", 4),
    "decoder 1f1b": ("decoder", "1f1b", 4),
    "decoder gpipe": ("decoder", "gpipe", 2),
    "decoder 1f1b tp2": ("decoder", "1f1b", 2, {"tensor_parallel_size": 2}),
}


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "decoder":
        cfg = ModelConfig(
            dim=32,
            n_layers=3,
            n_heads=4,
            n_kv_heads=2,
            seq_len=SEQ,
            vocab_size=VOCAB,
            tie_embeddings=False,
        )
        return Transformer(cfg)
    import transformers as tf

    config = tiny_config("llama")
    config.num_hidden_layers = 3
    return tf.LlamaForCausalLM(config)


def _batch() -> dict[str, torch.Tensor]:
    """ROWS rows; row i ignores its first 3i targets mod SEQ+2 (row 6: none valid)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    for i in range(ROWS):
        labels[i, : (3 * i) % (SEQ + 2)] = -100
    return {"input_ids": ids, "labels": labels}


def _logits(model, ids):
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def _reference(model) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process, the whole batch: the mean over every valid target."""
    batch, opt = _batch(), torch.optim.AdamW(model.parameters(), lr=1e-2)
    labels = shift_labels(batch["labels"])
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        logits = _logits(model, batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        losses.append(float(loss.detach()))
        opt.step()
    return losses, norms, {k: v.detach().clone() for k, v in model.named_parameters()}


def _expected_names(full: torch.nn.Module, stage: int) -> set[str]:
    layers = [n for n in dict(full.named_modules()) if n.endswith("layers")][0]
    plan = plan_stages(3, 2)[stage]
    held = {f"{layers}.{i}." for i in plan.layers}
    names = set()
    for name, _ in full.named_parameters():
        in_layers = name.startswith(f"{layers}.")
        head = any(k in name for k in ("lm_head", "output", "norm.weight")) and ".layers." not in (
            f".{name}"
        )
        if in_layers:
            keep = any(name.startswith(h) for h in held)
        elif "embed" in name:
            keep = plan.first
        else:
            keep = plan.last and head
        if keep:
            names.add(name)
    return names


def _run_case(family: str, schedule: str, micro: int, extra: dict | None = None) -> dict:
    full = _model(family)
    ref_losses, ref_norms, ref_params = _reference(copy.deepcopy(full))
    settings = FSDPSettings(
        use_fsdp=True,
        use_mixed_precision=False,
        pipeline_parallel_size=2,
        pipeline_schedule=schedule,
        pipeline_microbatches=micro,
        **(extra or {}),
    )
    ctx = setup_process_context(settings, torch.device("cpu"))
    model = ctx.wrap(copy.deepcopy(full))
    names = {n for n, _ in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = ROWS // ctx.dp_size
    mine = {k: v[ctx.dp_rank * rows : (ctx.dp_rank + 1) * rows] for k, v in _batch().items()}
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
    params = 0.0
    for name, p in model.named_parameters():
        whole = p.full_tensor() if isinstance(p, DTensor) else p
        params = max(params, float((whole - ref_params[name]).abs().max()))
    return {
        "errors": errors,
        "params": params,
        "names_ok": names == _expected_names(full, ctx.pp_rank),
        "held": len(names),
        "all": len(ref_params),
    }


def _checks(rank, world):
    results = {name: _run_case(*case) for name, case in CASES.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    return gathered


@pytest.fixture(scope="module")
def results():
    return run_ranks(_checks, 4)


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_steps_equal_one_process(results, case):
    for rank, per_rank in enumerate(results):
        got = per_rank[case]
        assert max(got["errors"]) < 1e-5, (rank, got["errors"])
        # AdamW divides by the gradients' root mean square: float noise of 1e-7
        # in a tiny gradient moves a weight by ~1e-5 over 3 steps of lr 1e-2.
        assert got["params"] < 1e-4, (rank, got["params"])


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_holds_only_its_stage_under_original_names(results, case):
    for rank, per_rank in enumerate(results):
        got = per_rank[case]
        assert got["names_ok"], rank
        assert 0 < got["held"] < got["all"], (rank, got["held"], got["all"])
