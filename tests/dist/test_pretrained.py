"""``load_pretrained`` on real gloo ranks against ``from_pretrained`` in one process.

One spawned job per world size (4, then 2) runs every case of the module:
it loads every tiny model (Llama, GPT-2, Qwen3-MoE; tied and untied; shards
spread over several files) under every strategy and compares the logits on
one batch with the single-process ``AutoModelForCausalLM.from_pretrained``
logits; counts the bytes each rank reads; fine-tunes and exports in the HF
layout (reloaded in a fresh process); and loads from an S3 API.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.tensor import DTensor

from ray_fsdp_backend import FSDPConfig, build_strategy, load_pretrained
from ray_fsdp_backend.hf.models import build_causal_lm
from tests.dist.harness import run_ranks
from tests.hf_models import fine_tune, input_ids, save_tiny_pretrained

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


# (world, strategy, low, high): the bytes a rank reads, as a share of the checkpoint
SHARES = [(4, "full_shard", 0.15, 0.5), (2, "ddp", 0.95, 1.1)]
EXPORTS = [("gpt2", True, "full_shard"), ("qwen3_moe", False, "ddp")]
S3_URI = "s3://pretrained/llama"


def _world_four(rank, world, dirs, path):
    llama = {k: v for k, v in dirs.items() if k[0] == "llama"}
    return {
        "logits": _load_all(rank, world, llama),
        "full_shard": _bytes_read(rank, world, path, "full_shard"),
    }


def _world_two(rank, world, dirs, path, out, fs):
    results = {"logits": _load_all(rank, world, dirs), "ddp": _bytes_read(rank, world, path, "ddp")}
    for kind, tied, name in EXPORTS:
        export = os.path.join(out, kind)
        results[kind] = _finetune_export(rank, world, dirs[(kind, tied)], export, name)
    results["s3"] = _load_from_s3(rank, world, fs, S3_URI)
    return results


@pytest.fixture(scope="module")
def spawned(pretrained, s3_server, tmp_path_factory):
    """World size -> what its one spawned job returned (``"exports"``: where
    the 2-rank job exported)."""
    import pyarrow.fs as pafs

    fs = s3_server.filesystem()
    fs.create_dir("pretrained")
    pafs.copy_files(pretrained[("llama", True)], S3_URI[5:], destination_filesystem=fs)
    out = str(tmp_path_factory.mktemp("exports"))
    path = pretrained[("llama", False)]
    return {
        4: run_ranks(_world_four, 4, pretrained, path),
        2: run_ranks(_world_two, 2, pretrained, path, out, fs),
        "exports": out,
    }


@pytest.mark.parametrize("world", [2, 4])
def test_logits_equal_from_pretrained(pretrained, spawned, world):
    dirs = pretrained if world == 2 else {k: v for k, v in pretrained.items() if k[0] == "llama"}
    results = spawned[world]["logits"]
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


@pytest.mark.parametrize(("world", "name", "low", "high"), SHARES)
def test_each_rank_reads_its_share(pretrained, spawned, world, name, low, high):
    """Bytes through a counting filesystem: about 1/world of the checkpoint
    per rank when sharded (the whole of it under DDP, which holds it all;
    the headers are read by rank 0 alone)."""
    path = pretrained[("llama", False)]
    total = sum(
        os.path.getsize(os.path.join(path, f))
        for f in os.listdir(path)
        if f.endswith(".safetensors")
    )
    per_rank, logits = spawned[world][name]
    for got in per_rank:
        assert low * total <= got <= high * total, (name, per_rank, total)
    torch.testing.assert_close(logits, _reference_logits(path), atol=1e-5, rtol=1e-5)


# -- fine-tune, export in HF layout, reload in a fresh process ---------------------------


def _finetune_export(rank, world, path, out, name):
    strategy = build_strategy(_config(name), device=torch.device("cpu"), local_rank=rank)
    model = strategy.wrap(build_causal_lm(path))
    load_pretrained(model, path)
    fine_tune(model, rank, world, steps=3)
    from ray_fsdp_backend.hf import export_model

    export_model(model, os.path.join(out, "fp32"), max_shard_size="20KB", dtype=torch.float32)
    export_model(model, os.path.join(out, "default"))
    return _logits(model)


_FRESH = """
import json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
ids = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save(model(ids).logits, sys.argv[3])
"""


def _fresh_logits(path, tmp_path) -> torch.Tensor:
    """``from_pretrained`` in a new interpreter that never imports this package."""
    import subprocess
    import sys

    torch.save(input_ids(), tmp_path / "ids.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(
        [sys.executable, "-c", _FRESH, path, str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
        check=True,
        env=env,
        cwd=tmp_path,
    )
    return torch.load(tmp_path / "out.pt")


@pytest.mark.parametrize(("kind", "tied", "name"), EXPORTS)
def test_export_hf_loads_with_from_pretrained(pretrained, spawned, tmp_path, kind, tied, name):
    import json

    path = pretrained[(kind, tied)]
    out = os.path.join(spawned["exports"], kind)
    wrapped = spawned[2][kind]
    fp32 = os.path.join(out, "fp32")
    files = sorted(f for f in os.listdir(fp32) if f.endswith(".safetensors"))
    assert len(files) > 2 and not any(f.startswith(".") for f in os.listdir(fp32))
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= set(
        os.listdir(fp32)
    )
    got = _fresh_logits(fp32, tmp_path)
    torch.testing.assert_close(got, wrapped, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, _reference_logits(path), atol=1e-3)  # it did train
    # Default dtype: the checkpoint's (bf16 for the GPT-2 one); one file per rank (< 5 GB).
    with open(os.path.join(out, "default", "config.json")) as f:
        want = "bfloat16" if kind == "gpt2" else "float32"
        assert json.load(f)["dtype"] == want
    with open(os.path.join(out, "default", "model.safetensors.index.json")) as f:
        assert set(json.load(f)["weight_map"].values()) == {
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        }


# -- object storage ---------------------------------------------------------------------


def _load_from_s3(rank, world, fs, uri):
    strategy = build_strategy(_config("full_shard"), device=torch.device("cpu"), local_rank=rank)
    model = strategy.wrap(build_causal_lm(uri, filesystem=fs))
    reader = load_pretrained(model, uri, filesystem=fs)
    peers = [None] * world
    torch.distributed.all_gather_object(peers, reader.bytes_read)
    return peers, _logits(model)


def test_load_from_s3_api(pretrained, spawned):
    """The checkpoint and its config on a real S3 API (moto's server on
    loopback), read through the ``pyarrow.fs.S3FileSystem`` a Ray run takes."""
    path = pretrained[("llama", True)]
    per_rank, logits = spawned[2]["s3"]
    torch.testing.assert_close(logits, _reference_logits(path), atol=1e-5, rtol=1e-5)
    weights = sum(
        os.path.getsize(os.path.join(path, f))
        for f in os.listdir(path)
        if f.endswith(".safetensors")
    )
    assert all(0.3 * weights < got < 0.75 * weights for got in per_rank), (per_rank, weights)
