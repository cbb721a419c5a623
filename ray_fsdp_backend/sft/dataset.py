"""The SFT pipeline on Ray Data: files -> records -> token rows, on CPU workers.

Before any Ray work, :func:`check_sft_source` reads, renders and packs every
record on the driver (:mod:`.check`; cached) and refuses bad input naming
each record (``FILE:LINE`` / ``FILE#ROW``). The workers then read each file
whole (``ray.data.read_binary_files``) and cut it into records with the same
function as the check (:func:`~ray_fsdp_backend.sft.records.file_records`),
keep those of the asked split (``eval_fraction``: a seeded hash of each
record's text, before rendering), and one ``map_batches`` stage renders,
tokenizes and packs each batch of records (:data:`RECORDS_PER_BATCH`) into
rows. Nothing is materialised on the driver.
"""

from __future__ import annotations

import dataclasses
import io
import os
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from ray_fsdp_backend.sft import check_cache
from ray_fsdp_backend.sft.check import (
    RECORDS_PER_BATCH,
    RecordCheck,
    check_records,
    pack_rows,
    pad_token_id,
)
from ray_fsdp_backend.sft.packing import PackCounts
from ray_fsdp_backend.sft.records import (
    RawRecord,
    SFTDataError,
    SFTOptions,
    Source,
    file_records,
    is_held_out,
    parse_record,
    resolve_source,
)
from ray_fsdp_backend.sft.render import has_chat_template, render_record

__all__ = ["RECORDS_PER_BATCH", "check_sft_source", "pad_token_id", "sft_dataset", "sft_stats"]

SPLIT_NAMES = ("train", "eval")
_RECORD_SCHEMA = pa.schema([("where", pa.string()), ("text", pa.string())])


def _options(format="chat", seq_len=None, **kwargs) -> SFTOptions:
    return SFTOptions.build(format=format, seq_len=seq_len, **kwargs)


def check_sft_source(
    path: str | os.PathLike,
    tokenizer,
    *,
    eval_fraction: float | None = None,
    seed: int = 0,
    filesystem: pafs.FileSystem | None = None,
    cache: bool = True,
    **options,
) -> RecordCheck:
    """Every record of ``path`` checked on the driver, before any worker starts.

    Reads, renders and packs every record as :func:`sft_dataset` with the
    same arguments will (``options``: its ``format``, ``seq_len`` and the
    rest), and splits them by ``eval_fraction`` / ``seed``. The result is
    cached by the files' content, the tokenizer and the options
    (:mod:`.check_cache`; ``cache=False`` always reads).

    Returns:
        The :class:`~ray_fsdp_backend.sft.check.RecordCheck`: per split, the
        records read, rendered, truncated, dropped, the rows and the padding;
        its ``source`` the files.

    Raises:
        ValueError: a bad option (``format``, ``seq_len``, ``roles``,
            ``chat_template``, ``chat_template_kwargs``).
        SFTDataError: no such path, a file that is neither JSON lines nor
            parquet, no chat template under a chat format, no record at all;
            or bad records, each named ``FILE:LINE`` (``FILE#ROW``) with what
            is wrong (the first 20, and how many more), then the counts.
    """
    opts = _options(**options)
    if opts.format.is_chat and not has_chat_template(tokenizer, opts):
        raise SFTDataError(
            f"format {opts.format.value!r} needs a tokenizer with a chat_template; "
            f"{type(tokenizer).__name__} {getattr(tokenizer, 'name_or_path', '')!r} has none: "
            "set chat_template or use format 'prompt_completion' / 'text'"
        )
    source = resolve_source(path, filesystem)
    # the options as checked: a chat_template file's text, not its path
    settings = {**dataclasses.asdict(opts), "eval_fraction": eval_fraction, "seed": seed}
    key = check_cache.check_key(source, tokenizer, settings) if cache else None
    found = check_cache.load(key, RecordCheck) if key else None
    if found is None:
        found = check_records(source, tokenizer, opts, eval_fraction, seed)
        if key:
            check_cache.store(key, found.cached())
    found.source = source
    if found.problem_count:
        raise found.error(os.fspath(path))
    if not sum(c["records"] for c in found.counts.values()):
        raise SFTDataError(
            f"data path {os.fspath(path)!r} holds no record ({len(source.files)} file(s))"
        )
    return found


def records_from_file(batch: pa.Table, kind: str, eval_fraction, seed: int, split: str):
    """Ray Data ``map_batches`` function (one file a batch): the file's bytes
    to its records of ``split`` (``where``, ``text``)."""
    rows = {"where": [], "text": []}
    files = zip(batch.column("path").to_pylist(), batch.column("bytes").to_pylist(), strict=True)
    for path, data in files:
        for raw in file_records(kind, path, io.BytesIO(data)):
            if is_held_out(raw, eval_fraction, seed) == (split == "eval"):
                rows["where"].append(raw.where)
                rows["text"].append(raw.text)
    return pa.table(rows, schema=_RECORD_SCHEMA)


def read_records(source: Source, eval_fraction=None, seed: int = 0, split: str = "train"):
    """The records of ``source`` in ``split`` as a Ray dataset (``where``, ``text``)."""
    import ray.data

    from ray_fsdp_backend.storage.retrying_fs import unwrap

    files = ray.data.read_binary_files(
        list(source.files), filesystem=unwrap(source.filesystem), include_paths=True
    )
    fn = partial(
        records_from_file, kind=source.kind, eval_fraction=eval_fraction, seed=seed, split=split
    )
    return files.map_batches(fn, batch_size=1, batch_format="pyarrow")


def rows_from_batch(batch, tokenizer, options: SFTOptions, counts: PackCounts | None = None):
    """Ray Data ``map_batches`` function (``batch_format="pyarrow"``): a batch of
    records (:func:`read_records`) to packed (or padded) rows."""
    documents = []
    places, texts = batch.column("where").to_pylist(), batch.column("text").to_pylist()
    for where, text in zip(places, texts, strict=True):
        raw = RawRecord(where, text)
        documents.extend(render_record(parse_record(raw), tokenizer, options, where))
    return pack_rows(documents, options, tokenizer, counts, records=len(places))


def counts_from_batch(batch, tokenizer, options: SFTOptions) -> dict[str, np.ndarray]:
    """Ray Data ``map_batches`` function: a batch of records to one row of
    :class:`~ray_fsdp_backend.sft.packing.PackCounts`."""
    counts = PackCounts()
    rows_from_batch(batch, tokenizer, options, counts)
    return {k: np.array([v]) for k, v in counts.as_dict().items()}


def rows_from_records(records, tokenizer, options: SFTOptions):
    """``records`` (a Ray dataset as :func:`read_records` gives, or any split
    of it) to rows of ``options.seq_len`` tokens."""
    fn = partial(rows_from_batch, tokenizer=tokenizer, options=options)
    return records.map_batches(fn, batch_size=RECORDS_PER_BATCH, batch_format="pyarrow")


def sft_dataset(
    path: str | os.PathLike,
    tokenizer,
    *,
    format: str = "chat",
    seq_len: int,
    packing: bool = True,
    train_on_prompt: bool = False,
    messages_field: str | None = None,
    prompt_field: str = "prompt",
    completion_field: str = "completion",
    tools_field: str = "tools",
    roles: dict[str, str] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
    eval_fraction: float | None = None,
    split: str = "train",
    seed: int = 0,
    filesystem: pafs.FileSystem | None = None,
):
    """A ``ray.data.Dataset`` of supervised fine-tuning rows from chat,
    ShareGPT, Alpaca, prompt/completion or text records.

    Rows hold ``input_ids``, ``labels`` (aligned with ``input_ids`` as
    transformers takes them, unshifted; -100 where there is no loss) and
    ``position_ids`` (0 at every document start), each ``seq_len`` long.
    See docs/sft.md for the formats, masks and packing rules.

    Args:
        path: a JSON-lines or parquet file or a directory of them; local,
            ``s3://`` / ``gs://``, or a path on ``filesystem``.
        tokenizer: a fast Hugging Face tokenizer (its ``chat_template``
            renders conversations).
        format: ``"chat"``, ``"sharegpt"``, ``"alpaca"``,
            ``"prompt_completion"`` or ``"text"``.
        seq_len: tokens per row.
        packing: several documents a row (first-fit decreasing); else one a row.
        train_on_prompt: the loss on every token, not only the answers.
        messages_field, prompt_field, completion_field: record field names
            (``messages_field`` None: ``messages``, ``conversations`` under sharegpt).
        tools_field: the field of a record's tool schemas, passed to the template.
        roles: the dataset's role names to the template's (``{"bot": "assistant"}``).
        chat_template: a Jinja template, or the path of a file holding one,
            replacing the tokenizer's (docs/sft-rows.md).
        chat_template_kwargs: keyword arguments of every template call
            (``{"enable_thinking": False}``).
        eval_fraction: hold out this fraction of the records (0 < f < 1), picked
            by a hash of each record's text seeded by ``seed``, before rendering.
        split: ``"train"`` (the records not held out) or ``"eval"`` (the held-out ones).
        seed: the held-out split's seed.
        filesystem: a ``pyarrow.fs`` filesystem ``path`` lives on.

    Raises:
        ValueError / SFTDataError: before any Ray work (see :func:`check_sft_source`).
    """
    if split not in SPLIT_NAMES or (split == "eval" and not eval_fraction):
        raise ValueError(f"split={split!r} must be 'train', or 'eval' with an eval_fraction")
    options = dict(
        format=format,
        seq_len=seq_len,
        packing=packing,
        train_on_prompt=train_on_prompt,
        messages_field=messages_field,
        prompt_field=prompt_field,
        completion_field=completion_field,
        tools_field=tools_field,
        roles=roles,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
    )
    checked = check_sft_source(
        path, tokenizer, eval_fraction=eval_fraction, seed=seed, filesystem=filesystem, **options
    )
    if not checked.counts[split]["records"]:
        raise SFTDataError(
            f"eval_fraction={eval_fraction} with seed={seed} holds out none of the "
            f"{checked.counts['train']['records']} records of {os.fspath(path)!r}; "
            "raise eval_fraction or give more records"
        )
    records = read_records(checked.source, eval_fraction, seed, split)
    return rows_from_records(records, tokenizer, _options(**options))


def sft_stats(path, tokenizer, *, filesystem=None, **kwargs) -> dict[str, int]:
    """What :func:`sft_dataset` with the same arguments makes of the data, as
    sums over the whole dataset (one streamed pass on Ray Data): ``records``,
    ``documents``, ``truncated``, ``split``, ``dropped``, ``rows``, ``tokens``,
    ``padding``, ``targets``, and ``padding_fraction`` (padding / row tokens)."""
    split = {k: kwargs.pop(k) for k in ("eval_fraction", "seed", "split") if k in kwargs}
    checked = check_sft_source(path, tokenizer, filesystem=filesystem, **split, **kwargs)
    options = _options(**kwargs)
    fn = partial(counts_from_batch, tokenizer=tokenizer, options=options)
    records = read_records(
        checked.source,
        split.get("eval_fraction"),
        split.get("seed", 0),
        split.get("split", "train"),
    )
    counts = records.map_batches(fn, batch_size=RECORDS_PER_BATCH, batch_format="pyarrow")
    names = list(PackCounts().as_dict())
    sums = counts.sum(names)
    totals = {name: int(sums[f"sum({name})"]) for name in names}
    cells = totals["rows"] * options.seq_len
    totals["padding_fraction"] = totals["padding"] / cells if cells else 0.0
    return totals
