"""The ``data:`` section of an SFT run (``data.format`` ``chat`` /
``sharegpt`` / ``alpaca`` / ``prompt_completion``) as ``rfb.sft_dataset``'s
arguments, and what ``rfb.sft_dataset`` would refuse in its records, found on
the driver with the checkpoint's tokenizer (every record: ``check_sft_source``),
with the rows each data-parallel rank would get against one micro-batch. No
torch or Ray: ``plan`` and ``validate`` run it."""

from __future__ import annotations

from typing import Any

from ray_fsdp_backend.planning.elastic import split_global_batch, worker_range


def sft_options(data, seq_len: int) -> dict[str, Any]:
    """``rfb.sft_dataset``'s keyword arguments from the ``data:`` section
    (the held-out split's are :func:`split_options`); ``rfb.preference_dataset``'s
    under ``format: preference``."""
    if data.format == "preference":
        return preference_options(data, seq_len)
    return dict(
        format=data.format,
        seq_len=seq_len,
        packing=data.packing,
        train_on_prompt=data.train_on_prompt,
        messages_field=data.messages_field,
        prompt_field=data.prompt_field,
        completion_field=data.completion_field,
        tools_field=data.tools_field,
        roles=data.roles,
        chat_template=data.chat_template,
        chat_template_kwargs=data.chat_template_kwargs,
    )


def preference_options(data, seq_len: int) -> dict[str, Any]:
    """``rfb.preference_dataset``'s keyword arguments from the ``data:`` section."""
    return dict(
        seq_len=seq_len,
        packing=data.packing,
        prompt_field=data.prompt_field,
        chosen_field=data.chosen_field,
        rejected_field=data.rejected_field,
        tools_field=data.tools_field,
        roles=data.roles,
        chat_template=data.chat_template,
        chat_template_kwargs=data.chat_template_kwargs,
    )


def split_options(data, seed: int) -> dict[str, Any]:
    """``eval_fraction`` and ``seed`` for ``data.path`` (``train.seed`` seeds the split)."""
    return {"eval_fraction": data.eval_fraction, "seed": seed}


def sft_input_errors(data, model, train=None, scaling=None, group: int = 1) -> list[str]:
    """What ``rfb.sft_dataset`` would refuse in ``data.path`` (and
    ``data.eval_path``): every record checked with the checkpoint's tokenizer,
    each problem named ``FILE:LINE`` (``FILE#ROW``); then, with ``train`` and
    ``scaling``, a training set that would leave a data-parallel rank fewer
    rows than one micro-batch, or an empty held-out set. ``group``: the ranks
    of one tp x cp x pp group (they share a dp rank's rows)."""
    from ray_fsdp_backend.hf.metadata import load_tokenizer
    from ray_fsdp_backend.preference.dataset import check_preference_source
    from ray_fsdp_backend.sft import check_sft_source

    try:
        tokenizer = load_tokenizer(model.pretrained)
    except (OSError, ValueError) as exc:
        return [f"model.pretrained={model.pretrained!r}: its tokenizer cannot be loaded: {exc}"]
    seed = train.seed if train is not None else 0
    options = sft_options(data, model.seq_len)
    checks = {"data.path": (data.path, split_options(data, seed))}
    if data.eval_path is not None:
        checks["data.eval_path"] = (data.eval_path, {})
    check = check_preference_source if data.format == "preference" else check_sft_source
    errors, rows = [], {}
    for key, (path, split) in checks.items():
        try:
            counts = check(path, tokenizer, **split, **options).counts
        except (OSError, ValueError) as exc:  # SFTDataError is a ValueError
            errors.append(f"{key}={path!r}: {exc}")
            continue
        rows["train" if key == "data.path" else "eval"] = counts["train"]["rows"]
        if data.eval_fraction is not None:
            rows["eval"] = counts["eval"]["rows"]
    if errors or train is None or scaling is None:
        return errors
    return row_errors(data, rows, train, scaling, group)


def row_errors(data, rows: dict[str, int], train, scaling, group: int) -> list[str]:
    """PURE: too few training rows for one micro-batch on every dp rank at
    the largest worker count (``streaming_split(equal=True)`` gives each
    ``rows // dp`` rows), or a held-out set with no row."""
    dp = max(1, worker_range(scaling.num_workers)[1] // group)
    micro = train.micro_batch_size
    if train.global_batch_size is not None and train.global_batch_size % dp == 0:
        micro = split_global_batch(train.global_batch_size, dp, micro).micro_batch_size
    errors = []
    if "train" in rows and rows["train"] // dp < micro:
        held = f" after data.eval_fraction={data.eval_fraction}" if data.eval_fraction else ""
        errors.append(
            f"data.path={data.path!r} packs into {rows['train']} training row(s) of "
            f"model.seq_len tokens{held}: {rows['train'] // dp} per data-parallel rank at "
            f"{dp} rank(s), fewer than one micro-batch of train.micro_batch_size={micro}; "
            f"give at least {micro * dp} rows (more records), or lower "
            "train.micro_batch_size, scaling.num_workers or model.seq_len"
        )
    if rows.get("eval") == 0:
        key = "data.eval_path" if data.eval_path is not None else "data.eval_fraction"
        errors.append(f"{key}: the held-out set has no row; raise eval_fraction or add records")
    return errors
