"""A record to one token document: ``input_ids`` and unshifted ``labels``.

The loss masks come from the chat template itself, never from per-model
strings. For assistant message ``i`` of a conversation the template renders
two prefixes:

- ``messages[:i]`` with ``add_generation_prompt=True``: the text up to where
  the model starts to answer (whatever header, default system prompt or
  separator the template puts there);
- ``messages[:i + 1]``: the text up to the end of that turn, its end-of-turn
  token (and whatever the template writes after it before the next turn)
  included.

Both must be prefixes of the whole rendered conversation (templates render
history the same way whatever follows); the characters between them are
the turn the model learns. The rendered text is tokenized once, as
``apply_chat_template(..., tokenize=True)`` does (no special tokens added),
and the fast tokenizer's offset mapping turns the character spans into token
labels: a token is a target when its characters overlap a span.

``prompt_completion`` renders ``[user: prompt, assistant: completion]``
through the template when the tokenizer has one; otherwise the document is
``prompt + completion`` tokenized with the tokenizer's special tokens, and
the EOS token appended, the loss on the completion and EOS. ``text`` is the
text with special tokens plus EOS, the loss on every token.
``train_on_prompt`` makes every token a target.
"""

from __future__ import annotations

import numpy as np

from ray_fsdp_backend.sft.conversation import is_trained
from ray_fsdp_backend.sft.records import Format, SFTDataError, SFTOptions, record_fields

IGNORE_INDEX = -100
Spans = list[tuple[int, int]]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_record(record: dict, tokenizer, options: SFTOptions, where: str):
    """``(input_ids, labels)`` int64 arrays of one record (labels unshifted,
    -100 where no loss).

    Raises:
        SFTDataError: a field is missing or malformed, or the template refuses
            the conversation (a role it does not know, a bad order).
    """
    values = record_fields(record, options, where)
    if options.format.is_chat:
        messages, tools = values
        return chat_document(messages, tokenizer, options.train_on_prompt, where, tools)
    if options.format is Format.PROMPT_COMPLETION:
        prompt, completion = values
        if has_chat_template(tokenizer):
            messages = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": completion},
            ]
            return chat_document(messages, tokenizer, options.train_on_prompt, where)
        text = prompt + completion
        spans = [(0, len(text))] if options.train_on_prompt else [(len(prompt), len(text))]
        return plain_document(text, spans, tokenizer)
    (text,) = values
    return plain_document(text, [(0, len(text))], tokenizer)


def render_chat(tokenizer, messages: list[dict], generation: bool = False, tools=None) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation
    )


def chat_document(messages: list[dict], tokenizer, train_on_prompt: bool, where: str, tools=None):
    """The conversation rendered and tokenized; labels on its assistant turns."""
    if not has_chat_template(tokenizer):
        raise SFTDataError(
            f"the tokenizer has no chat_template, which format 'chat' needs ({where}); "
            "set tokenizer.chat_template or use format 'prompt_completion' / 'text'"
        )
    try:
        text = render_chat(tokenizer, messages, tools=tools)
        spans = (
            [(0, len(text))]
            if train_on_prompt
            else assistant_spans(tokenizer, messages, text, where, tools)
        )
    except SFTDataError:
        raise
    except Exception as exc:  # jinja's TemplateError from raise_exception, and friends
        roles = [m["role"] for m in messages]
        raise SFTDataError(
            f"{where}: the chat template refuses the conversation (roles {roles}): {exc}"
        ) from None
    return tokenize_spans(tokenizer, text, spans, add_special_tokens=False)


def assistant_spans(tokenizer, messages: list[dict], text: str, where: str, tools=None) -> Spans:
    """Character spans of ``text`` (the whole rendered conversation) that hold
    the assistant turns (see the module docstring), but those of ``weight`` 0."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or not is_trained(message):
            continue
        start = _generation_prefix(tokenizer, messages[:i], tools)
        end = render_chat(tokenizer, messages[: i + 1], tools=tools)
        if not (text.startswith(start) and text.startswith(end) and len(end) > len(start)):
            raise SFTDataError(
                f"{where}: the chat template renders assistant turn {i} differently "
                "once later turns follow (its prefixes are not prefixes of the whole "
                "conversation), so its tokens cannot be found; use train_on_prompt=True "
                "or a template that renders history as it rendered the turn"
            )
        spans.append((len(start), len(end)))
    return spans


def _generation_prefix(tokenizer, history: list[dict], tools=None) -> str:
    """The text before the model answers ``history``; an empty history that the
    template cannot render (it reads ``messages[0]``) has none."""
    if history:
        return render_chat(tokenizer, history, generation=True, tools=tools)
    try:
        return render_chat(tokenizer, history, generation=True, tools=tools)
    except Exception:  # jinja's UndefinedError on messages[0], and friends
        return ""


def tokenize_spans(tokenizer, text: str, spans: Spans, *, add_special_tokens: bool):
    """``text`` tokenized; a token is a target when its characters overlap a span."""
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    target = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        target |= (offsets[:, 1] > a) & (offsets[:, 0] < b)
    return ids, np.where(target, ids, IGNORE_INDEX)


def plain_document(text: str, spans: Spans, tokenizer):
    """``text`` with the tokenizer's special tokens and EOS appended (a target
    whenever the last span reaches the end of the text)."""
    ids, labels = tokenize_spans(tokenizer, text, spans, add_special_tokens=True)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and (not len(ids) or ids[-1] != eos):
        trained = bool(spans) and spans[-1][1] >= len(text)
        ids = np.append(ids, eos)
        labels = np.append(labels, eos if trained else IGNORE_INDEX)
    return ids, labels
