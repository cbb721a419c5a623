"""The tensor-parallel plan, pure parts: which modules a plan names, and the
refusals (heads, kv heads, split sizes, unknown styles) made before any
weight exists (meta models)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ray_fsdp_backend.models.decoder import ModelConfig, Transformer
from ray_fsdp_backend.strategies.tensor_parallel import (
    check_tp_divisibility,
    match_plan,
    model_head_counts,
    resolve_tp_plan,
)


def _decoder(**kw) -> Transformer:
    with torch.device("meta"):
        return Transformer(ModelConfig(**{"dim": 48, "n_layers": 2, "n_heads": 4, **kw}))


def _llama(**kw):
    import transformers as tf

    config = tf.LlamaConfig(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=kw.pop("heads", 4),
        num_key_value_heads=kw.pop("kv_heads", 2),
        vocab_size=kw.pop("vocab", 96),
    )
    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(config)


def test_the_decoder_plan_names_every_matrix_once():
    model = _decoder()
    matched = match_plan(model, resolve_tp_plan(model, None))
    assert matched["layers.1.attention.wq"] == "colwise"
    assert matched["layers.0.feed_forward.w2"] == "rowwise"
    assert matched["tok_embeddings"] == "embedding_rowwise"
    assert matched["output"] == "colwise_gather_output"
    assert len(matched) == 2 + 7 * 2  # embedding, head, 7 matrices per block
    assert "layers.0.attention_norm" not in matched  # norms: replicated, not split


def test_transformers_plan_comes_from_the_model():
    model = _llama()
    plan = resolve_tp_plan(model, None)
    assert plan["lm_head"] == "colwise_gather_output"
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    matched = match_plan(model, plan)
    assert matched["model.layers.1.mlp.down_proj"] == "rowwise"
    assert model_head_counts(model) == {"num_attention_heads": 4, "num_key_value_heads": 2}
    check_tp_divisibility(model, matched, 2)


def test_head_counts_tp_does_not_divide_are_refused_with_the_numbers():
    model = _decoder(n_heads=6, n_kv_heads=3)
    matched = match_plan(model, resolve_tp_plan(model, None))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide kv_heads=3"):
        check_tp_divisibility(model, matched, 2)
    with pytest.raises(ValueError, match=r"does not divide n_heads=6, kv_heads=3"):
        check_tp_divisibility(model, matched, 4)
    llama = _llama(heads=6, kv_heads=3)
    with pytest.raises(ValueError, match=r"num_key_value_heads=3"):
        check_tp_divisibility(llama, match_plan(llama, resolve_tp_plan(llama, None)), 2)


def test_split_sizes_tp_does_not_divide_are_refused():
    llama = _llama(vocab=97)  # vocabulary split by the embedding and the head
    with pytest.raises(
        ValueError, match=r"model.embed_tokens.num_embeddings=97, lm_head.out_features=97"
    ):
        check_tp_divisibility(llama, match_plan(llama, resolve_tp_plan(llama, None)), 2)


def test_plans_without_entries_or_with_unknown_styles_are_refused():
    with pytest.raises(ValueError, match="Sequential has no tensor-parallel plan"):
        resolve_tp_plan(nn.Sequential(nn.Linear(2, 2)), None)
    with pytest.raises(ValueError, match=r"tp_plan\['0'\]='columnwise' is not one of colwise"):
        resolve_tp_plan(nn.Sequential(nn.Linear(2, 2)), {"0": "columnwise"})
    user = resolve_tp_plan(nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 2)), {"0": "colwise"})
    assert user == {"0": "colwise"}


def test_a_plan_that_names_no_module_is_refused_before_any_collective():
    from ray_fsdp_backend.strategies.tensor_parallel import TPOptions, apply_tensor_parallel

    model = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="matched no module of Sequential"):
        apply_tensor_parallel(
            model, None, {"model.layers.*.q_proj": "colwise"}, TPOptions(True, False)
        )


def _family(model_type: str):
    import transformers as tf

    from tests.zoo_families import family_config

    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(family_config(model_type))


def test_transformers_styles_map_to_their_gradient_semantics():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from ray_fsdp_backend.strategies.tensor_parallel import TPOptions, build_styles

    phi3 = _family("phi3")
    styles = build_styles(match_plan(phi3, resolve_tp_plan(phi3, None)), TPOptions(False, True))
    qkv, o = styles["model.layers.0.self_attn.qkv_proj"], styles["model.layers.0.self_attn.o_proj"]
    assert isinstance(qkv, ColwiseParallel) and qkv.output_layouts == (Replicate(),)
    assert isinstance(o, RowwiseParallel) and o.input_layouts == (Replicate(),)
    head = styles["lm_head"]  # only the output head keeps its logits split (loss parallel)
    assert head.output_layouts == (Shard(-1),) and not head.use_local_output
    qwen3 = _family("qwen3")
    styles = build_styles(match_plan(qwen3, resolve_tp_plan(qwen3, None)), TPOptions(False, False))
    norm = styles["model.layers.1.self_attn.k_norm"]  # gradient summed over tp
    assert isinstance(norm, SequenceParallel) and norm.sequence_sharding == (Shard(0),)


def test_styles_and_families_tp_cannot_run_are_refused_by_name():
    from ray_fsdp_backend.strategies.tensor_parallel import check_tp_family

    with pytest.raises(ValueError, match="'packed_colwise' is not one of"):
        resolve_tp_plan(_llama(), {"model.layers.*.mlp.up_proj": "packed_colwise"})
    with pytest.raises(ValueError, match="model_type='gpt_oss'.*sinks"):
        check_tp_family(_family("gpt_oss"))
