"""Tiny configs of the transformers 5.23 families the zoo test trains
(tests/dist/test_zoo.py): 2 layers, hidden 32, 4 query heads over 2 kv
heads, head dim 8, so every family runs each layout in well under a second.

Each family is chosen for what it exercises: a sliding window on every layer
(Mistral), alternating windows with an attention soft-cap (Gemma 2), per-head
q/k norms (Qwen3; Gemma 3 with windows), attention sinks and experts
(gpt-oss), fused qkv / gate_up projections (Phi-3), column-wise layers whose
output is gathered and a row-wise layer that splits its input (OLMo 2), and
an input embedding tied to the output head (Qwen2).
"""

from __future__ import annotations

WINDOW = 8
"""Sliding window of the windowed families: a quarter of the 32-token rows."""

VOCAB = 96
SEQ = 32
"""Row length: four windows."""

FAMILIES = ("mistral", "gemma2", "gemma3_text", "gpt_oss", "phi3", "qwen3", "olmo2", "qwen2_tied")
"""Every family the zoo trains (``qwen2_tied``: Qwen2 with tied embeddings).
:func:`family_config` also builds ``gemma``, ``qwen2_moe``, ``qwen3_moe`` and
``mixtral`` (4 experts, top 2) and ``qwen3_next``, which the pipeline
split's tests use."""


def family_config(name: str, **overrides):
    """The tiny config of ``name`` (``overrides`` replace its fields)."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    extra = {
        "mistral": dict(sliding_window=WINDOW),
        # a cap that bites: at the default init (0.02) scores stay far below
        # any cap and the cap changes the loss by 2e-7
        "gemma2": dict(
            sliding_window=WINDOW,
            attn_logit_softcapping=0.2,
            final_logit_softcapping=None,
            initializer_range=0.2,
        ),
        "gemma3_text": dict(
            sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]
        ),
        "gpt_oss": dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        "qwen2_tied": dict(tie_word_embeddings=True),
        # Families outside the zoo's run, used by the pipeline split's tests.
        "gemma": dict(),
        "qwen2_moe": dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
        ),
        "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
        "qwen3_next": dict(
            num_experts=4,
            moe_intermediate_size=16,
            layer_types=["linear_attention", "full_attention"],
        ),
    }.get(name, {})
    config_class = {
        "mistral": tf.MistralConfig,
        "gemma2": tf.Gemma2Config,
        "gemma3_text": tf.Gemma3TextConfig,
        "gpt_oss": tf.GptOssConfig,
        "phi3": tf.Phi3Config,
        "qwen3": tf.Qwen3Config,
        "olmo2": tf.Olmo2Config,
        "qwen2_tied": tf.Qwen2Config,
        "gemma": tf.GemmaConfig,
        "qwen2_moe": tf.Qwen2MoeConfig,
        "qwen3_moe": tf.Qwen3MoeConfig,
        "mixtral": tf.MixtralConfig,
        "qwen3_next": tf.Qwen3NextConfig,
    }[name]
    return config_class(**{**common, **extra, **overrides})


def build_family(name: str, seed: int = 0, **overrides):
    """A ``*ForCausalLM`` of ``name`` in float32, eager attention, from ``seed``."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    config = family_config(name, **overrides)
    config._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = False  # packed rows: per-document masks from position_ids
    return model
