"""``plan``'s counts of a local checkpoint, read from its safetensors headers
(:mod:`ray_fsdp_backend.hf.shapes`, no torch), equal the meta model's that
``transformers`` builds, for every family it covers, with and without LoRA;
a family outside it falls back to the meta model."""

from __future__ import annotations

import pytest

from ray_fsdp_backend.hf.shapes import SHAPE_FAMILIES, read_local_shapes, shape_sizes
from ray_fsdp_backend.trainer.schema.lora import LoraOptions
from ray_fsdp_backend.trainer.schema.pretrained import meta_sizes

# family -> a tiny model (zoo families: tests/zoo_families.py; llama and Qwen3-MoE:
# the examples' checkpoints, in several safetensors files with an index)
CASES = {
    "llama": ("tiny", "llama", {}),
    "llama_tied": ("tiny", "llama", {"tied": True}),
    "qwen3_moe": ("tiny", "qwen3_moe", {}),
    "mistral": ("zoo", "mistral", {}),
    "qwen3": ("zoo", "qwen3", {}),
    "qwen2_tied": ("zoo", "qwen2_tied", {}),
}
LORA = LoraOptions(r=4, target_modules=("q_proj", "v_proj", "o_proj"))


def save_checkpoint(case: str, path) -> str:
    source, name, kwargs = CASES[case]
    if source == "tiny":
        import transformers as tf

        from ray_fsdp_backend.models.tiny_pretrained import tiny_config

        model = tf.AutoModelForCausalLM.from_config(tiny_config(name, **kwargs))
        model.save_pretrained(path, max_shard_size="20KB")
    else:
        from tests.zoo_families import build_family

        build_family(name).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_shape_counts_equal_the_meta_models(case, tmp_path):
    path = save_checkpoint(case, tmp_path)
    shapes = read_local_shapes(path)
    assert shapes is not None and shapes.config["model_type"] in SHAPE_FAMILIES
    for lora in (None, LORA):
        assert shape_sizes(shapes, lora) == meta_sizes(path, lora), (case, lora)


@pytest.mark.parametrize("case", ["llama_tied", "qwen3_moe"])
def test_linear_names_equal_the_meta_models(case, tmp_path):
    """The LoRA target check's linear layers, from the header (a tied head
    and a MoE layer's router and fused experts are where it could differ)."""
    from ray_fsdp_backend.hf.check import _is_linear
    from ray_fsdp_backend.hf.models import build_causal_lm

    path = save_checkpoint(case, tmp_path)
    model = build_causal_lm(path)
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if _is_linear(m)}
    assert read_local_shapes(path).linear_names() == linear


def test_uncovered_checkpoints_fall_back(tmp_path):
    """GPT-2 (Conv1D, not ``nn.Linear``) and a directory without weights:
    None, so the meta model counts them."""
    import transformers as tf

    from ray_fsdp_backend.models.tiny_pretrained import tiny_config

    tf.AutoModelForCausalLM.from_config(tiny_config("gpt2")).save_pretrained(tmp_path / "gpt2")
    assert read_local_shapes(str(tmp_path / "gpt2")) is None
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text('{"model_type": "llama"}')
    assert read_local_shapes(str(tmp_path / "empty")) is None
    assert read_local_shapes("s3://bucket/llama") is None


@pytest.mark.parametrize("case", ["llama", "llama_tied", "qwen3_moe"])
def test_nf4_refusals_equal_the_meta_models(case, tmp_path):
    """The static check's NF4 rule (``lora.base_quantization: nf4``) from the
    header's linear weights: the meta model's refusals, at 1, 2 and 4 shards
    (these tiny widths refuse at every count: the check has lines to compare)."""
    from ray_fsdp_backend.hf.layout_check import meta_model, nf4_errors, nf4_weight_errors

    path = save_checkpoint(case, tmp_path)
    shapes, model = read_local_shapes(path), meta_model(path)
    for shards in (1, 2, 4):
        expected = nf4_errors(model, shards)
        assert expected and nf4_weight_errors(shapes.nf4_weights(), shards) == expected


def test_expert_refusals_equal_the_meta_models(tmp_path):
    """The static check's expert rule (``expert_parallel_size`` against every
    MoE layer's experts) from the per-expert keys: the meta model's lines."""
    from ray_fsdp_backend.hf.layout_check import expert_count_errors, expert_errors, meta_model

    path = save_checkpoint("qwen3_moe", tmp_path)
    layers = read_local_shapes(path).expert_layers()
    assert layers == {f"model.layers.{i}.mlp.experts": 4 for i in range(2)}
    for ep in (2, 3, 8):
        assert expert_count_errors(layers, ep) == expert_errors(meta_model(path), ep), ep
    assert expert_count_errors(layers, 3)  # the case compared refuses


@pytest.mark.parametrize("case", sorted(CASES))
def test_pipeline_split_refusals_equal_the_meta_models(case, tmp_path):
    """The driver's pipeline check (``pipeline_parallel_size > 1``) from
    ``config.json``: what splitting the meta model says (tied embeddings named
    by their class, more stages than layers) or None, at 2 stages, one per
    layer and one more (the tied cases compared refuse at every count)."""
    from ray_fsdp_backend.hf.models import build_causal_lm
    from ray_fsdp_backend.pipeline.split import split_for_stage
    from ray_fsdp_backend.trainer.schema.pipeline import _split_error, _split_rules
    from ray_fsdp_backend.trainer.schema.pretrained import PretrainedModelConfig

    model = PretrainedModelConfig(pretrained=save_checkpoint(case, tmp_path))
    assert _split_rules(model) is not None  # the rules, not the meta model, answer
    layers = _split_rules(model)[2]
    for stages in (2, layers, layers + 1):
        try:
            split_for_stage(build_causal_lm(model.pretrained), 0, stages)
            expected = None
        except ValueError as error:
            expected = str(error)
        assert _split_error(model, stages) == expected, (case, stages)
    assert ("ties its input" in (_split_error(model, 2) or "")) == case.endswith("_tied")
