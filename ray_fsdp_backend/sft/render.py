"""A record to token documents: ``input_ids`` and unshifted ``labels``.

The loss masks come from the chat template itself (the tokenizer's, or
``chat_template``; a family's training patch applied, :mod:`.templates`),
called with the record's ``tools`` and ``chat_template_kwargs``. Each
assistant message ``i`` (but one of ``weight`` 0:
:func:`~ray_fsdp_backend.sft.conversation.is_trained`) is trained as the
*last* turn, as the model writes it at inference, from two renderings:

- ``messages[:i]`` with ``add_generation_prompt=True``: the prompt, up to where
  the model starts to write (whatever header, default system prompt or
  pre-filled text the template puts there);
- ``messages[:i + 1]``: the conversation ending with that turn, its
  end-of-turn text included.

The prompt must be a prefix of the turn's rendering; the characters after it
are the target, less an empty reasoning block at its start
(``<think></think>``: pre-filled context, nothing the record teaches). A turn
whose rendering as the last message is also how the whole conversation
renders it is trained in the whole conversation's document; a turn the
template renders differently once later turns follow (Qwen3 drops history
reasoning, gpt-oss ends history with ``<|end|>`` not ``<|return|>``, Phi-3
writes EOS only at the very end) gets a document of its own, the conversation
up to it, and is context only in the whole conversation. One template call
with ``tokenize=False`` per rendering; the text is tokenized as
``apply_chat_template(..., tokenize=True)`` does (no special tokens added) and
the fast tokenizer's offset mapping turns the character spans into labels: a
token is a target when its characters overlap a span.

``prompt_completion`` renders ``[user: prompt, assistant: completion]``
through the template when the tokenizer has one; otherwise the document is
``prompt + completion`` tokenized with the tokenizer's special tokens, and
the EOS token appended, the loss on the completion and EOS. ``text`` is the
text with special tokens plus EOS, the loss on every token.
``train_on_prompt`` makes every token of the whole conversation a target.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_fsdp_backend.sft.conversation import is_trained, record_fields
from ray_fsdp_backend.sft.options import Format, SFTDataError, SFTOptions
from ray_fsdp_backend.sft.templates import training_template

IGNORE_INDEX = -100
Spans = list[tuple[int, int]]
Document = tuple[np.ndarray, np.ndarray]

_REASONING_OPEN = "<think>"
_EMPTY_REASONING = re.compile(r"\s*(<think>)?\s*</think>\s*")
"""A reasoning block with nothing in it, at a turn's start (its ``<think>``
may end the prompt: DeepSeek-R1's generation prompt pre-fills it)."""


def has_chat_template(tokenizer, options: SFTOptions | None = None) -> bool:
    override = options.chat_template if options is not None else None
    return bool(override or getattr(tokenizer, "chat_template", None))


@dataclass(frozen=True)
class ChatRenderer:
    """One record's template call: the template text, the record's tools and
    the template's keyword arguments."""

    tokenizer: Any
    template: str
    tools: list | None = None
    kwargs: dict | None = None

    @classmethod
    def build(cls, tokenizer, options: SFTOptions, tools: list | None = None) -> ChatRenderer:
        text = options.chat_template or tokenizer.chat_template
        template, _ = training_template(text)
        return cls(tokenizer, template, tools or None, dict(options.chat_template_kwargs or {}))

    def render(self, messages: list[dict], generation: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=generation,
            **self.kwargs,
        )

    def prompt(self, history: list[dict]) -> str:
        """The text before the model answers ``history``; an empty history that
        the template cannot render (it reads ``messages[0]``) has none."""
        if history:
            return self.render(history, generation=True)
        try:
            return self.render(history, generation=True)
        except Exception:  # jinja's UndefinedError on messages[0], and friends
            return ""


def render_record(record: dict, tokenizer, options: SFTOptions, where: str) -> list[Document]:
    """The ``(input_ids, labels)`` int64 documents of one record (labels
    unshifted, -100 where no loss): one, or more for a chat whose template
    renders history differently from the last turn (module docstring). A
    conversation's tools (``options.tools_field``) are passed to the template.

    Raises:
        SFTDataError: a field is missing or malformed, or the template refuses
            the conversation (a role it does not know, a bad order) or renders
            a turn that does not follow its own generation prompt.
    """
    values = record_fields(record, options, where)
    if options.format.is_chat:
        messages, tools = values
        return chat_documents(messages, tokenizer, options, where, tools)
    if options.format is Format.PROMPT_COMPLETION:
        prompt, completion = values
        if has_chat_template(tokenizer, options):
            messages = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": completion},
            ]
            return chat_documents(messages, tokenizer, options, where)
        text = prompt + completion
        spans = [(0, len(text))] if options.train_on_prompt else [(len(prompt), len(text))]
        return [plain_document(text, spans, tokenizer)]
    (text,) = values
    return [plain_document(text, [(0, len(text))], tokenizer)]


def chat_documents(
    messages: list[dict], tokenizer, options: SFTOptions, where: str, tools: list | None = None
) -> list[Document]:
    """The conversation's documents, labels on its assistant turns."""
    if not has_chat_template(tokenizer, options):
        raise SFTDataError(
            f"the tokenizer has no chat_template, which format {options.format.value!r} needs "
            f"({where}); set chat_template or use format 'prompt_completion' / 'text'"
        )
    renderer = ChatRenderer.build(tokenizer, options, tools)
    try:
        text = renderer.render(messages)
        if options.train_on_prompt:
            pieces = [(text, [(0, len(text))])]
        else:
            pieces = turn_pieces(renderer, messages, text, where)
    except SFTDataError:
        raise
    except Exception as exc:  # jinja's TemplateError from raise_exception, and friends
        roles = [m["role"] for m in messages]
        raise SFTDataError(
            f"{where}: the chat template refuses the conversation (roles {roles}): {exc}"
        ) from None
    return [tokenize_spans(tokenizer, t, s, add_special_tokens=False) for t, s in pieces]


@dataclass(frozen=True)
class Turn:
    """Assistant turn ``index`` rendered as the last message: ``text`` ends
    with it, ``start`` is where its target starts (after the generation prompt
    and an empty reasoning block), ``context_end`` where the text before an
    empty reasoning block ends (``start`` when there is none)."""

    index: int
    text: str
    context_end: int
    start: int

    def span_in(self, whole: str) -> tuple[int, int] | None:
        """Where ``whole`` holds this turn's target; None when the template
        renders the turn differently there. A history turn that differs only
        by an empty reasoning block it lacks (Qwen3, Qwen3.5, DeepSeek) is
        in place: the same context, the same target."""
        if whole.startswith(self.text):
            return self.start, len(self.text)
        context, target = self.text[: self.context_end], self.text[self.start :]
        if self.start > self.context_end and whole.startswith(context):
            if whole.startswith(target, len(context)):
                return len(context), len(context) + len(target)
        return None


def turn_pieces(renderer: ChatRenderer, messages: list[dict], whole: str, where: str):
    """``[(text, spans), ...]``: the whole conversation with the turns it
    renders as the last turn (when it has any, or no turn renders apart), then
    one piece per turn rendered apart."""
    in_place, apart = [], []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or not is_trained(message):
            continue
        turn = last_turn(renderer, messages, i, where)
        span = turn.span_in(whole)
        if span is not None:
            in_place.append(span)
        else:
            apart.append((turn.text, [(turn.start, len(turn.text))]))
    return ([(whole, in_place)] if in_place or not apart else []) + apart


def last_turn(renderer: ChatRenderer, messages: list[dict], i: int, where: str) -> Turn:
    """Assistant turn ``i`` rendered as the conversation's last message."""
    prompt = renderer.prompt(messages[:i])
    text = renderer.render(messages[: i + 1])
    if not (text.startswith(prompt) and len(text) > len(prompt)):
        raise SFTDataError(
            f"{where}: assistant turn {i} does not follow its own generation prompt: the "
            f"template's prompt ends {prompt[-40:]!r} but the turn renders as "
            f"{text[max(0, len(prompt) - 40) : len(prompt) + 20]!r}, so what the model writes "
            "cannot be found. Check chat_template_kwargs (enable_thinking=False pre-fills an empty "
            "reasoning block: a turn with reasoning cannot follow it) or set chat_template "
            "to a training template whose generation prompt starts each turn "
            "(docs/sft-rows.md, 'What each family trains')"
        )
    start = context_end = len(prompt)
    empty = _EMPTY_REASONING.match(text, start)
    if empty and empty.group(1):
        start = empty.end()
    elif empty and prompt.rstrip().endswith(_REASONING_OPEN):
        context_end, start = prompt.rstrip().rindex(_REASONING_OPEN), empty.end()
    _check_tool_calls(messages[i], text[start:], i, where)
    return Turn(i, text, context_end, start)


def _check_tool_calls(message: dict, target: str, i: int, where: str) -> None:
    """Refuse a turn whose tool calls the template does not write (DeepSeek-R1
    and Phi-3 drop them without a word): the model would learn to call nothing."""
    for call in message.get("tool_calls") or ():
        name = (call.get("function") or call).get("name") if isinstance(call, dict) else None
        if isinstance(name, str) and name not in target:
            raise SFTDataError(
                f"{where}: assistant turn {i} calls {name!r} but the chat template does not "
                "render its tool_calls (this template does not support tool calling); "
                "set chat_template to one that does"
            )


def tokenize_spans(tokenizer, text: str, spans: Spans, *, add_special_tokens: bool) -> Document:
    """``text`` tokenized; a token is a target when its characters overlap a span."""
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    target = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        target |= (offsets[:, 1] > a) & (offsets[:, 0] < b)
    return ids, np.where(target, ids, IGNORE_INDEX)


def plain_document(text: str, spans: Spans, tokenizer) -> Document:
    """``text`` with the tokenizer's special tokens and EOS appended (a target
    whenever the last span reaches the end of the text)."""
    ids, labels = tokenize_spans(tokenizer, text, spans, add_special_tokens=True)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and (not len(ids) or ids[-1] != eos):
        trained = bool(spans) and spans[-1][1] >= len(text)
        ids = np.append(ids, eos)
        labels = np.append(labels, eos if trained else IGNORE_INDEX)
    return ids, labels
