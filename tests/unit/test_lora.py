"""LoRA helpers in one process: PEFT names, adapter init on meta models,
adapter layouts, and the refusals (milliseconds; tiny meta models)."""

from __future__ import annotations

import pytest
import torch

from ray_fsdp_backend.strategies.blocks import materialize_meta_module
from ray_fsdp_backend.strategies.peft import (
    adapter_layout,
    describe_layout,
    frozen_is_random,
    is_peft_model,
    note_frozen_loaded,
)
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
