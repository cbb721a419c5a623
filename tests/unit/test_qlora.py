"""QLoRA's NF4 quantisation in one process: the shard checks and the bitwise match."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ray_fsdp_backend.hf import load_pretrained
from ray_fsdp_backend.ops.quantization import (
    Target,
    apply_nf4,
    check_nf4_shards,
    nf4_bytes,
    nf4_bytes_per_param,
    nf4_targets,
    quantize_shard,
)

torchao = pytest.importorskip("torchao")


def test_shards_that_do_not_divide_the_blocks_are_refused_by_name():
    ok = Target("a.weight", (256, 256), (64, 256), 4)
    small = Target("b.weight", (128, 256), (32, 256), 4)
    uneven = Target("c.weight", (258, 256), (65, 256), 4)
    check_nf4_shards([ok])
    with pytest.raises(ValueError) as err:
        check_nf4_shards([ok, small, uneven])
    message = str(err.value)
    assert "cannot quantise 2 weights" in message and "a.weight" not in message
    assert "b.weight [128, 256]: shard [32, 256] holds 8192 elements" in message
    assert "block 64 x scaler block 256 = 16384" in message
    assert "c.weight [258, 256]: dim 0 (258) over 4 shards" in message


def test_a_model_that_does_not_divide_is_refused_before_any_read(tmp_path):
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    model.requires_grad_(False)
    with pytest.raises(ValueError, match=r"0.weight \[16, 16\]: shard \[16, 16\] holds 256"):
        load_pretrained(model, tmp_path / "never-read", quantize="nf4")
    with pytest.raises(ValueError, match="quantize='int4' is not one of nf4"):
        load_pretrained(model, tmp_path / "never-read", quantize="int4")


def test_targets_are_the_frozen_linear_weights_but_the_head():
    from transformers import AutoModelForCausalLM

    from tests.hf_models import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("llama_qlora"))
    model.requires_grad_(False)
    names = [t.name for t in nf4_targets(model)]
    assert len(names) == 2 * 7 and "lm_head.weight" not in names
    assert "model.layers.0.self_attn.q_proj.weight" in names


def test_a_lora_targeted_head_stays_dense():
    """With ``lm_head`` among the LoRA targets the head is a peft layer: its
    ``base_layer`` is still the head and is not quantised."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from tests.hf_models import tiny_config

    base = AutoModelForCausalLM.from_config(tiny_config("llama_qlora"))
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"])
    names = [t.name for t in nf4_targets(peft.get_peft_model(base, config))]
    assert len(names) == 2 * 7 and not any("lm_head" in n for n in names)
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_shard_is_to_nf4_bitwise_and_its_bytes_are_counted(dtype):
    from torchao.quantization import to_nf4

    weight = torch.randn(128, 256, generator=torch.Generator().manual_seed(0)).to(dtype)
    got, want = quantize_shard(weight, None), to_nf4(weight)
    for part in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
        assert torch.equal(getattr(got, part), getattr(want, part)), part
    model = nn.Linear(256, 128, bias=False).to(dtype).requires_grad_(False)
    with torch.no_grad():
        model.weight.copy_(weight)
    apply_nf4(model, nf4_targets(model))
    per_param = nf4_bytes_per_param(weight.element_size())
    assert nf4_bytes(model) == {"nf4": weight.numel() * per_param, "dense": 0}
    x = torch.randn(3, 256).to(dtype)
    assert torch.equal(model(x), x @ want.get_original_weight().t())


# -- model.lora.base_quantization in the training YAML ------------------------------------

QLORA = {"pretrained": "/x", "lora": {"base_quantization": "nf4"}}


@pytest.mark.parametrize(
    ("distributed", "model", "words"),
    [
        ({"use_fsdp": False}, QLORA, "base_quantization='nf4' with distributed.use_fsdp=false"),
        (
            {"use_fsdp": True, "use_dmuon": True},
            QLORA,
            "base_quantization='nf4' with distributed.use_dmuon=true",
        ),
        (
            {"use_fsdp": True, "tensor_parallel_size": 2},
            QLORA,
            "base_quantization='nf4' with distributed.tensor_parallel_size=2",
        ),
        (
            {"use_fsdp": True},
            {"pretrained": "/x", "lora": {"base_quantization": "int4"}},
            "model.lora.base_quantization='int4' is not one of nf4",
        ),
        (
            {"use_fsdp": True},
            {"pretrained": "/x", "base_quantization": "nf4"},
            "unknown model config key(s) ['base_quantization']",
        ),
    ],
)
def test_yaml_refusals_name_the_key(distributed, model, words):
    from ray_fsdp_backend.trainer.schema.spec import check_spec

    doc = {"distributed": distributed, "model": model, "train": {"optimizer": "adamw"}}
    errors = check_spec(doc)
    assert any(words in e for e in errors), errors


def test_the_example_builds_with_nf4(tmp_path):
    """Once the checkpoint its header makes exists (``model.pretrained`` is
    checked for a ``config.json`` before anything starts)."""
    from pathlib import Path

    from ray_fsdp_backend.models.tiny_pretrained import save_tiny_pretrained
    from ray_fsdp_backend.trainer.schema.spec import apply_overrides, build_spec, load_yaml

    example = Path(__file__).resolve().parents[2] / "examples" / "finetune_qlora.yaml"
    tiny = save_tiny_pretrained("llama_qlora", tmp_path / "tiny")
    spec = build_spec(apply_overrides(load_yaml(example), [f"model.pretrained={tiny}"]))
    assert spec.model.lora.base_quantization == "nf4"


def test_plan_counts_the_nf4_base(tmp_path, capsys):
    from pathlib import Path

    from transformers import LlamaConfig

    from ray_fsdp_backend.cli.main import main

    LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
    ).save_pretrained(tmp_path / "llama-3-8b")  # fmt: skip
    example = Path(__file__).resolve().parents[2] / "examples" / "finetune_qlora.yaml"
    argv = ["plan", str(example), "--nodes", "1", "--gpus-per-node", "8",
            "--set", f"model.pretrained={tmp_path / 'llama-3-8b'}",
            "--set", "model.base_dtype=bf16"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    # 6.98B linear weights in NF4 (0.5157 B), 1.05B embeddings/head/norms in bf16.
    assert "frozen base 8,030.3M (nf4 + bf16, 0.71 B/param, 679.7 MiB per GPU)" in out, out
