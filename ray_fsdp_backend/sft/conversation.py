"""A record's values, checked: a conversation (``chat``, ``sharegpt``,
``alpaca``) or its text fields (``prompt_completion``, ``text``). No tokenizer.

A conversation is a list of ``{role, content}`` messages and the record's
``tools`` (``tools_field``), as ``apply_chat_template`` takes them:

- roles go through the role map (``roles=``; ``sharegpt`` maps ``human`` and
  ``gpt`` by default) and must then be one a chat template knows
  (:data:`KNOWN_ROLES`): a typo such as ``bot`` would otherwise render, get
  no target and be dropped without a word;
- ``content`` is a string, or a list of text parts (``{"type": "text",
  "text": ...}``) joined without a separator as the multimodal templates
  render them; an image, audio or video part is refused by name (the
  trainer is text-only); ``content: null`` (or none) is accepted on an
  assistant turn with ``tool_calls``, as transformers renders it;
- a per-message ``weight`` (axolotl's) is 0 or 1: 0 leaves that assistant
  turn untrained (:func:`is_trained`).

Parquet rows come back with every key of a nested struct seen anywhere in the
column, ``null`` where a record had none (Arrow's schema merge): the reader
removes ``None`` values from nested mappings before a record gets here
(:func:`remove_none`), so tool-call arguments are rendered as written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray_fsdp_backend.sft.options import Format, SFTDataError, SFTOptions

KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
"""Roles of today's chat templates (``developer``: gpt-oss / harmony;
``ipython``: Llama 3.1 tool results)."""

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "tool": "tool"}
"""ShareGPT's role names (``from``), mapped unless ``roles=`` says otherwise."""

MEDIA_PARTS = ("image", "image_url", "input_image", "audio", "input_audio", "video")


def remove_none(value: Any) -> Any:
    """``value`` with every ``None`` of a mapping dropped, at any depth (what
    Arrow's schema merge adds); ``None`` inside lists is kept."""
    if isinstance(value, Mapping):
        return {k: remove_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [remove_none(v) for v in value]
    return value


def is_trained(message: Mapping[str, Any]) -> bool:
    """Whether an assistant message is a target: its ``weight`` (default 1) is not 0."""
    return message.get("weight", 1) != 0


def record_fields(record: Mapping[str, Any], options: SFTOptions, where: str) -> tuple:
    """The values ``options.format`` reads from ``record``, checked: ``(messages,
    tools)`` for a conversation, the text fields otherwise. ``where`` names
    the record in errors (``FILE:LINE`` or ``FILE#ROW``).

    Raises:
        SFTDataError: naming ``where`` and what is wrong.
    """
    if options.format is Format.ALPACA:
        return alpaca_messages(record, options, where), None
    if options.format.is_chat:
        raw = _field(record, options.messages_key, options, where)
        return chat_messages(raw, options, where), record_tools(record, options, where)
    values = tuple(_field(record, name, options, where) for name in options.fields)
    for name, value in zip(options.fields, values, strict=True):
        if not isinstance(value, str):
            raise SFTDataError(f"{where}: field {name!r} is a {type(value).__name__}, not a string")
    return values


def _field(record: Mapping[str, Any], name: str, options: SFTOptions, where: str) -> Any:
    if record.get(name) is None:
        what = "is null" if name in record else "is missing"
        have = ", ".join(sorted(record)) or "none"
        raise SFTDataError(
            f"{where}: field {name!r} {what} (format {options.format.value!r}; "
            f"the record's fields: {have})"
        )
    return record[name]


def record_tools(record: Mapping[str, Any], options: SFTOptions, where: str) -> list | None:
    """The record's tool schemas (``options.tools_field``), or None."""
    tools = record.get(options.tools_field)
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise SFTDataError(
            f"{where}: field {options.tools_field!r} must be a list of tool schemas "
            f"(objects), got {type(tools).__name__}"
        )
    return [dict(t) for t in tools] or None


def chat_messages(raw: Any, options: SFTOptions, where: str) -> list[dict]:
    """A conversation's messages as ``{role, content, ...}`` dicts, checked."""
    if not isinstance(raw, list) or not raw:
        raise SFTDataError(
            f"{where}: field {options.messages_key!r} must be a non-empty list of messages, "
            f"got {type(raw).__name__}"
        )
    sharegpt = options.format is Format.SHAREGPT
    roles = {**(SHAREGPT_ROLES if sharegpt else {}), **options.roles}
    messages = []
    for i, message in enumerate(raw):
        at = f"{where}: message {i}"
        if not isinstance(message, Mapping):
            raise SFTDataError(f"{at} is a {type(message).__name__}, not an object")
        message = dict(message)
        if sharegpt:
            message["role"] = message.pop("from", None)
            message["content"] = message.pop("value", None)
        messages.append(_message(message, roles, at))
    return messages


def _message(message: dict, roles: Mapping[str, str], at: str) -> dict:
    role = message.get("role")
    if not isinstance(role, str):
        raise SFTDataError(f"{at} has no string 'role' (got {role!r:.60})")
    role = message["role"] = roles.get(role, role)
    if role not in KNOWN_ROLES:
        raise SFTDataError(
            f"{at} has role {role!r}, which is not one of {', '.join(KNOWN_ROLES)}; "
            "map the dataset's role names with data.roles (roles=), e.g. {bot: assistant}"
        )
    weight = message.get("weight", 1)
    if isinstance(weight, bool) or weight not in (0, 1):
        raise SFTDataError(f"{at} has weight={weight!r}; a message's weight is 0 or 1")
    content = message.get("content")
    if content is None:
        if role == "assistant" and message.get("tool_calls"):
            message["content"] = None  # transformers renders a tool-call turn without text
            return message
        raise SFTDataError(f"{at} (role {role!r}) has no 'content'")
    message["content"] = _text_content(content, at)
    return message


def _text_content(content: Any, at: str) -> str:
    """A string, or a list of text parts joined (no separator)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise SFTDataError(
            f"{at} content is a {type(content).__name__} ({content!r:.40}), not a string "
            "or a list of text parts"
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in MEDIA_PARTS:
            raise SFTDataError(
                f"{at} part {j} is an {kind!r} part; SFT here trains on text only "
                "(a part must be {type: text, text: ...})"
            )
        if kind != "text" or not isinstance(part.get("text"), str):
            raise SFTDataError(
                f"{at} part {j} ({part!r:.60}) is not a text part {{type: text, text: ...}}"
            )
        texts.append(part["text"])
    return "".join(texts)


def alpaca_messages(record: Mapping[str, Any], options: SFTOptions, where: str) -> list[dict]:
    """``system`` (optional), ``instruction`` and ``input`` (optional, joined
    with a newline as LLaMA-Factory does) as the user turn, ``output`` as the
    assistant's."""
    values = {}
    for name in ("instruction", "input", "output", "system"):
        value = record.get(name)
        if value is not None and not isinstance(value, str):
            raise SFTDataError(f"{where}: field {name!r} is a {type(value).__name__}, not a string")
        values[name] = value or ""
    for name in ("instruction", "output"):
        if record.get(name) is None:
            _field(record, name, options, where)
    prompt = "\n".join(v for v in (values["instruction"], values["input"]) if v)
    system = [{"role": "system", "content": values["system"]}] if values["system"] else []
    return [
        *system,
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": values["output"]},
    ]
