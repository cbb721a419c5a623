"""``model: pretrained:`` in the training YAML, and ``ray-fsdp plan`` on a
pretrained config: counts from ``config.json`` alone, no weights."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ray_fsdp_backend.cli.main import main
from ray_fsdp_backend.trainer.schema.pretrained import PretrainedModelConfig
from ray_fsdp_backend.trainer.schema.spec import apply_overrides, build_spec, check_spec, load_yaml

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "finetune_hf.yaml"


def _llama_8b_config(path) -> str:
    """Llama-3-8B's published shape, ``config.json`` only."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
    ).save_pretrained(path)  # fmt: skip
    return str(path)


def test_example_yaml_builds_a_pretrained_model_section(tmp_path):
    assert load_yaml(EXAMPLE)["model"]["pretrained"] == "/tmp/rfb-tiny-llama"
    path = _llama_8b_config(tmp_path / "llama")
    spec = build_spec(apply_overrides(load_yaml(EXAMPLE), [f"model.pretrained={path}"]))
    assert isinstance(spec.model, PretrainedModelConfig)
    assert spec.model.pretrained == path and spec.model.seq_len == 64


@pytest.mark.parametrize(
    ("model", "data", "words"),
    [
        ({"pretrained": 3}, {}, "pretrained=3 must be a path or URI"),
        ({"pretrained": "/x", "dim": 64}, {}, "model.dim=64: not a key next to model.pretrained"),
        ({"pretrained": "/x", "seq_len": 1}, {}, "seq_len=1 must be an int >= 2"),
        ({"pretrained": "/x"}, {"source": "ray_data", "path": "/d"}, "data.source='corpus'"),
        ({"pretrained": "/x", "lora": {"r": 0}}, {}, "model.lora.r=0 must be a positive int"),
        ({"pretrained": "/x", "lora": {"rank": 8}}, {}, "model.lora: unknown key(s) ['rank']"),
        ({"pretrained": "/x", "lora": {"alpha": -1}}, {}, "model.lora.alpha=-1"),
        ({"pretrained": "/x", "lora": {"target_modules": "q"}}, {}, "target_modules='q'"),
        ({"pretrained": "/x", "base_dtype": "fp16"}, {}, "base_dtype='fp16' is not one of"),
        ({"pretrained": "/x", "export_format": "peft"}, {}, "it needs model.lora"),
    ],
)
def test_bad_pretrained_sections_are_named(model, data, words):
    doc = {"distributed": {"use_fsdp": True}, "model": model, "data": data}
    assert any(words in e for e in check_spec(doc)), check_spec(doc)


def test_plan_counts_parameters_from_config_json(tmp_path, capsys):
    path = _llama_8b_config(tmp_path / "llama-3-8b")
    rc = main(
        ["plan", str(EXAMPLE), "--nodes", "1", "--gpus-per-node", "8",
         "--set", f"model.pretrained={path}", "--set", "distributed.use_mixed_precision=true"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    # Llama-3-8B: 8,030,261,248 parameters in 32 blocks of 218,112,000.
    assert "8,030.3M parameters (32 blocks of 218.11M)" in out, out


LORA_EXAMPLE = EXAMPLE.with_name("finetune_lora.yaml")


def test_plan_counts_frozen_base_and_adapters(tmp_path, capsys):
    path = _llama_8b_config(tmp_path / "llama-3-8b")
    argv = ["plan", str(LORA_EXAMPLE), "--nodes", "1", "--gpus-per-node", "8",
            "--set", f"model.pretrained={path}", "--set", "model.base_dtype=bf16"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    # r=8 on q_proj (4096 -> 4096) and v_proj (4096 -> 1024) in 32 blocks: 3.4M adapters.
    assert "frozen base 8,030.3M (bf16, 1.9 GiB per GPU), adapters 3.408M trainable" in out, out
    gradients = re.search(r"\n  gradients\s+(\S+) (\S+)", out).groups()
    assert gradients == ("1.6", "MiB"), out  # 3.4M fp32 gradients over 8 GPUs


def test_lora_target_matching_no_layer_is_named(tmp_path):
    from ray_fsdp_backend.trainer.schema.pretrained import _sizes

    path = _llama_8b_config(tmp_path / "llama")
    doc = load_yaml(LORA_EXAMPLE) | {"model": {
        "pretrained": path, "lora": {"target_modules": ["q_proj", "qkv"]}}}  # fmt: skip
    _sizes.cache_clear()
    with pytest.raises(ValueError, match=r"target_modules=\['q_proj', 'qkv'\]: \['qkv'\] match"):
        build_spec(doc)


def test_train_refuses_lora_target_matching_no_layer_before_ray(tmp_path, monkeypatch, capsys):
    """``ray-fsdp train`` checks the targets on the driver (a meta model from
    ``config.json``) and exits before ``ray.init``."""
    import ray
    from transformers import LlamaConfig

    def no_cluster(*args, **kwargs):
        raise AssertionError("ray.init called before the LoRA targets were checked")

    monkeypatch.setattr(ray, "init", no_cluster)
    path = tmp_path / "llama"
    LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2).save_pretrained(path)  # fmt: skip
    argv = ["train", str(LORA_EXAMPLE), "--set", f"model.pretrained={path}",
            "--set", "model.lora.target_modules=[q_proj, qkv]",
            "--set", f"run.storage_path={tmp_path / 'runs'}"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "model.lora.target_modules=['q_proj', 'qkv']: ['qkv'] match no linear layer" in err, err
    linear = [
        "down_proj",
        "gate_proj",
        "k_proj",
        "lm_head",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert f"its linear layers are {linear}" in err, err
    assert not ray.is_initialized()
    assert not (tmp_path / "runs").exists()
