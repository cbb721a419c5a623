"""Hugging Face checkpoints on a real S3 API (moto's server on loopback) from
2 gloo ranks: load with concurrent ranged reads, fine-tune, export straight
into the bucket; the export, downloaded, loads with ``from_pretrained`` and
``AutoTokenizer`` and gives the wrapped model's logits.

One spawned job runs every check. Every request to the store goes through
:class:`tests.counting_fs.RoundTrips`, which adds 50 ms to each and records
them: the round trips a rank waits for one after another must be at most the
number of files (not one per slice), every file's header is fetched once in
all, and each rank uploads about its share of the weights.
"""

from __future__ import annotations

import os

import pyarrow.fs as pafs
import pytest
import torch

from ray_fsdp_backend import FSDPConfig, build_strategy
from ray_fsdp_backend.hf import export_model, load_pretrained
from ray_fsdp_backend.hf.models import build_causal_lm, load_tokenizer
from tests.counting_fs import RoundTrips
from tests.dist.harness import run_ranks
from tests.hf_models import fine_tune, input_ids, save_tiny_pretrained

pytest.importorskip("transformers")

SOURCE, EXPORT = "hf-src/llama", "hf-out/llama-ft"


def _logits(model) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    model.eval()
    with torch.no_grad():
        out = model(input_ids()).logits
    return out.full_tensor() if isinstance(out, DTensor) else out


def _load_train_export(rank, world, s3):
    config = FSDPConfig(use_fsdp=True, use_mixed_precision=False)
    strategy = build_strategy(config, device=torch.device("cpu"), local_rank=rank)
    meta = RoundTrips(s3, latency=0.0)
    model = strategy.wrap(build_causal_lm(f"s3://{SOURCE}", filesystem=meta.filesystem))
    load_tokenizer(f"s3://{SOURCE}", filesystem=meta.filesystem)
    metadata_opens = [c[1].rsplit("/", 1)[-1] for c in meta.calls if c[0] == "open"]
    timed = RoundTrips(s3, latency=0.05)
    reader = load_pretrained(model, f"s3://{SOURCE}", filesystem=timed.filesystem)
    loaded = _logits(model)
    load_calls, sequential = list(timed.calls), timed.sequential()
    slices = len(reader.entries)
    model.train()
    fine_tune(model, rank, world)
    export_model(model, f"s3://{EXPORT}", filesystem=timed.filesystem, max_shard_size="20KB")
    trained = _logits(model)
    everyone = [None] * world
    mine = (load_calls, sequential, slices, timed.bytes_written, reader.bytes_read, metadata_opens)
    torch.distributed.all_gather_object(everyone, mine)
    return loaded, trained, everyone


@pytest.fixture(scope="module")
def run(s3_server, tmp_path_factory, monkeypatch_module):
    src = str(tmp_path_factory.mktemp("src"))
    save_tiny_pretrained("llama", src, max_shard_size="8KB")  # many files, several per rank
    s3 = s3_server.filesystem()
    for bucket in ("hf-src", "hf-out"):
        s3.create_dir(bucket)
    pafs.copy_files(src, SOURCE, destination_filesystem=s3)
    cwd = tmp_path_factory.mktemp("cwd")
    tmp = tmp_path_factory.mktemp("tmp")
    monkeypatch_module.chdir(cwd)
    monkeypatch_module.setenv("TMPDIR", str(tmp))  # the ranks' temporary files land here
    loaded, trained, per_rank = run_ranks(_load_train_export, 2, s3)
    local = str(tmp_path_factory.mktemp("downloaded"))
    pafs.copy_files(EXPORT, local, source_filesystem=s3)
    return dict(
        src=src,
        s3=s3,
        cwd=cwd,
        tmp=tmp,
        local=local,
        loaded=loaded,
        trained=trained,
        ranks=per_rank,
    )


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _reference_logits(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids()).logits


def _weight_files(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def test_load_reads_concurrently_and_headers_once(run):
    torch.testing.assert_close(run["loaded"], _reference_logits(run["src"]), atol=1e-5, rtol=1e-5)
    files = _weight_files(run["src"])
    headers = [c for r in run["ranks"] for c in r[0] if c[0] == "read" and c[2:] == (0, 8)]
    assert sorted(c[1].rsplit("/", 1)[-1] for c in headers) == files, headers  # once per file
    for calls, sequential, slices, _, _, _ in run["ranks"]:
        reads = [c for c in calls if c[0] == "read"]
        print(f"{len(reads)} reads, {slices} tensors, {len(files)} files: {sequential} sequential")
        assert slices > len(files) and len(reads) > len(files)
        assert sequential <= len(files), (sequential, len(files), calls)


def test_export_lands_in_the_bucket_and_loads(run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert os.listdir(run["cwd"]) == [] and os.listdir(run["tmp"]) == []  # nothing local
    local = run["local"]
    names = set(os.listdir(local))
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= names
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    assert len(_weight_files(local)) >= 2
    model = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
    with torch.no_grad():
        got = model(input_ids()).logits
    torch.testing.assert_close(got, run["trained"], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, run["loaded"], atol=1e-3)  # it did train
    text = "the quick brown fox"
    want = AutoTokenizer.from_pretrained(run["src"])(text)["input_ids"]
    assert AutoTokenizer.from_pretrained(local)(text)["input_ids"] == want


def test_each_rank_uploads_its_share(run):
    local = run["local"]
    sizes = {f: os.path.getsize(os.path.join(local, f)) for f in os.listdir(local)}
    weights = sum(sizes[f] for f in _weight_files(local))
    written = [r[3] for r in run["ranks"]]
    print(f"export {weights} B of weights; uploaded per rank {written}")
    assert sum(written) == sum(sizes.values())  # no byte twice; configs by rank 0
    assert all(0.35 * weights <= w <= 0.65 * weights + 20_000 for w in written), (written, weights)


def test_metadata_downloaded_by_rank0_only(run):
    """config.json and the tokenizer files come from the store once per
    build, on rank 0; the other ranks get the bytes by broadcast."""
    first, *others = [r[5] for r in run["ranks"]]
    assert first.count("config.json") == 2 and "tokenizer.json" in first, first  # model, tokenizer
    assert others == [[]] * len(others), others
