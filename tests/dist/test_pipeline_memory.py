"""What a pipeline rank holds, measured against the plan (issue 55, item 8).

Under PP torch 2.13's ``PipelineStage`` runs every micro-batch's backward
without gradient sync or resharding and reduces once, in
``perform_reduce_grad``, after the last; the backend keeps
``reshard_after_forward`` off. So just before that call each rank holds its
stage's parameters unsharded (compute dtype) and their gradients unsharded
(``fsdp_reduce_dtype``) on top of what it held before the step.

On 4 gloo ranks, ``pp 2 x dp_shard 2`` with ``pipeline_split: [1, 3]`` (the
runtime split follows it), 4 micro-batches of 1F1B through
``ctx.pipeline_step``: the bytes of every live CPU tensor storage (found by
the garbage collector, each storage once) at the start of
``perform_reduce_grad``, less the same count before the step (after a
warm-up step and ``zero_grad``), equal
:func:`~ray_fsdp_backend.planning.pipeline_plan.stage_memory`'s unsharded
parameters and gradients for the stage the plan gives the rank, within 10%,
in fp32 (8 bytes a parameter) and in bf16 with fp32 reduction (6: the plan
before this issue counted the stage's 16 bytes of state over 2 ranks, 8).
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import stage as torch_stage
from torch.distributed.tensor import DTensor

from ray_fsdp_backend.models.decoder import ModelConfig, Transformer
from ray_fsdp_backend.planning.pipeline_layout import plan_stages
from ray_fsdp_backend.planning.pipeline_plan import stage_memory, stage_params
from ray_fsdp_backend.runtime.worker import setup_process_context
from ray_fsdp_backend.settings.config import FSDPSettings
from tests.dist.harness import run_ranks

SPLIT, MICRO, SEQ = [1, 3], 4, 4
CONFIG = ModelConfig(
    dim=64, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=SEQ, vocab_size=64, tie_embeddings=False
)
CASES = {
    "fp32": dict(use_mixed_precision=False),
    "bf16 reduce fp32": dict(use_mixed_precision=True, fsdp_reduce_dtype="fp32"),
}


def _live_bytes() -> int:
    """Bytes of every live CPU tensor storage, each storage once: the tensors
    the garbage collector finds (a DTensor counted through its local tensor)
    and the ``.grad`` of every parameter among them (autograd holds a
    gradient in C++, where the collector does not look)."""
    gc.collect()
    sizes: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on torch's deprecated module attributes
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    grads = [t.grad for t in tensors if isinstance(t, torch.nn.Parameter) and t.grad is not None]
    for tensor in tensors + grads:
        if isinstance(tensor, DTensor) or tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        sizes[storage.data_ptr()] = max(sizes.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(sizes.values())


def _held(extra: dict) -> dict:
    settings = FSDPSettings(
        use_fsdp=True,
        pipeline_parallel_size=2,
        pipeline_microbatches=MICRO,
        pipeline_split=SPLIT,
        **extra,
    )
    ctx = setup_process_context(settings, torch.device("cpu"))
    torch.manual_seed(0)
    model = ctx.wrap(Transformer(CONFIG))
    plan = plan_stages(CONFIG.n_layers, 2, SPLIT)[ctx.pp_rank]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, CONFIG.vocab_size, (MICRO, SEQ), generator=torch.Generator())
    batch = {"input_ids": ids, "labels": ids.clone()}
    ctx.pipeline_step(model, batch)  # warm-up: shape inference, receive buffers
    opt.step()
    opt.zero_grad(set_to_none=True)
    before = _live_bytes()
    at_reduce: list[int] = []
    original = torch_stage._PipelineStageBase.perform_reduce_grad

    def measured(stage, grad_scale_factor):
        at_reduce.append(_live_bytes())  # every backward done, nothing reduced yet
        return original(stage, grad_scale_factor)

    # A probe that calls torch's own method: torch 2.13's schedules call it once
    # a step, after the last micro-batch's backward.
    torch_stage._PipelineStageBase.perform_reduce_grad = measured
    try:
        ctx.pipeline_step(model, batch)
    finally:
        torch_stage._PipelineStageBase.perform_reduce_grad = original
    embedding = CONFIG.vocab_size * CONFIG.dim
    params = stage_params(
        plan, CONFIG.block_params(), embedding, CONFIG.embedding_params() - embedding
    )
    compute = 2 if settings.use_mixed_precision else 4
    planned = stage_memory(params, shard=ctx.dp_size, value_bytes=compute, reduce_bytes=4)
    held_layers = tuple(int(i) for i in model.layers._modules)
    return {
        "held": at_reduce[0] - before,
        "planned": planned.params + planned.grads,
        "params": params,
        "layers": (held_layers, plan.layers),
        "calls": len(at_reduce),
    }


def _all(rank, world):
    results = {name: _held(extra) for name, extra in CASES.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    return gathered


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, 4)


@pytest.mark.parametrize("case", list(CASES))
def test_a_pp_rank_holds_its_unsharded_stage_as_planned(results, case):
    for rank, per_rank in enumerate(results):
        got = per_rank[case]
        held, planned = got["held"], got["planned"]
        assert got["calls"] == 1, got
        assert got["layers"][0] == got["layers"][1], (rank, got["layers"])  # pipeline_split
        assert abs(held - planned) <= 0.1 * planned, (rank, case, held, planned, got["params"])
