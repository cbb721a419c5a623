"""Fast tokenizers with chat templates, built locally (the Hub is unreachable).

One byte-level BPE trained on the shipped corpus, given the special tokens of
three template styles; :func:`tokenizer` returns a fresh copy with the chosen
``chat_template`` (``None``: no template). ``TURN_END`` is what each template
writes after an assistant turn's content, up to the next turn: the tokens the
loss is on besides the content (the tests' independent reference).
"""

from __future__ import annotations

import copy
import functools

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
DEFAULT_SYSTEM = (
    "{% if not messages or messages[0]['role'] != 'system' %}"
    "<<SYS>>You are a helpful assistant.<</SYS>>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<<SYS>>{{ m['content'] }}<</SYS>>\n"
    "{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]\n-- answer --\n"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}</s>\n== next ==\n"
    "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% endfor %}"
)
"""Inserts a default system prompt when none is given and text between turns;
refuses roles it does not know."""

TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "default_system": DEFAULT_SYSTEM}
TURN_END = {
    "chatml": "<|im_end|>\n",
    "llama3": "<|eot_id|>",
    "default_system": "</s>\n== next ==\n",
}
SPECIAL = [
    "<unk>",
    "<eos>",
    "<bos>",
    "<pad>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "</s>",
]


@functools.lru_cache(maxsize=1)
def _base():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ray_fsdp_backend.models.tiny_pretrained import CORPUS

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([CORPUS], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<eos>",
        bos_token="<bos>",
        pad_token="<pad>",
    )


def tokenizer(template: str | None = "chatml"):
    """A fast tokenizer whose ``chat_template`` is ``TEMPLATES[template]``."""
    tok = copy.deepcopy(_base())
    tok.chat_template = TEMPLATES[template] if template else None
    return tok


def reference_ids(tok, messages) -> list[int]:
    """``apply_chat_template(..., tokenize=True)``'s token ids."""
    out = tok.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def conversations() -> list[list[dict]]:
    """Conversations off the happy path too: a system prompt, several turns,
    unicode, a conversation that ends with a user turn."""
    return [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello, friend."},
            {"role": "user", "content": "Again?"},
            {"role": "assistant", "content": "Yes: once more."},
        ],
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
        ],
        [
            {"role": "user", "content": "Say héllo wörld"},
            {"role": "assistant", "content": "héllo wörld ✓"},
            {"role": "user", "content": "thanks"},
        ],
    ]


WORDS = "alpha beta gamma delta river stone cloud seven green quiet north bright".split()


def random_conversations(count: int, seed: int = 0) -> list[list[dict]]:
    """``count`` distinct conversations of mixed lengths (1-3 exchanges, a
    system prompt in some), each numbered in its first user message."""
    import random

    rng = random.Random(seed)

    def words(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    out = []
    for i in range(count):
        messages = [{"role": "system", "content": words(2, 6)}] if i % 3 == 0 else []
        for turn in range(rng.randint(1, 3)):
            prefix = f"#{i} " if turn == 0 else ""
            messages.append({"role": "user", "content": prefix + words(1, 12)})
            messages.append({"role": "assistant", "content": words(1, 20)})
        out.append(messages)
    return out
