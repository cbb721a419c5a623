"""Pure Hugging Face plans, in milliseconds: key rules as ``transformers``
maps keys, the export's file plan, safetensors headers against the
``safetensors`` library, and traversal in an index refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from ray_fsdp_backend.hf import PretrainedCheckpointError
from ray_fsdp_backend.hf.keys import resolve_key_rules, to_model_key
from ray_fsdp_backend.hf.reader import list_checkpoint_files, read_file_header
from ray_fsdp_backend.hf.safetensors_io import DTYPES, build_header
from ray_fsdp_backend.hf.writer import plan_export

CAUSAL = {"model.embed_tokens.weight", "model.layers.0.q.weight", "lm_head.weight"}
BASE = {"embed_tokens.weight", "layers.0.q.weight"}


def _map(checkpoint, model, **kw):
    rules = resolve_key_rules(checkpoint, model, prefix="model", **kw)
    return {k: to_model_key(k, rules, frozenset(model)) for k in checkpoint}


def test_prefix_added_into_head_model_and_stripped_into_base():
    assert _map(BASE, CAUSAL) == {k: f"model.{k}" for k in BASE}
    assert _map(CAUSAL, BASE) == {
        "model.embed_tokens.weight": "embed_tokens.weight",
        "model.layers.0.q.weight": "layers.0.q.weight",
        "lm_head.weight": None,  # the head: the base model has none
    }
    assert _map(CAUSAL, CAUSAL) == {k: k for k in CAUSAL}


def test_ignored_keys_inv_freq_and_missing():
    legacy = BASE | {"layers.0.self_attn.rotary_emb.inv_freq", "extra.bias"}
    got = _map(legacy, CAUSAL, buffers=["model.rotary_emb.inv_freq"], ignore_unexpected=["extra"])
    assert got["layers.0.self_attn.rotary_emb.inv_freq"] is None and got["extra.bias"] is None
    # without an inv_freq buffer the legacy key stays (and check_fits names it)
    assert _map(legacy, CAUSAL)["layers.0.self_attn.rotary_emb.inv_freq"] is not None
    rules = resolve_key_rules(BASE, CAUSAL, prefix="model", ignore_missing=[r"lm_head"])
    assert rules.missing_ok("lm_head.weight") and not rules.missing_ok("model.embed_tokens.weight")


def test_plan_export_balances_ranks_and_caps_files():
    sizes = {f"k{i}": 100 for i in range(10)}
    files = plan_export(sizes, max_bytes=10**9, world_size=2)
    assert [f.keys for f in files] == [
        tuple(f"k{i}" for i in range(5)),
        tuple(f"k{i}" for i in range(5, 10)),
    ]
    assert sorted(f.owner for f in files) == [0, 1]
    files = plan_export(sizes, max_bytes=250, world_size=3)
    assert all(sum(sizes[k] for k in f.keys) <= 250 for f in files)
    assert [k for f in files for k in f.keys] == list(sizes)  # order kept, nothing twice
    load = [sum(sizes[k] for f in files if f.owner == r for k in f.keys) for r in range(3)]
    assert max(load) - min(load) <= 200, load
    assert files[0].name == f"model-00001-of-{len(files):05d}.safetensors"


def test_plan_export_of_4000_parameters_is_fast():
    import time

    start = time.perf_counter()
    files = plan_export({f"p{i}": 4 * (i % 7 + 1) for i in range(4000)}, 10**4, 4)
    assert time.perf_counter() - start < 0.5
    assert sum(len(f.keys) for f in files) == 4000


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_header_is_what_safetensors_reads(tmp_path, name):
    dtype = DTYPES[name]
    a = torch.arange(6).reshape(2, 3).to(dtype)
    b = torch.ones(5).to(dtype)
    raw = build_header([("a", dtype, (2, 3)), ("b", dtype, (5,))])
    data = raw + a.contiguous().view(torch.uint8).numpy().tobytes()
    data += b.view(torch.uint8).numpy().tobytes()
    (tmp_path / "m.safetensors").write_bytes(data)
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert torch.equal(got["a"].view(torch.uint8), a.view(torch.uint8))
    assert torch.equal(got["b"].view(torch.uint8), b.view(torch.uint8))


def _write(path, header: dict, data: bytes = b"") -> None:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def test_unknown_dtype_is_named(tmp_path):
    import pyarrow.fs as pafs

    _write(
        tmp_path / "m.safetensors",
        {"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}},
        b"x",
    )
    with pytest.raises(
        PretrainedCheckpointError, match="unsupported dtype F4 in .*m.safetensors.* for 'w'"
    ):
        read_file_header(pafs.LocalFileSystem(), str(tmp_path / "m.safetensors"))


@pytest.mark.parametrize(
    "name", ["../../etc/x.safetensors", "/etc/x.safetensors", "a/../../x.safetensors"]
)
def test_index_naming_a_file_outside_is_refused(tmp_path, name):
    import pyarrow.fs as pafs

    index = {"metadata": {}, "weight_map": {"w": name}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PretrainedCheckpointError, match="outside the checkpoint directory"):
        list_checkpoint_files(pafs.LocalFileSystem(), str(tmp_path))
    index["weight_map"]["w"] = "sub/model-1.safetensors"  # a subdirectory is inside
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert list_checkpoint_files(pafs.LocalFileSystem(), str(tmp_path)) == [
        f"{tmp_path}/sub/model-1.safetensors"
    ]
