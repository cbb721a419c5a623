"""LoRA helpers in one process: PEFT names, adapter init on meta models,
adapter layouts, and the refusals (milliseconds; tiny meta models)."""

from __future__ import annotations

import pytest
import torch

from ray_fsdp_backend.compat.peft import (
    adapter_layout,
    describe_layout,
    frozen_is_random,
    is_peft_model,
    note_frozen_loaded,
)
from ray_fsdp_backend.strategies.blocks import materialize_meta_module
from tests.hf_models import tiny_config

peft = pytest.importorskip("peft")


def _meta_peft(**lora):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(tiny_config("llama"))
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **lora)
    return peft.get_peft_model(base, peft.LoraConfig(**config))


def test_materialize_gives_peft_init_and_marks_the_base_random():
    model = _meta_peft()
    assert is_peft_model(model)
    materialize_meta_module(model, "cpu")
    named = dict(model.named_parameters())
    a, b = (
        named[f"base_model.model.model.layers.0.self_attn.q_proj.lora_{x}.default.weight"]
        for x in "AB"
    )
    assert torch.count_nonzero(b) == 0 and torch.count_nonzero(a) == a.numel()
    # PEFT's kaiming_uniform(a=sqrt(5)) bound for fan_in 32: 1/sqrt(32).
    assert float(a.abs().max()) <= 32**-0.5
    assert frozen_is_random(model)
    note_frozen_loaded(model)
    assert not frozen_is_random(model)


@pytest.mark.parametrize(("field", "value"), [("init_lora_weights", "pissa"), ("use_dora", True)])
def test_meta_init_refuses_adapters_derived_from_base_weights(field, value):
    model = _meta_peft()
    # Set after construction: peft itself cannot build these on a meta base.
    setattr(model.peft_config["default"], field, value)
    with pytest.raises(ValueError, match=field):
        materialize_meta_module(model, "cpu")


def test_peft_names_map_base_and_adapter_keys():
    from ray_fsdp_backend.hf.peft import peft_names

    model = _meta_peft()
    names = peft_names(model, list(model.state_dict()))
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert names.base[f"{q}.base_layer.weight"] == "model.layers.0.self_attn.q_proj.weight"
    assert names.base["base_model.model.lm_head.weight"] == "lm_head.weight"
    assert names.adapters[f"{q}.lora_A.default.weight"] == ("default", f"{q}.lora_A.weight")
    assert len(names.adapters) == 2 * 2 * 2  # A and B, q and v, 2 layers


def test_peft_names_with_a_task_type():
    """``task_type`` gives a ``PeftModel`` subclass: the same names."""
    from ray_fsdp_backend.hf.peft import peft_names

    model = _meta_peft(task_type="CAUSAL_LM")
    assert type(model).__name__ == "PeftModelForCausalLM"
    names = peft_names(model, list(model.state_dict()))
    assert names.base["base_model.model.model.norm.weight"] == "model.norm.weight"
    assert len(names.adapters) == 8


def test_adapter_config_of_another_rank_is_refused():
    from ray_fsdp_backend.hf.peft import check_adapter_config
    from ray_fsdp_backend.hf.reader import PretrainedCheckpointError

    model = _meta_peft()
    good = {"peft_type": "LORA", "r": 4, "target_modules": ["v_proj", "q_proj"]}
    assert check_adapter_config(model, good, where="x") == "default"
    with pytest.raises(PretrainedCheckpointError, match=r"r=8 in adapter_config.json, r=4"):
        check_adapter_config(model, {**good, "r": 8}, where="x")
    with pytest.raises(PretrainedCheckpointError, match="target_modules"):
        check_adapter_config(model, {**good, "target_modules": ["q_proj"]}, where="x")


def test_adapter_layout_from_shapes():
    shapes = {
        "model.m.layers.0.q_proj.lora_A.default.weight": (8, 32),
        "model.m.layers.0.q_proj.lora_B.default.weight": (32, 8),
        "optim.state.m.layers.1.v_proj.lora_A.default.weight.exp_avg": (8, 32),
        "model.m.layers.0.q_proj.base_layer.weight": (32, 32),
        "optim.step": None,
    }
    layout = adapter_layout(shapes)
    assert layout == {"q_proj": [8], "v_proj": [8]}
    assert describe_layout(layout) == "q_proj r=8, v_proj r=8"
    assert describe_layout({}) == "no LoRA adapters"


def test_other_peft_methods_get_their_own_init_on_meta():
    """IA3 through ``reset_ia3_parameters`` (scales of one: the base model),
    LoHa through ``reset_adapter_parameters`` (w2_b zero: the base model)."""
    from transformers import AutoModelForCausalLM

    for config, name, want in [
        (peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
         "ia3_l", 1.0),
        (peft.LoHaConfig(r=4, target_modules=["q_proj"]), "hada_w2_b", 0.0),
    ]:  # fmt: skip
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(tiny_config("llama"))
        model = peft.get_peft_model(base, config)
        materialize_meta_module(model, "cpu")
        values = [p for n, p in model.named_parameters() if f".{name}." in n]
        assert values and all(torch.all(p == want) for p in values), name


def test_peft_export_keeps_the_adapters_dtype_as_peft_save_pretrained(tmp_path):
    """A bf16 checkpoint under fp32 adapters: ``format="peft"`` writes what
    peft's own ``save_pretrained`` writes (fp32), not the checkpoint's bf16;
    ``dtype=`` still casts."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ray_fsdp_backend.hf import export_model, load_pretrained
    from tests.hf_models import save_tiny_pretrained

    path = save_tiny_pretrained("llama", tmp_path / "bf16", dtype=torch.bfloat16)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    load_pretrained(model, path)  # the export's default dtype is the checkpoint's
    model.save_pretrained(tmp_path / "peft")
    export_model(model, tmp_path / "ours", format="peft")
    export_model(model, tmp_path / "cast", format="peft", dtype=torch.bfloat16)
    want, got, cast = (
        load_file(tmp_path / d / "adapter_model.safetensors") for d in ("peft", "ours", "cast")
    )
    assert {v.dtype for v in want.values()} == {torch.float32}
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert {v.dtype for v in cast.values()} == {torch.bfloat16}
