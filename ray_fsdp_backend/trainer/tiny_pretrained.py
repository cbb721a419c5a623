"""A tiny pretrained Hugging Face checkpoint, for the fine-tuning example and tests.

Hub downloads do not work everywhere (not on these CI machines), so the
example makes its own "pretrained" model: a random tiny causal LM of one of
``transformers``' families saved with ``save_pretrained`` in several
safetensors files, and a byte-level BPE tokenizer trained with the
``tokenizers`` library on the shipped corpus::

    python -m ray_fsdp_backend.trainer.tiny_pretrained /tmp/rfb-tiny-llama
    ray-fsdp train examples/finetune_hf.yaml
"""

from __future__ import annotations

import argparse
import os

import torch

VOCAB = 96
CORPUS = os.path.join(os.path.dirname(__file__), "tiny_corpus.txt")


def tiny_config(kind: str, *, tied: bool = False):
    import transformers as tf

    common = dict(vocab_size=VOCAB, tie_word_embeddings=tied)
    if kind in ("llama", "llama_qlora"):
        # llama_qlora: every linear weight a multiple of 4 ranks x 64 x 256
        # elements, so NF4 quantises its shards (docs/lora.md, QLoRA).
        wide = kind == "llama_qlora"
        return tf.LlamaConfig(
            hidden_size=256 if wide else 32,
            intermediate_size=512 if wide else 64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4 if wide else 2,
            max_position_embeddings=64,
            **common,
        )
    if kind == "gpt2":
        return tf.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=1, **common
        )
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=64,
            **common,
        )
    raise ValueError(kind)


def save_tiny_pretrained(
    kind: str, path, *, tied: bool = False, dtype=torch.float32, max_shard_size="20KB", seed=0
) -> str:
    """Write the checkpoint and tokenizer into ``path``; returns it."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_config(kind, tied=tied))
    model.to(dtype).save_pretrained(path, max_shard_size=max_shard_size)
    save_tiny_tokenizer(path)
    return str(path)


def save_tiny_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<eos>"])
    tok.train([CORPUS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="directory to write")
    parser.add_argument(
        "--kind", default="llama", choices=["llama", "llama_qlora", "gpt2", "qwen3_moe"]
    )
    args = parser.parse_args(argv)
    save_tiny_pretrained(args.kind, args.path)
    print(f"wrote a tiny pretrained {args.kind} to {args.path}")


if __name__ == "__main__":
    main()
