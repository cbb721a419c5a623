"""MoE exports in each family's own checkpoint layout, against transformers.

One process, tiny configs: ``export_model`` of a gpt-oss, MiniMax, Mixtral
and Qwen3-MoE model writes the keys (and tensors) ``save_pretrained``
writes, decided by transformers' conversion mapping, and
``from_pretrained`` of the export gives the model's logits (a re-initialised
expert would not).
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from ray_fsdp_backend.hf.export import export_model

transformers = pytest.importorskip("transformers")

FAMILIES = {
    "gpt_oss": dict(
        num_local_experts=4, rope_parameters={"rope_type": "default", "rope_theta": 1e4}
    ),
    "minimax": dict(num_local_experts=4, layer_types=["full_attention", "full_attention"]),
    "mixtral": dict(num_local_experts=4),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=16),
}


def tiny_moe(family: str):
    config = transformers.AutoConfig.for_model(
        family,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        **FAMILIES[family],
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # biases and routers that matter (gpt-oss inits them to 0)
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_writes_save_pretrained_layout_and_reloads(tmp_path, family):
    model = tiny_moe(family)
    model.save_pretrained(tmp_path / "reference")
    export_model(model, tmp_path / "export", dtype=torch.float32)
    want, got = _tensors(tmp_path / "reference"), _tensors(tmp_path / "export")
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
