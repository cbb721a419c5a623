"""Prompt records for online RL (``data.format: prompts``): read, checked, rendered to token ids.

A record holds the prompt in ``prompt_field`` (default ``prompt``): text,
tokenized as written, or a list of chat messages (the data door's roles,
tools and parts rules, :mod:`ray_fsdp_backend.sft.conversation`) rendered
with the tokenizer's chat template (or ``chat_template``) and its
generation prompt, as the model sees it at inference. Every other field of
the record goes to the reward function (a reference answer, a test case).

:func:`read_prompts` reads every record once, in file order, and refuses the
whole set with every problem named ``FILE:LINE`` (parquet ``FILE#ROW``): not
JSON, no prompt, a prompt the template refuses, a prompt that leaves fewer
than ``max_tokens`` of ``seq_len`` for the response. The driver calls it
before Ray starts (``ray-fsdp validate`` / ``plan`` / ``train``); the
trainer's rank 0 calls it again to sample from (prompt sets are small: a
few thousand prompts are a few MB of token ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray_fsdp_backend.sft.conversation import chat_messages, record_tools
from ray_fsdp_backend.sft.options import Format, SFTDataError, SFTOptions
from ray_fsdp_backend.sft.records import open_records, parse_record, resolve_source
from ray_fsdp_backend.sft.render import ChatRenderer, has_chat_template

PROBLEMS_SHOWN = 20


@dataclass
class Prompts:
    """The prompt set: per record its token ids, its prompt as written and
    its other fields."""

    token_ids: list[list[int]] = field(default_factory=list)
    prompts: list[Any] = field(default_factory=list)
    fields: list[dict] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)


def read_prompts(
    path: str,
    tokenizer,
    *,
    seq_len: int,
    max_tokens: int,
    prompt_field: str = "prompt",
    tools_field: str = "tools",
    roles=None,
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
    filesystem=None,
) -> Prompts:
    """Every prompt record of ``path`` (JSONL / parquet, a file or a
    directory, local or a URI) as token ids.

    Raises:
        SFTDataError: listing every refused record as ``FILE:LINE: what``
            (the first :data:`PROBLEMS_SHOWN` and a count of the rest), or
            naming ``path`` when it holds no record.
    """
    options = SFTOptions.build(
        format=Format.CHAT,
        seq_len=seq_len,
        messages_field=prompt_field,
        tools_field=tools_field,
        roles=roles,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
    )
    source = resolve_source(path, filesystem)
    out, problems, count = Prompts(), [], 0
    for file in source.files:
        for raw in open_records(source, file):
            try:
                record = parse_record(raw)
                ids = prompt_token_ids(record, tokenizer, options, prompt_field, raw.where)
                if len(ids) + max_tokens > seq_len:
                    raise SFTDataError(
                        f"{raw.where}: the prompt is {len(ids)} tokens: with "
                        f"rollout.max_tokens={max_tokens} it exceeds model.seq_len={seq_len}"
                    )
            except SFTDataError as exc:
                count += 1
                if len(problems) < PROBLEMS_SHOWN:
                    problems.append(str(exc))
                continue
            out.token_ids.append(ids)
            out.prompts.append(record[prompt_field])
            out.fields.append({k: v for k, v in record.items() if k != prompt_field})
    if problems:
        rest = [f"... and {count - len(problems)} more"] if count > len(problems) else []
        listed = "\n  ".join([*problems, *rest])
        raise SFTDataError(f"{count} prompt record(s) of {path} are refused:\n  {listed}")
    if not out:
        raise SFTDataError(f"{path} holds no prompt record")
    return out


def prompt_token_ids(record: dict, tokenizer, options: SFTOptions, key: str, where: str):
    """One record's prompt as token ids (see the module docstring)."""
    if key not in record or record[key] is None:
        raise SFTDataError(f"{where}: no {key!r} field (its fields: {', '.join(record)})")
    value = record[key]
    if isinstance(value, str):
        if not value:
            raise SFTDataError(f"{where}: the prompt is empty")
        return list(tokenizer(value, add_special_tokens=True)["input_ids"])
    if not has_chat_template(tokenizer, options):
        raise SFTDataError(
            f"{where}: the prompt is chat messages and the tokenizer has no chat template "
            "(set data.chat_template)"
        )
    messages = chat_messages(value, options, where)
    if messages and messages[-1]["role"] == "assistant":
        raise SFTDataError(
            f"{where}: the prompt ends with an assistant turn; the response is what is sampled"
        )
    renderer = ChatRenderer.build(tokenizer, options, record_tools(record, options, where))
    try:
        text = renderer.render(messages, generation=True)
    except Exception as exc:  # the template's own refusal (jinja raise_exception)
        raise SFTDataError(f"{where}: the chat template refuses the prompt: {exc}") from exc
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
