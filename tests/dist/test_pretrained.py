"""``load_pretrained`` on real gloo ranks against ``from_pretrained`` in one process.

One spawned job per world size loads every tiny model (Llama, GPT-2,
Qwen3-MoE; tied and untied; shards spread over several files) under every
strategy and compares the logits on one batch with the single-process
``AutoModelForCausalLM.from_pretrained`` logits.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.tensor import DTensor

from ray_fsdp_backend import FSDPConfig, build_strategy, load_pretrained
from ray_fsdp_backend.pretrained.hf import build_causal_lm
from tests.dist.harness import run_ranks
from tests.hf_models import input_ids, save_tiny_pretrained

pytest.importorskip("transformers")

STRATEGIES = ["full_shard", "shard_grad_op", "hybrid_shard", "_hybrid_shard_zero2", "ddp", "dmuon"]
MODELS = [("llama", False), ("llama", True), ("gpt2", True), ("qwen3_moe", False)]


def _config(name: str) -> FSDPConfig:
    if name == "ddp":
        return FSDPConfig(use_fsdp=False, use_mixed_precision=False)
    if name == "dmuon":
        return FSDPConfig(use_fsdp=True, use_dmuon=True, use_mixed_precision=False)
    return FSDPConfig(use_fsdp=True, fsdp_sharding_strategy=name, use_mixed_precision=False)


def _reference_logits(path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids()).logits


def _logits(model) -> torch.Tensor:
    model.eval()  # as from_pretrained returns it: GPT-2's dropout off
    with torch.no_grad():
        out = model(input_ids()).logits
    return out.full_tensor() if isinstance(out, DTensor) else out


def _load_all(rank, world, dirs):
    """Every model under every strategy: (what, max abs diff, bytes read)."""
    results = []
    for (kind, tied), path in dirs.items():
        for name in STRATEGIES:
            strategy = build_strategy(_config(name), device=torch.device("cpu"), local_rank=rank)
            model = strategy.wrap(build_causal_lm(path))
            reader = load_pretrained(model, path)
            if name == "dmuon":
                from ray_fsdp_backend import dmuon

                dmuon.Muon(model, lr=0.0)  # an optimizer built after the load sees it
            results.append(((kind, tied, name), _logits(model), reader.bytes_read))
            inner = getattr(model, "module", model)
            if tied:
                assert inner.get_input_embeddings().weight is inner.get_output_embeddings().weight
    return results


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    dirs = {}
    for kind, tied in MODELS:
        path = str(tmp_path_factory.mktemp(f"{kind}_{int(tied)}"))
        save_tiny_pretrained(
            kind, path, tied=tied, dtype=torch.bfloat16 if kind == "gpt2" else torch.float32
        )
        dirs[(kind, tied)] = path
    return dirs


@pytest.mark.parametrize("world", [2, 4])
def test_logits_equal_from_pretrained(pretrained, world):
    dirs = pretrained if world == 2 else {k: v for k, v in pretrained.items() if k[0] == "llama"}
    results = run_ranks(_load_all, world, dirs)
    assert len(results) == len(dirs) * len(STRATEGIES)
    for (kind, tied, name), logits, _ in results:
        want = _reference_logits(dirs[(kind, tied)])
        torch.testing.assert_close(
            logits, want, atol=1e-5, rtol=1e-5, msg=f"{kind} tied={tied} {name}"
        )


def _bytes_read(rank, world, path, name):
    from tests.counting_fs import CountingFileSystem

    strategy = build_strategy(_config(name), device=torch.device("cpu"), local_rank=rank)
    model = strategy.wrap(build_causal_lm(path))
    counting = CountingFileSystem()
    load_pretrained(model, path, filesystem=counting.filesystem)
    peers = [None] * world
    torch.distributed.all_gather_object(peers, counting.bytes_read)
    return peers, _logits(model)


@pytest.mark.parametrize(
    ("world", "name", "low", "high"), [(4, "full_shard", 0.15, 0.5), (2, "ddp", 1.0, 1.1)]
)
def test_each_rank_reads_its_share(pretrained, world, name, low, high):
    """Bytes through a counting filesystem: about 1/world of the checkpoint
    per rank when sharded (the whole of it under DDP, which holds it all)."""
    path = pretrained[("llama", False)]
    total = sum(
        os.path.getsize(os.path.join(path, f))
        for f in os.listdir(path)
        if f.endswith(".safetensors")
    )
    per_rank, logits = run_ranks(_bytes_read, world, path, name)
    for got in per_rank:
        assert low * total <= got <= high * total, (name, per_rank, total)
    torch.testing.assert_close(logits, _reference_logits(path), atol=1e-5, rtol=1e-5)
