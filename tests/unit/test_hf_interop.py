"""``load_pretrained`` and ``export_model`` in one process against what
``transformers`` itself does: base-model checkpoints into head models and
back, legacy ``inv_freq`` tensors, every safetensors dtype, an export
through ``filesystem=`` that ``from_pretrained`` and ``AutoTokenizer`` read,
and an export of 4,000 parameters in seconds."""

from __future__ import annotations

import os
import time

import pyarrow.fs as pafs
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ray_fsdp_backend.hf import export_model, load_pretrained
from tests.hf_models import input_ids, save_tiny_pretrained, tiny_config

tf = pytest.importorskip("transformers")


def _fresh(cls, kind):
    torch.manual_seed(7)  # other values than the checkpoint's
    return cls.from_config(tiny_config(kind, tied=True)).eval()


def _out(model):
    with torch.no_grad():
        out = model(input_ids())
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_base_checkpoint_into_head_model_and_back(tmp_path, kind):
    torch.manual_seed(0)
    tf.AutoModel.from_config(tiny_config(kind, tied=True)).save_pretrained(tmp_path / "base")
    model = _fresh(tf.AutoModelForCausalLM, kind)
    load_pretrained(model, tmp_path / "base")
    want = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    torch.testing.assert_close(_out(model), _out(want.eval()), atol=0, rtol=0)

    save_tiny_pretrained(kind, tmp_path / "causal", tied=True)
    model = _fresh(tf.AutoModel, kind)
    load_pretrained(model, tmp_path / "causal")
    want = tf.AutoModel.from_pretrained(tmp_path / "causal", dtype=torch.float32)
    torch.testing.assert_close(_out(model), _out(want.eval()), atol=0, rtol=0)


def test_legacy_inv_freq_tensors_are_ignored(tmp_path):
    path = save_tiny_pretrained("llama", tmp_path / "ckpt", tied=True, max_shard_size="1GB")
    state = load_file(f"{path}/model.safetensors")
    for layer in range(2):
        state[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = torch.rand(4)
    save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    model = _fresh(tf.AutoModelForCausalLM, "llama")
    load_pretrained(model, path)
    want = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.testing.assert_close(_out(model), _out(want.eval()), atol=0, rtol=0)


DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.uint16,
    torch.int16,
    torch.uint32,
    torch.int32,
    torch.uint64,
    torch.int64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e8m0fnu,
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
]


@pytest.fixture(scope="module")
def llama_state(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_pretrained("llama", path, tied=True, max_shard_size="1GB")
    return str(path), load_file(f"{path}/model.safetensors")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_loads_as_from_pretrained_does(tmp_path, llama_state, dtype):
    src, state = llama_state
    state = dict(state)
    state["model.norm.weight"] = torch.tensor([1, 2, 3, 0] * 8).to(dtype)  # numbers, not bits
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    tiny_config("llama", tied=True).save_pretrained(tmp_path)
    model = _fresh(tf.AutoModelForCausalLM, "llama")
    load_pretrained(model, tmp_path)
    want = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert model.model.norm.weight[:4].tolist() == want.model.norm.weight[:4].tolist()
    torch.testing.assert_close(_out(model), _out(want.eval()), atol=0, rtol=0)


def test_complex_into_a_real_parameter_is_named(tmp_path, llama_state):
    _, state = llama_state
    state = dict(state)
    state["model.norm.weight"] = torch.ones(32, dtype=torch.complex64)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = _fresh(tf.AutoModelForCausalLM, "llama")
    with pytest.raises(
        ValueError, match=r"unsupported dtype C64 in .*model.safetensors.* for 'model.norm.weight'"
    ):
        load_pretrained(model, tmp_path)


def test_export_through_filesystem_loads_with_transformers(tmp_path, llama_state):
    src, _ = llama_state
    model = _fresh(tf.AutoModelForCausalLM, "llama")
    load_pretrained(model, src)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)  # "fine-tuned"
    (tmp_path / "store").mkdir()
    store = pafs.SubTreeFileSystem(str(tmp_path / "store"), pafs.LocalFileSystem())
    assert (
        export_model(model, "exports/ft", filesystem=store, max_shard_size="20KB") == "exports/ft"
    )
    out = tmp_path / "store" / "exports" / "ft"
    assert not os.path.exists("exports") and sorted(os.listdir(tmp_path)) == ["store"]
    assert not any(name.endswith(".tmp") for name in os.listdir(out))
    got = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(_out(got.eval()), _out(model), atol=0, rtol=0)
    text = "the quick brown fox"
    want = tf.AutoTokenizer.from_pretrained(src)(text)["input_ids"]
    assert tf.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == want


def test_export_of_4000_parameters_takes_seconds(tmp_path):
    model = nn.ParameterList(nn.Parameter(torch.full((3,), float(i))) for i in range(4000))
    start = time.perf_counter()
    export_model(model, tmp_path / "many", max_shard_size="8KB")
    took = time.perf_counter() - start
    files = sorted(f for f in os.listdir(tmp_path / "many") if f.endswith(".safetensors"))
    got = {}
    for f in files:
        got.update(load_file(tmp_path / "many" / f))
    assert len(got) == 4000 and torch.equal(got["3999"], torch.full((3,), 3999.0))
    assert took < 10, took  # was 99 s: the tied-weight check ran once per key


def test_bad_format_and_unknown_scheme_fail_before_writing(tmp_path):
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="format='onnx' is not one of hf, safetensors, peft"):
        export_model(model, tmp_path / "x", format="onnx")
    with pytest.raises(ValueError, match="max_shard_size"):
        export_model(model, tmp_path / "x", max_shard_size="lots")
    with pytest.raises(ValueError, match="nosuchscheme://bucket/x"):
        export_model(model, "nosuchscheme://bucket/x")
    assert os.listdir(tmp_path) == []


def test_single_file_export_of_a_pipeline_stage_is_refused_before_writing(tmp_path):
    # Rank 0 of a pp run holds the first stage only: one file from it would
    # silently miss every later stage's layers.
    from ray_fsdp_backend.models.decoder import ModelConfig, Transformer
    from ray_fsdp_backend.pipeline.split import split_for_stage

    config = ModelConfig(dim=16, n_layers=2, n_heads=2, vocab_size=32, tie_embeddings=False)
    stage = split_for_stage(Transformer(config), 0, 2)
    for path, format in ((tmp_path / "m.safetensors", "hf"), (tmp_path / "m", "safetensors")):
        with pytest.raises(ValueError, match="format='safetensors'.*use format='hf'"):
            export_model(stage, path, format=format)
    assert os.listdir(tmp_path) == []
