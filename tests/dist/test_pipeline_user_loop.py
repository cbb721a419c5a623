"""``ctx.pipeline_step`` / ``pipeline_eval`` in a loop of one's own (issue 55).

One spawned job on 2 gloo ranks, ``pp 2`` (a tiny transformers Llama, 3
layers: stages of 2 and 1), each case against one process on the same rows
whose labels hold -100 targets unevenly:

- ``pipeline_eval`` (``ray_fsdp_backend.pipeline.step``) between
  ``pipeline_step`` and ``opt.step()``, of the step's shape and of another:
  torch 2.13's shape inference cleanup set every gradient to None, so the
  clip norm read 0 and the step did nothing. Every gradient after the
  evaluations equals its value before them, and the norm and the
  parameters after the step equal one process's.
- Packed rows given as ``labels`` + ``position_ids``: the targets are
  shifted per document (a document's last token predicts nothing), so the
  loss and the norm equal one process's ``shift_labels(labels, positions)``
  rule (before, the targets crossed documents).
"""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ray_fsdp_backend.context_parallel.sequence import shift_labels
from ray_fsdp_backend.pipeline.step import pipeline_eval
from ray_fsdp_backend.runtime.worker import setup_process_context
from ray_fsdp_backend.settings.config import FSDPSettings
from tests.dist.harness import run_ranks
from tests.dist.test_pipeline import _batch, _logits, _model

MAX_NORM = 0.5


def _one_process(model, batch) -> tuple[float, float, dict[str, torch.Tensor]]:
    """Loss, pre-clip norm and parameters after one AdamW step on one process,
    the targets shifted per document."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    labels = shift_labels(batch["labels"], batch.get("position_ids"))
    logits = _logits(model, batch["input_ids"], batch.get("position_ids"))
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    opt.step()
    return float(loss), norm, {k: v.detach().clone() for k, v in model.named_parameters()}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _one_step(packed: bool, evaluate: bool) -> dict:
    """One ``pipeline_step`` + clip + AdamW step at pp 2 on the whole batch
    (``evaluate``: two ``pipeline_eval`` calls before the clip), against one
    process."""
    full = _model("llama")
    batch = _batch(packed)
    ref_loss, ref_norm, ref_params = _one_process(copy.deepcopy(full), batch)
    settings = FSDPSettings(use_fsdp=True, use_mixed_precision=False, pipeline_parallel_size=2)
    ctx = setup_process_context(settings, torch.device("cpu"))
    model = ctx.wrap(copy.deepcopy(full))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = float(ctx.pipeline_step(model, batch))
    before = {n: _whole(p.grad) for n, p in model.named_parameters()}
    grads_kept = True
    if evaluate:
        pipeline_eval(ctx, model, batch)
        pipeline_eval(ctx, model, {k: v[:4] for k, v in batch.items()})  # a new shape
        grads_kept = all(
            p.grad is not None and torch.equal(_whole(p.grad), before[n])
            for n, p in model.named_parameters()
        )
    norm = float(ctx.clip_grad_norm(model, MAX_NORM))
    opt.step()
    params = max(
        float((_whole(p) - ref_params[n]).abs().max()) for n, p in model.named_parameters()
    )
    return {
        "grads_kept": grads_kept,
        "loss": (loss, ref_loss),
        "norm": (norm, ref_norm),
        "params": params,
    }


def _caught(fn, *args):
    try:
        return fn(*args)
    except Exception:
        return {"error": traceback.format_exc()}


CASES = {"eval between step and opt.step": (False, True), "packed labels": (True, False)}


def _checks(rank, world):
    return {name: _caught(_one_step, *args) for name, args in CASES.items()}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_checks, 2)


@pytest.mark.parametrize("case", list(CASES))
def test_user_loop_step_equals_one_process(results, case):
    got = results[case]
    assert "error" not in got, got.get("error")
    assert got["grads_kept"]
    for key in ("loss", "norm"):
        value, want = got[key]
        assert abs(value - want) / want < 1e-5, (key, value, want)
    assert got["params"] < 1e-4, got["params"]


def test_packed_rule_differs_from_a_shift_across_documents():
    """The packed case proves something: shifting without the positions
    scores targets that cross documents, a different loss."""
    model, batch = _model("llama"), _batch(packed=True)
    with torch.no_grad():
        logits = _logits(model, batch["input_ids"], batch["position_ids"]).flatten(0, 1)
    per_document = shift_labels(batch["labels"], batch["position_ids"]).flatten()
    across = shift_labels(batch["labels"]).flatten()
    assert (per_document != -100).sum() < (across != -100).sum()
    assert (
        abs(float(F.cross_entropy(logits, per_document) - F.cross_entropy(logits, across))) > 1e-3
    )
