"""A tiny pretrained Hugging Face checkpoint, for the fine-tuning example and tests.

Hub downloads do not work everywhere (not on these CI machines), so the
example makes its own "pretrained" model: a random tiny causal LM of one of
``transformers``' families saved with ``save_pretrained`` in several
safetensors files, and a byte-level BPE tokenizer trained with the
``tokenizers`` library on the shipped corpus::

    python -m ray_fsdp_backend.models.tiny_pretrained /tmp/rfb-tiny-llama
    ray-fsdp train examples/finetune_hf.yaml

``--chat`` gives the tokenizer a ChatML chat template (``<|im_start|>`` /
``<|im_end|>`` special tokens, ``<|im_end|>`` its end of sequence) and
writes a small chat dataset beside the checkpoint (``chat/train.jsonl``,
``chat/eval.jsonl``; :data:`CHAT_TRAIN`), for ``examples/sft_chat.yaml``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from ray_fsdp_backend.compat.optional_imports import keep_torchao_unimported

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
    kind: str,
    path,
    *,
    tied: bool = False,
    dtype=torch.float32,
    max_shard_size="20KB",
    seed=0,
    chat: bool = False,
) -> str:
    """Write the checkpoint and tokenizer into ``path`` (``chat``: with a
    chat template); returns it."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tiny_config(kind, tied=tied)
    if chat:
        # Weights ~8x the default scale: at 0.02 a width-32 model's logits
        # are near-uniform and LoRA moves them too slowly to teach answers in
        # a minute (loss 4.58 -> 4.40 in 40 steps, against 4.58 -> 0.95).
        config.initializer_range, config.max_position_embeddings = 0.16, 256
        # <|im_start|> and <|im_end|> (save_tiny_tokenizer's ids): generation
        # stops at the end of the assistant's turn, as a chat model's does.
        config.bos_token_id, config.eos_token_id, config.pad_token_id = 2, 3, 3
    model = tf.AutoModelForCausalLM.from_config(config)
    model.to(dtype).save_pretrained(path, max_shard_size=max_shard_size)
    save_tiny_tokenizer(path, chat=chat)
    return str(path)


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML template (Qwen's layout, no default system prompt)."""


def save_tiny_tokenizer(path, *, chat: bool = False) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<eos>", *(["<|im_start|>", "<|im_end|>"] if chat else [])]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if chat:  # generated answers decode to text
        tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials)
    tok.train([CORPUS], trainer)
    eos = "<|im_end|>" if chat else "<eos>"
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token=eos, pad_token=eos if chat else None
    )
    if chat:
        fast.chat_template = CHATML
    fast.save_pretrained(path)


CHAT_TRAIN = [
    ("what does fsdp shard", "parameters, gradients and optimizer state."),
    ("what does a pipeline split", "the layers into stages."),
    ("what does tensor parallelism split", "each layer over the ranks."),
    ("what does lora train", "small adapters on a frozen base."),
]
"""Questions and the answers ``examples/sft_chat.yaml`` teaches (the
shipped corpus's characters only: the tiny tokenizer knows no others)."""
CHAT_EVAL = [("what does data parallelism copy", "the whole model.")]
SYSTEM = "answer in one line."


def chat_records(pairs) -> list[dict]:
    """One conversation per pair; every other one opens with a system prompt."""
    records = []
    for i, (question, answer) in enumerate(pairs):
        system = [{"role": "system", "content": SYSTEM}] if i % 2 else []
        turns = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        records.append({"messages": system + turns})
    return records


def save_tiny_chat_data(path, *, copies: int = 32, parquet: bool = False) -> dict[str, str]:
    """``train`` (:data:`CHAT_TRAIN`, ``copies`` times) and ``eval``
    (:data:`CHAT_EVAL`) chat datasets in ``path``, as JSONL or parquet;
    returns their paths."""
    os.makedirs(path, exist_ok=True)
    files = {}
    for name, records in (
        ("train", chat_records(CHAT_TRAIN) * copies),
        ("eval", chat_records(CHAT_EVAL)),
    ):
        files[name] = os.path.join(path, f"{name}.{'parquet' if parquet else 'jsonl'}")
        if parquet:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(records), files[name])
        else:
            with open(files[name], "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
    return files


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="directory to write")
    parser.add_argument(
        "--kind", default="llama", choices=["llama", "llama_qlora", "gpt2", "qwen3_moe"]
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="a chat template, and a chat dataset in PATH/chat (train.jsonl, eval.jsonl)",
    )
    args = parser.parse_args(argv)
    keep_torchao_unimported()  # nothing here quantises: no torchao load lines
    save_tiny_pretrained(args.kind, args.path, chat=args.chat)
    print(f"wrote a tiny pretrained {args.kind} to {args.path}")
    if args.chat:
        files = save_tiny_chat_data(os.path.join(args.path, "chat"))
        print(f"wrote chat data: {files['train']}, {files['eval']}")


if __name__ == "__main__":
    main()
