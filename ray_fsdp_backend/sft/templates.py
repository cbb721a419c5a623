"""Which chat template renders a record, and the training templates the
package swaps in for families whose own template cannot show a trained turn.

``chat_template`` (``data.chat_template``) is a template string or the path
of a file holding one; it replaces the tokenizer's. The text is then matched
against :data:`TRAINING_PATCHES`: where a template holds a patch's ``old``
text (a piece of the family's template, byte for byte) it is rendered with
``new`` in its place.
Each patch changes how the *last* assistant turn renders, never the history,
so every turn is still trained as the model sees it at inference
(docs/sft-rows.md, "What each family trains"). Nothing here imports
transformers: the renderer hands the text to ``apply_chat_template``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainingPatch:
    """A family's template text (``old``) and the text that replaces it."""

    family: str
    old: str
    new: str


# DeepSeek-R1 distills and DeepSeek-V3 (the tokenizer_config.json shipped with
# every R1-Distill checkpoint and with DeepSeek-V3): the generation prompt is
# "<｜Assistant｜><think>\n" while an assistant turn renders "<｜Assistant｜>"
# and its content after "</think>" only, so no turn follows its own prompt and
# its reasoning is never shown. The last turn now renders what the model writes
# after the prompt: its reasoning (the content's "<think>...</think>" or
# reasoning_content), "\n</think>\n\n" and the answer; history is unchanged.
_DEEPSEEK_OLD = (
    "{% set content = message['content'] %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}"
)
_DEEPSEEK_NEW = (
    "{% set content = message['content'] %}"
    "{% if loop.last and not add_generation_prompt %}"
    "{% set reasoning = message['reasoning_content'] if message['reasoning_content'] is string "
    "else '' %}"
    "{% if '</think>' in content %}{% set reasoning = content.split('</think>')[0]"
    ".split('<think>')[-1] %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜><think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') + '<｜end▁of▁sentence｜>'}}"
    "{% else %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{% endif %}"
)

# DeepSeek-V3's tool-call turn renders "<｜Assistant｜>" then the calls: as the
# last turn it now follows the pre-filled "<think>\n" with an empty reasoning
# block (context, not a target), as the model writes it. (The patch sits in
# the loop over the calls, where `loop.last` is the last call.)
_DEEPSEEK_CALL_OLD = "{{'<｜Assistant｜>' + message['content'] + '<｜tool▁calls▁begin｜>"
_DEEPSEEK_CALL_NEW = (
    "{{'<｜Assistant｜>' + ('<think>\\n\\n</think>\\n\\n' if message is sameas messages[-1] "
    "and not add_generation_prompt else '') + message['content'] + '<｜tool▁calls▁begin｜>"
)

# Mistral-7B-Instruct-v0.3: the system prompt is written into the user turn
# that is the conversation's last message, so a conversation that ends with
# the answer has no system prompt at all while the answer's generation prompt
# has it. It now goes into the last user turn, the one the last answer replies
# to: where it stands when the model generates that answer.
_MISTRAL_OLD = '{%- if loop.last and system_message is defined %}\n            {{- "[INST] "'
_MISTRAL_NEW = (
    "{%- if message is sameas user_messages[-1] and system_message is defined %}\n"
    '            {{- "[INST] "'
)

TRAINING_PATCHES = (
    TrainingPatch("deepseek-r1 / deepseek-v3", _DEEPSEEK_OLD, _DEEPSEEK_NEW),
    TrainingPatch("deepseek-v3 tool calls", _DEEPSEEK_CALL_OLD, _DEEPSEEK_CALL_NEW),
    TrainingPatch("mistral-v0.3", _MISTRAL_OLD, _MISTRAL_NEW),
)


def read_chat_template(value: str | os.PathLike) -> str:
    """``value`` itself when it is a Jinja template (holds ``{{`` or ``{%``),
    else the text of the file it names.

    Raises:
        ValueError: naming the value, when it is neither a template nor a
            readable file.
    """
    text = os.fspath(value)
    if "{{" in text or "{%" in text:
        return text
    try:
        with open(text, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(
            f"chat_template={text!r} is neither a Jinja template (no '{{{{' or '{{%') "
            f"nor a file that can be read ({exc.strerror})"
        ) from None


@functools.lru_cache(maxsize=16)
def training_template(template: str) -> tuple[str, tuple[str, ...]]:
    """``(text, patches)``: ``template`` with every training patch whose text
    it holds applied, and their names (none: the template as it is)."""
    applied = []
    for patch in TRAINING_PATCHES:
        if patch.old in template:
            template = template.replace(patch.old, patch.new)
            applied.append(patch.family)
    return template, tuple(applied)
