"""What :func:`~ray_fsdp_backend.sft.sft_dataset` is asked for, checked:
the record format and the options of rendering and packing."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from ray_fsdp_backend.sft.templates import read_chat_template


class SFTDataError(ValueError):
    """A source or a record that cannot become training rows; the message names
    the record (``FILE:LINE`` for JSON lines, ``FILE#ROW`` for parquet, the
    row counted from 0) and the rule."""


class Format(enum.Enum):
    """How a record becomes a token document (``format=``)."""

    CHAT = "chat"
    """A list of ``{role, content}`` messages, rendered by the tokenizer's chat
    template; the loss on the assistant turns."""
    PROMPT_COMPLETION = "prompt_completion"
    """Two text fields; the loss on the completion."""
    TEXT = "text"
    """One text field; the loss on every token."""
    SHAREGPT = "sharegpt"
    """``conversations``: a list of ``{from, value}`` (``human`` / ``gpt`` /
    ``system`` / ``tool``), read as ``chat``."""
    ALPACA = "alpaca"
    """``instruction``, ``input`` (optional), ``output`` (and an optional
    ``system``), read as a one-turn ``chat``."""

    @property
    def is_chat(self) -> bool:
        """Whether records become conversations rendered by the chat template."""
        return self in (Format.CHAT, Format.SHAREGPT, Format.ALPACA)


@dataclass(frozen=True)
class SFTOptions:
    """The keyword arguments of :func:`~ray_fsdp_backend.sft.sft_dataset`, checked."""

    format: Format
    seq_len: int
    packing: bool = True
    train_on_prompt: bool = False
    messages_field: str | None = None
    """None: ``messages`` (``conversations`` under ``sharegpt``)."""
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    text_field: str = "text"
    tools_field: str = "tools"
    roles: Mapping[str, str] = field(default_factory=dict)
    """The dataset's role names to the template's (``{"bot": "assistant"}``)."""
    chat_template: str | None = None
    """The template text replacing the tokenizer's (``build`` reads a file path)."""
    chat_template_kwargs: dict | None = None
    """Keyword arguments of every template call (``enable_thinking``, ...)."""

    @classmethod
    def build(cls, *, format: str | Format, seq_len: int, roles=None, **kwargs) -> SFTOptions:
        """Options from user values. Raises ``ValueError`` naming the key and the rule."""
        allowed = ", ".join(f.value for f in Format)
        try:
            fmt = Format(format.value if isinstance(format, Format) else format)
        except ValueError:
            raise ValueError(f"format={format!r} is not one of {allowed}") from None
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len={seq_len!r} must be an int >= 2")
        if kwargs.get("chat_template") is not None:
            kwargs["chat_template"] = read_chat_template(kwargs["chat_template"])
        template_kwargs = kwargs.get("chat_template_kwargs")
        if template_kwargs is not None and not (
            isinstance(template_kwargs, dict) and all(isinstance(k, str) for k in template_kwargs)
        ):
            raise ValueError(
                f"chat_template_kwargs={template_kwargs!r} must map names to values "
                "(keyword arguments of the chat template, e.g. {enable_thinking: false})"
            )
        return cls(format=fmt, seq_len=seq_len, roles=check_roles(roles), **kwargs)

    @property
    def messages_key(self) -> str:
        """The field holding a conversation's messages."""
        if self.messages_field is not None:
            return self.messages_field
        return "conversations" if self.format is Format.SHAREGPT else "messages"

    @property
    def fields(self) -> tuple[str, ...]:
        """The record fields this format reads."""
        if self.format is Format.ALPACA:
            return ("instruction", "input", "output", "system")
        if self.format.is_chat:
            return (self.messages_key, self.tools_field)
        if self.format is Format.PROMPT_COMPLETION:
            return (self.prompt_field, self.completion_field)
        return (self.text_field,)


def check_roles(roles) -> dict[str, str]:
    """``roles=`` as a dict of strings. Raises ``ValueError`` naming the rule."""
    if roles is None:
        return {}
    if not isinstance(roles, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in roles.items()
    ):
        raise ValueError(f"roles={roles!r} must map the dataset's role names to role names")
    return dict(roles)
