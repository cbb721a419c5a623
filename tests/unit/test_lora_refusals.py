"""LoRA layouts the backend does not train, refused by key before any work."""

from __future__ import annotations

import pytest
import torch

from ray_fsdp_backend.context import refuse_modules_to_save
from ray_fsdp_backend.trainer.spec import check_spec
from tests.hf_models import tiny_config

peft = pytest.importorskip("peft")


def test_spec_refuses_lora_with_tensor_parallelism_naming_both_keys():
    doc = {
        "distributed": {"use_fsdp": True, "tensor_parallel_size": 2},
        "model": {"pretrained": "/x", "lora": {"r": 4}},
    }
    errors = check_spec(doc)
    assert any("model.lora with distributed.tensor_parallel_size=2" in e for e in errors), errors
    assert not any("tp_plan" in e for e in errors)  # no plan to suggest: none works
    doc["distributed"]["tensor_parallel_size"] = 1
    assert not any("model.lora" in e for e in check_spec(doc))


def test_spec_refuses_modules_to_save_as_an_unknown_lora_key():
    doc = {
        "distributed": {"use_fsdp": True},
        "model": {"pretrained": "/x", "lora": {"modules_to_save": ["lm_head"]}},
    }
    assert any("model.lora: unknown key(s) ['modules_to_save']" in e for e in check_spec(doc))


def _meta_llama():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config("llama"))


def test_wrap_refuses_a_peft_model_with_modules_to_save():
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(ValueError, match=r"modules_to_save=\['lm_head'\] is not supported"):
        refuse_modules_to_save(peft.get_peft_model(_meta_llama(), config))
    plain = peft.LoraConfig(r=4, target_modules=["q_proj"])
    refuse_modules_to_save(peft.get_peft_model(_meta_llama(), plain))
