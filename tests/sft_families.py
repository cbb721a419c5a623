"""The chat templates of the model families people fine-tune, as shipped.

The template texts in ``tests/sft_templates/`` are the families' own (the
Hub is unreachable here): TRL 1.16's copies of the originals it matches
tokenizers against (``trl/chat_templates/*.jinja``, Apache-2.0; Qwen2.5,
Qwen3, Qwen3.5, DeepSeek-R1-Distill, DeepSeek-V3, Llama 3.1, Llama 3.2,
Gemma 2, Gemma 3, Phi-3, Phi-3.5, gpt-oss), and the texts of
mistralai/Mistral-7B-Instruct-v0.3 and microsoft/phi-4. Llama 3.3 ships Llama
3.1's template. :func:`family_tokenizer` puts one into the shared test BPE
with the family's special tokens, BOS and EOS, so ``apply_chat_template``
renders and tokenizes exactly as the family's tokenizer would lay the text
out (the ids differ, the text and the token boundaries at special tokens do
not).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from tests import sft_tokenizers as st

TEMPLATES = Path(__file__).parent / "sft_templates"


@dataclass(frozen=True)
class Family:
    template: str  # file stem in tests/sft_templates, or "chatml"
    bos: str | None
    eos: str
    special: tuple[str, ...] = ()


_QWEN = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>")
_QWEN += ("</tool_response>",)
_DEEPSEEK = ("<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>")
_DEEPSEEK += ("<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")
_DEEPSEEK += ("<think>", "</think>")
_DEEPSEEK += ("<｜tool▁outputs▁begin｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")
_DEEPSEEK += ("<｜tool▁outputs▁end｜>",)
_LLAMA = ("<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>")
_GEMMA = ("<start_of_turn>", "<end_of_turn>")
_PHI3 = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
_MISTRAL = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]")
_MISTRAL += ("[TOOL_RESULTS]", "[/TOOL_RESULTS]")
_GPTOSS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|constrain|>")

FAMILIES = {
    "chatml": Family("chatml", None, "<|im_end|>", ("<|im_start|>",)),
    "qwen2_5": Family("qwen2_5", None, "<|im_end|>", ("<|im_start|>", *_QWEN)),
    "qwen3": Family("qwen3", None, "<|im_end|>", ("<|im_start|>", *_QWEN)),
    "qwen3_5": Family("qwen3_5_think", None, "<|im_end|>", ("<|im_start|>", *_QWEN)),
    "deepseek_r1_distill": Family(
        "deepseek_r1_distill", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", _DEEPSEEK
    ),
    "deepseek_v3": Family(
        "deepseekv3", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", _DEEPSEEK
    ),
    "llama3_1": Family("llama3_1", "<|begin_of_text|>", "<|eot_id|>", _LLAMA),
    "llama3_2": Family("llama3_2", "<|begin_of_text|>", "<|eot_id|>", _LLAMA),
    "gemma2": Family("gemma", "<bos>", "<eos>", _GEMMA),
    "gemma3": Family("gemma3", "<bos>", "<eos>", _GEMMA),
    "mistral_v0_3": Family("mistral_v0_3", "<s>", "</s>", _MISTRAL),
    "phi3": Family("phi3", None, "<|endoftext|>", _PHI3),
    "phi3_5": Family("phi3_5", None, "<|endoftext|>", _PHI3),
    "phi4": Family("phi4", None, "<|im_end|>", ("<|im_start|>", "<|im_sep|>")),
    "gpt_oss": Family("gptoss", None, "<|return|>", _GPTOSS),
}


def template_text(name: str) -> str:
    """The family's chat template text."""
    stem = FAMILIES[name].template
    if stem == "chatml":
        return st.CHATML
    return (TEMPLATES / f"{stem}.jinja").read_text(encoding="utf-8")


def family_tokenizer(name: str):
    """A fast tokenizer with the family's template, special tokens, BOS and EOS."""
    family = FAMILIES[name]
    tok = copy.deepcopy(st._base())
    tokens = [t for t in (family.bos, family.eos, *family.special) if t]
    tok.add_special_tokens({"additional_special_tokens": tokens})
    tok.bos_token = family.bos
    tok.eos_token = family.eos
    tok.chat_template = template_text(name)
    return tok
