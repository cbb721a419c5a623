"""A preference record, checked: the prompt and the chosen and rejected
responses (:class:`Pair`). No tokenizer.

A record holds ``chosen`` and ``rejected`` (field names ``chosen_field``,
``rejected_field``; TRL's defaults) and optionally ``prompt``
(``prompt_field``). Each is text or a list of chat messages (checked as SFT
checks a conversation: :func:`~ray_fsdp_backend.sft.conversation.chat_messages`,
with the role map and the tools field):

- **text**: ``prompt`` + response, rendered as plain text (no chat template);
- **conversational, explicit prompt**: ``prompt`` is the messages before
  the answer; ``chosen`` / ``rejected`` are either the response turns (they
  start with an assistant message) or whole conversations starting with the
  prompt's messages (the prompt is then cut off them); anything else is a
  pair whose prompts differ, refused;
- **implicit prompt** (no ``prompt`` field, or a text ``prompt`` beside
  conversational responses, as UltraFeedback-binarized ships it): the prompt
  is the longest shared prefix of ``chosen`` and ``rejected``, messages for
  conversations, characters for text, exactly TRL's ``extract_prompt``
  (trl 1.16 ``data_utils.py``: a text split backs up over one space). Two
  conversations sharing no first message are refused (their prompts differ).

Refused too: a missing or null ``chosen`` / ``rejected``, one text and one
conversation, and identical responses (the pair teaches nothing: its DPO loss
is ``log 2`` whatever the model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ray_fsdp_backend.sft.conversation import chat_messages, record_tools
from ray_fsdp_backend.sft.options import SFTDataError, SFTOptions

Response = str | list[dict]


@dataclass(frozen=True)
class PreferenceOptions:
    """The keyword arguments of :func:`~ray_fsdp_backend.preference.dataset.preference_dataset`,
    checked: the field names and, in ``chat``, what SFT's chat rendering takes
    (``seq_len``, ``packing``, ``tools_field``, ``roles``, ``chat_template``,
    ``chat_template_kwargs``)."""

    chat: SFTOptions
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"

    @classmethod
    def build(
        cls,
        *,
        seq_len: int,
        packing: bool = True,
        prompt_field: str = "prompt",
        chosen_field: str = "chosen",
        rejected_field: str = "rejected",
        **chat,
    ) -> PreferenceOptions:
        """Options from user values. Raises ``ValueError`` naming the key and the rule."""
        names = {"prompt_field": prompt_field, "chosen_field": chosen_field}
        names["rejected_field"] = rejected_field
        for key, value in names.items():
            if not isinstance(value, str) or not value:
                raise ValueError(f"{key}={value!r} must be a non-empty field name")
        if len(set(names.values())) < 3:
            raise ValueError(f"prompt_field, chosen_field and rejected_field must differ: {names}")
        if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int)):
            raise ValueError(f"seq_len={seq_len!r} must be an int >= 4")
        if isinstance(seq_len, int) and seq_len < 4:
            raise ValueError(f"seq_len={seq_len!r} must be an int >= 4 (two documents a pair)")
        options = SFTOptions.build(format="chat", seq_len=seq_len, packing=packing, **chat)
        return cls(options, prompt_field, chosen_field, rejected_field)

    @property
    def seq_len(self) -> int:
        return self.chat.seq_len

    @property
    def packing(self) -> bool:
        return self.chat.packing


@dataclass(frozen=True)
class Pair:
    """One record's prompt and responses, all text or all messages
    (``prompt`` then ``[]`` or ``""`` when there is none); ``tools`` the
    record's tool schemas (conversations only)."""

    prompt: Response
    chosen: Response
    rejected: Response
    tools: list | None = None

    @property
    def conversational(self) -> bool:
        return isinstance(self.chosen, list)


def read_pair(record: Mapping[str, Any], options: PreferenceOptions, where: str) -> Pair:
    """The record's :class:`Pair` (module docstring). Raises SFTDataError
    naming ``where`` (``FILE:LINE`` / ``FILE#ROW``) and the rule."""
    chosen = _response(record, options.chosen_field, options, where)
    rejected = _response(record, options.rejected_field, options, where)
    if isinstance(chosen, list) != isinstance(rejected, list):
        raise SFTDataError(
            f"{where}: {options.chosen_field!r} is {_kind(chosen)} but "
            f"{options.rejected_field!r} is {_kind(rejected)}; a pair is all text or all messages"
        )
    prompt = record.get(options.prompt_field)
    if isinstance(prompt, list) and not isinstance(chosen, list):
        raise SFTDataError(
            f"{where}: {options.prompt_field!r} is a list of messages but the responses are "
            "text; give the responses as assistant messages"
        )
    if prompt is not None and not isinstance(prompt, str | list):
        raise SFTDataError(
            f"{where}: field {options.prompt_field!r} is a {type(prompt).__name__}, "
            "not text or a list of messages"
        )
    if prompt is None or (isinstance(chosen, list) and isinstance(prompt, str)):
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
        if isinstance(chosen, list) and not prompt:
            raise SFTDataError(
                f"{where}: the conversations {options.chosen_field!r} and "
                f"{options.rejected_field!r} share no first message, so their prompts differ "
                f"(no {options.prompt_field!r} field: the prompt is their shared prefix)"
            )
    elif isinstance(prompt, list):
        prompt = _messages(prompt, options.prompt_field, options, where)
        chosen = _after_prompt(prompt, chosen, options.chosen_field, options, where)
        rejected = _after_prompt(prompt, rejected, options.rejected_field, options, where)
    if chosen == rejected:
        raise SFTDataError(
            f"{where}: {options.chosen_field!r} and {options.rejected_field!r} are the same "
            f"response ({_preview(chosen)}); the pair teaches nothing"
        )
    tools = record_tools(record, options.chat, where) if isinstance(chosen, list) else None
    return Pair(prompt, chosen, rejected, tools)


def extract_prompt(chosen: Response, rejected: Response) -> tuple[Response, Response, Response]:
    """TRL's ``extract_prompt`` (trl 1.16): the longest shared prefix as the
    prompt (messages or characters; a text split backs up over a space), and
    the rest of each."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if idx and chosen[idx - 1] == " ":  # TRL: keep the space with the response
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _response(record, name: str, options: PreferenceOptions, where: str) -> Response:
    value = record.get(name)
    if value is None:
        what = "is null" if name in record else "is missing"
        have = ", ".join(sorted(record)) or "none"
        raise SFTDataError(
            f"{where}: field {name!r} {what} (format 'preference' needs "
            f"{options.chosen_field!r} and {options.rejected_field!r}; the record's fields: {have})"
        )
    if isinstance(value, str):
        return value
    return _messages(value, name, options, where)


def _messages(raw, name: str, options: PreferenceOptions, where: str) -> list[dict]:
    if not isinstance(raw, list):
        raise SFTDataError(
            f"{where}: field {name!r} is a {type(raw).__name__}, not text or a list of messages"
        )
    field_options = dataclasses.replace(options.chat, messages_field=name)
    return chat_messages(raw, field_options, f"{where}: field {name!r}")


def _after_prompt(prompt: list[dict], response: list[dict], name, options, where) -> list[dict]:
    """The response turns of ``response``: it whole when it starts with an
    assistant turn, else what follows the prompt's messages it starts with."""
    if response[: len(prompt)] == prompt and len(response) > len(prompt):
        return response[len(prompt) :]
    if response[0]["role"] == "assistant":
        return response
    raise SFTDataError(
        f"{where}: field {name!r} starts with a {response[0]['role']!r} message but does not "
        f"start with the {len(prompt)} message(s) of {options.prompt_field!r}, so the pair's "
        "prompts differ; give the response turns (from the assistant's) or the whole "
        "conversation starting with the prompt"
    )


def _kind(value: Response) -> str:
    return "a list of messages" if isinstance(value, list) else "text"


def _preview(value: Response) -> str:
    if isinstance(value, list):
        value = " | ".join(str(m.get("content")) for m in value)
    return repr(value[:60])
