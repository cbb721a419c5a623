"""The ``data:`` section of an SFT run (``data.format`` ``chat`` /
``prompt_completion``) as ``rfb.sft_dataset``'s arguments, and what
``rfb.sft_dataset`` would refuse in its records, found on the driver with the
checkpoint's tokenizer. No torch or Ray: ``plan`` and ``validate`` run it."""

from __future__ import annotations

from typing import Any


def sft_options(data, seq_len: int) -> dict[str, Any]:
    """``rfb.sft_dataset``'s keyword arguments from the ``data:`` section."""
    return dict(
        format=data.format,
        seq_len=seq_len,
        packing=data.packing,
        train_on_prompt=data.train_on_prompt,
        messages_field=data.messages_field,
        prompt_field=data.prompt_field,
        completion_field=data.completion_field,
        chat_template=data.chat_template,
        chat_template_kwargs=data.chat_template_kwargs,
    )


def _paths(data) -> dict[str, str]:
    """The record paths and the keys that name them in messages."""
    paths = {"data.path": data.path}
    if data.eval_path is not None:
        paths["data.eval_path"] = data.eval_path
    return paths


def sft_input_errors(data, model) -> list[str]:
    """What ``rfb.sft_dataset`` would refuse in ``data.path`` (and
    ``data.eval_path``), found on the driver with the checkpoint's tokenizer
    (``check_sft_source``: the first records of every file); each message
    names the key, the file and the record."""
    from ray_fsdp_backend.hf.metadata import load_tokenizer
    from ray_fsdp_backend.sft import check_sft_source

    try:
        tokenizer = load_tokenizer(model.pretrained)
    except (OSError, ValueError) as exc:
        return [f"model.pretrained={model.pretrained!r}: its tokenizer cannot be loaded: {exc}"]
    errors = []
    for key, path in _paths(data).items():
        try:
            check_sft_source(path, tokenizer, **sft_options(data, model.seq_len))
        except (OSError, ValueError) as exc:  # SFTDataError is a ValueError
            errors.append(f"{key}={path!r}: {exc}")
    return errors
