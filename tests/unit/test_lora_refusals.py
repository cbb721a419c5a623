"""LoRA layouts the backend does not train, refused by key before any work."""

from __future__ import annotations

import pytest
import torch

from ray_fsdp_backend.runtime.context import refuse_modules_to_save
from ray_fsdp_backend.trainer.schema.spec import check_spec
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


def test_wrap_refuses_lora_on_a_tied_output_head_by_name():
    """LoRA on ``lm_head`` tied to the embedding crashed ``ctx.wrap`` of a
    meta-built model (``KeyError: attribute 'weight' already exists``);
    it is refused naming both modules. An untied head, or a tied model
    without the head among the targets, passes."""
    from transformers import AutoModelForCausalLM

    from ray_fsdp_backend.compat.peft import refuse_tied_adapters

    def lora(tied: bool, targets: list[str]):
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(tiny_config("llama", tied=tied))
        return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=targets))

    message = r"peft adapter on 'base_model.model.lm_head': its base weight is tied to "
    with pytest.raises(ValueError, match=message + r"'base_model.model.model.embed_tokens.weight'"):
        refuse_tied_adapters(lora(True, ["q_proj", "lm_head"]))
    refuse_tied_adapters(lora(False, ["q_proj", "lm_head"]))
    refuse_tied_adapters(lora(True, ["q_proj"]))
