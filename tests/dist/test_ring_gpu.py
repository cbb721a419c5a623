"""Ring attention (torch's ``context_parallel``) on two GPUs against one
process (skipped without two CUDA devices; it has never run on CPU, where
torch's ring fails: pytorch#147793).

The project's decoder trains 3 AdamW steps at cp 2 with the ring backend
(load-balanced shards, ``ctx.sequence_region``): in fp32 with full heads
(the memory-efficient kernel) to 1e-4 of one process, in bf16 mixed
precision with grouped-query heads (flash) to 2e-2; ``ctx.wrap`` refuses
float32 grouped-query heads by name before any weight moves, and
``ctx.shard_sequence`` refuses packed rows. On one GPU, the per-document
kernel in bf16 takes a fused SDPA kernel (no warning) and warns once for a
soft-cap, which only the math form computes.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from ray_fsdp_backend.context_parallel import pack_documents, shard_sequence
from ray_fsdp_backend.context_parallel.attention import document_attention, document_spans
from ray_fsdp_backend.models.decoder import ModelConfig, Transformer
from ray_fsdp_backend.runtime.worker import setup_process_context
from ray_fsdp_backend.settings.config import FSDPSettings
from tests.dist.harness import run_ranks, train_step

SEQ, STEPS = 64, 3


def _config(kv_heads: int) -> ModelConfig:
    return ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=kv_heads, seq_len=SEQ)


def _rows() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids.clone()}


def _token_loss(logits, labels, count):
    flat = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
    return flat / count


def _steps(model, batch, count, ctx=None) -> tuple[list[float], list[float]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for _ in range(STEPS):
        region = ctx.sequence_region() if ctx is not None else torch.enable_grad()
        with region:
            loss = _token_loss(model(batch["input_ids"], batch["position_ids"]), *count)
            total, norm = train_step(model, loss, opt, ctx)
        losses.append(total)
        norms.append(norm)
    return losses, norms


def _one_process(kv_heads: int, gpu) -> tuple[list[float], list[float]]:
    torch.manual_seed(0)
    model = Transformer(_config(kv_heads)).to(gpu)
    batch = {k: v.to(gpu) for k, v in shard_sequence(_rows(), 0, 1).items()}
    return _steps(model, batch, (batch["labels"], (batch["labels"] != -100).sum()))


def _ring_context(rank: int, mixed: bool):
    """The context the backend builds for cp 2 with the ring backend on GPU ``rank``."""
    settings = FSDPSettings(
        use_fsdp=True,
        context_parallel_size=2,
        context_parallel_backend="ring",
        use_mixed_precision=mixed,
    )
    return setup_process_context(settings, torch.device("cuda", rank))


def _ring(rank, world, kv_heads: int, mixed: bool):
    gpu = torch.device("cuda", rank)
    ctx = _ring_context(rank, mixed)
    torch.manual_seed(0)
    model = ctx.wrap(Transformer(_config(kv_heads)))
    batch = {k: v.to(gpu) for k, v in ctx.shard_sequence(_rows()).items()}
    count = ctx.global_token_count(batch["labels"])
    return _steps(model, batch, (batch["labels"], count), ctx), _one_process(kv_heads, gpu)


def _refusals(rank, world) -> list[str]:
    ctx = _ring_context(rank, mixed=False)
    errors = []
    with pytest.raises(ValueError) as refused:
        ctx.wrap(Transformer(_config(kv_heads=2)))
    errors.append(str(refused.value))
    docs = [torch.arange(n) for n in (20, 50, 58)]
    with pytest.raises(ValueError) as refused:
        ctx.shard_sequence(pack_documents(docs, SEQ))
    errors.append(str(refused.value))
    return errors


def _all(rank, world):
    torch.cuda.set_device(rank)
    cases = {"fp32": (4, False), "bf16_gqa": (2, True)}
    results = {name: _ring(rank, world, *case) for name, case in cases.items()}
    results["refusals"] = _refusals(rank, world)
    return results


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, 2, backend="cpu:gloo,cuda:nccl")


@two_gpus
@pytest.mark.parametrize("case, rel", [("fp32", 1e-4), ("bf16_gqa", 2e-2)])
def test_ring_trains_like_one_process(results, case, rel):
    (losses, norms), (ref_losses, ref_norms) = results[case]
    assert losses == pytest.approx(ref_losses, rel=rel)
    assert norms == pytest.approx(ref_norms, rel=rel)
    assert ref_losses[-1] < ref_losses[0]


@two_gpus
def test_ring_refuses_fp32_grouped_query_heads_and_packed_rows_by_name(results):
    wrap_error, shard_error = results["refusals"]
    assert "grouped-query heads (4 query, 2 key/value) in float32" in wrap_error
    assert "packed rows" in shard_error and "'ring'" in shard_error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_document_kernel_is_fused_and_softcap_warns_once():
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 2, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    docs = [torch.arange(n) for n in (100, 300, 112, 512)]
    spans = document_spans(pack_documents(docs, 512)["position_ids"].cuda(), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no math kernel behind the user's back
        document_attention(q, k, v, spans)
        document_attention(q, k, v, spans, window=128)
    with pytest.warns(UserWarning, match="math kernel.*softcap"):
        document_attention(q, k, v, spans, softcap=30.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        document_attention(q, k, v, spans, softcap=30.0)  # once
