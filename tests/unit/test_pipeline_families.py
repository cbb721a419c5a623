"""The pipeline split of the Gemma and mixture-of-experts families (issue 47),
in one process: two stages chained give the whole model's logits, with and
without packed rows; the variants a stage cannot reproduce are refused by
name (no Ray, no process group)."""

from __future__ import annotations

import copy

import pytest
import torch

from ray_fsdp_backend.pipeline.split import split_for_stage
from tests.zoo_families import SEQ, VOCAB, build_family, family_config

THREE_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
FAMILIES = {
    "gemma": {},
    # a cap that bites: the logits reach ~0.45 uncapped
    "gemma2": dict(final_logit_softcapping=0.5),
    "gemma3_text": dict(final_logit_softcapping=0.5, layer_types=THREE_TYPES),
    "qwen2_moe": {},
    "qwen3_moe": {},
    "mixtral": {},
    "gpt_oss": dict(layer_types=THREE_TYPES),
}


def _positions() -> torch.Tensor:
    """Two packed rows: documents restarting at 13 and at 20 + row."""
    positions = torch.arange(SEQ).repeat(2, 1)
    for row in range(2):
        for start in (13, 20 + row):
            positions[row, start:] -= positions[row, start].clone()
    return positions


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_stages_chain_to_the_whole_models_logits(family, packed):
    model = build_family(family, num_hidden_layers=3, **FAMILIES[family])
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    positions = _positions() if packed else None
    with torch.no_grad():
        expected = model(ids, position_ids=positions).logits
        first, last = (split_for_stage(copy.deepcopy(model), s, 2) for s in range(2))
        got = last(first(ids, position_ids=positions), position_ids=positions)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # The balanced split (the embedding and the head a layer each): 3 layers
    # on 2 stages are 1 and 2, the extra layer on the last stage.
    assert first.model.layers._modules.keys() == {"0"} and first.lm_head is None
    assert last.model.embed_tokens is None and last.model.layers._modules.keys() == {"1", "2"}


def _meta(name: str, **overrides):
    import transformers as tf

    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(family_config(name, **overrides))


def test_gemma_tied_by_default_is_refused_by_name():
    """Gemma ties its embedding and head by default: the pair would span the
    first and last stage."""
    with pytest.raises(ValueError, match="GemmaForCausalLM ties its input and output embeddings"):
        split_for_stage(_meta("gemma", tie_word_embeddings=True), 0, 2)


def test_gemma3_bidirectional_attention_is_refused_by_name():
    model = _meta("gemma3_text", use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        split_for_stage(model, 1, 2)


def test_moe_family_with_other_layers_is_refused_by_name():
    """Qwen3-Next's linear-attention layers take no causal mask: not split."""
    with pytest.raises(ValueError, match="model_type='qwen3_next'"):
        split_for_stage(_meta("qwen3_next"), 0, 2)


def test_a_peft_model_is_refused_for_what_it_is():
    """A PeftModel carries its base's ``model_type``: the refusal said "got
    PeftModel (model_type='llama')" although llama is split; it names the
    adapters instead."""
    import peft
    import transformers

    from tests.hf_models import tiny_config

    base = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"does not split a peft PeftModel.*'llama' base"):
        split_for_stage(model, 0, 2)
