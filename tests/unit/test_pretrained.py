"""``load_pretrained`` in one process on a plain model: key maps, tied
weights, fused experts, and the errors raised before any weight is read."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from ray_fsdp_backend.hf import PretrainedCheckpointError, load_pretrained
from ray_fsdp_backend.hf.entries import TensorEntry
from ray_fsdp_backend.hf.experts import fuse_experts
from tests.counting_fs import CountingFileSystem
from tests.models import ToyNet, reference_model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save_sharded(state: dict, path, files: int = 2) -> str:
    """``state`` as ``files`` safetensors files plus an HF index."""
    os.makedirs(path, exist_ok=True)
    keys = sorted(state)
    weight_map = {}
    for i in range(files):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {k: state[k].contiguous().clone() for k in keys[i::files]}
        save_file(part, os.path.join(path, name))
        weight_map.update(dict.fromkeys(part, name))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return str(path)


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_loads_sharded_dir_and_single_file(tmp_path):
    want = reference_model(seed=1).state_dict()
    for path in (_save_sharded(want, tmp_path / "dir"), str(tmp_path / "one.safetensors")):
        if path.endswith(".safetensors"):
            save_file({k: v.clone() for k, v in want.items()}, path)
        model = reference_model(seed=2)
        load_pretrained(model, path)
        for k, v in want.items():
            torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=0)


def test_casts_to_parameter_dtype_and_keeps_ties(tmp_path):
    source = reference_model(seed=1, dim_in=16, dim_out=16, tied=True)
    state = {k: v.to(torch.bfloat16) for k, v in source.state_dict().items() if k != "head.weight"}
    path = _save_sharded(state, tmp_path / "ckpt")
    model = reference_model(seed=2, dim_in=16, dim_out=16, tied=True)
    load_pretrained(model, path)
    assert model.head.weight is model.inp.weight and model.inp.weight.dtype == torch.float32
    torch.testing.assert_close(model.inp.weight, state["inp.weight"].float(), rtol=0, atol=0)


def test_key_map_dict_and_callable(tmp_path):
    want = reference_model(seed=1).state_dict()
    path = _save_sharded({f"backbone.{k}": v for k, v in want.items()}, tmp_path / "ckpt")
    for key_map in ({f"backbone.{k}": k for k in want}, lambda k: k.removeprefix("backbone.")):
        model = reference_model(seed=2)
        load_pretrained(model, path, key_map=key_map)
        torch.testing.assert_close(model.state_dict()["head.weight"], want["head.weight"])


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda s: s.pop("head.weight"), ["1 keys missing", "head.weight"]),
        (lambda s: s.update(extra=torch.zeros(2)), ["not in the model", "extra"]),
        (
            lambda s: s.update({"inp.weight": torch.zeros(3, 3)}),
            [
                "of another shape",
                "inp.weight (checkpoint [3, 3] in ",
                ".safetensors, model [16, 8]",
            ],
        ),
    ],
)
def test_mismatch_fails_before_reading_weights(tmp_path, change, words):
    state = dict(reference_model(seed=1).state_dict())
    change(state)
    path = _save_sharded(state, tmp_path / "ckpt")
    model = reference_model(seed=2)
    before = _params(model)
    counting = CountingFileSystem()
    with pytest.raises(PretrainedCheckpointError) as err:
        load_pretrained(model, path, filesystem=counting.filesystem)
    for word in [str(path), *words]:
        assert word in str(err.value)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert counting.bytes_read < 2048  # the index and the headers only


def test_many_missing_keys_are_counted(tmp_path):
    model = ToyNet(n_layers=6)
    path = _save_sharded({"inp.weight": model.inp.weight.detach()}, tmp_path / "ckpt")
    with pytest.raises(PretrainedCheckpointError, match=r"25 keys missing .* and 20 more"):
        load_pretrained(model, path)


def test_corrupt_and_missing_files_are_named(tmp_path):
    path = _save_sharded(reference_model(seed=1).state_dict(), tmp_path / "ckpt")
    victim = os.path.join(path, "model-00002-of-00002.safetensors")
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 10)
    with pytest.raises(
        PretrainedCheckpointError, match="model-00002-of-00002.safetensors.*truncated"
    ):
        load_pretrained(reference_model(), path)
    with open(victim, "wb") as f:
        f.write(b"\xff" * 64)
    with pytest.raises(PretrainedCheckpointError, match="model-00002-of-00002.safetensors"):
        load_pretrained(reference_model(), path)
    os.remove(victim)
    with pytest.raises(
        PretrainedCheckpointError, match="model-00002-of-00002.safetensors.*missing"
    ):
        load_pretrained(reference_model(), path)
    with pytest.raises(PretrainedCheckpointError, match="does not exist"):
        load_pretrained(reference_model(), tmp_path / "nowhere")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(PretrainedCheckpointError, match="not a Hugging Face checkpoint"):
        load_pretrained(reference_model(), tmp_path / "empty")


def _entry(key, shape):
    return TensorEntry("f.safetensors", key, torch.float32, shape, 0, 0)


def test_fuse_experts_plans_stacked_tensors():
    ckpt = {"m.0.mlp.gate.weight": _entry("g", (4, 8))}
    for e in range(4):
        for name, shape in [("gate_proj", (3, 8)), ("up_proj", (3, 8)), ("down_proj", (8, 3))]:
            key = f"m.0.mlp.experts.{e}.{name}.weight"
            ckpt[key] = _entry(key, shape)
    model = {
        "m.0.mlp.gate.weight": (4, 8),
        "m.0.mlp.experts.gate_up_proj": (4, 6, 8),
        "m.0.mlp.experts.down_proj": (4, 8, 3),
    }
    fused = fuse_experts(ckpt, model)
    assert set(fused) == set(model)
    assert fused["m.0.mlp.experts.gate_up_proj"].shape == (4, 6, 8)
    assert [e.key for e in fused["m.0.mlp.experts.gate_up_proj"].parts[2]] == [
        "m.0.mlp.experts.2.gate_proj.weight",
        "m.0.mlp.experts.2.up_proj.weight",
    ]
    mixtral = {k.replace(".mlp.", ".block_sparse_moe."): v for k, v in ckpt.items()}
    mixtral = {
        k.replace("gate_proj", "w1").replace("up_proj", "w3").replace("down_proj", "w2"): v
        for k, v in mixtral.items()
    }
    assert set(fuse_experts(mixtral, model)) == set(model)


def test_core_never_imports_transformers():
    import subprocess
    import sys

    code = (
        "import sys, ray_fsdp_backend as r\n"
        "import ray_fsdp_backend.cli.main, ray_fsdp_backend.trainer.loop.train\n"
        "r.load_pretrained, r.get_context\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})
