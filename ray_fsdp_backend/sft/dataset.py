"""The SFT pipeline on Ray Data: files -> records -> token rows, on CPU workers.

Records are read with ``ray.data.read_json`` (JSON lines) or
``ray.data.read_parquet``; one ``map_batches`` stage renders, tokenizes and
packs each batch of records (:data:`RECORDS_PER_BATCH`) into rows. The
pipeline streams: no stage needs the whole dataset, and nothing is
materialised on the driver. The driver reads only the first records of every
file (:func:`check_sft_source`) to refuse bad input before any worker starts.
"""

from __future__ import annotations

import os
from functools import partial

import numpy as np
import pyarrow.fs as pafs

from ray_fsdp_backend.sft.packing import PackCounts, pack_documents
from ray_fsdp_backend.sft.records import (
    Format,
    SFTDataError,
    SFTOptions,
    Source,
    read_head,
    resolve_source,
)
from ray_fsdp_backend.sft.render import has_chat_template, render_record

RECORDS_PER_BATCH = 1024
"""Records packed together: the more, the less padding (one partly filled
row at most per few rows of a batch); each batch is packed on its own."""

CHECKED_RECORDS = 16
"""Records of each file that :func:`check_sft_source` renders on the driver."""

PATH_COLUMN = "path"


def _options(format, seq_len, **kwargs) -> SFTOptions:
    return SFTOptions.build(format=format, seq_len=seq_len, **kwargs)


def check_sft_source(
    path: str | os.PathLike,
    tokenizer,
    *,
    format: str = "chat",
    seq_len: int,
    packing: bool = True,
    train_on_prompt: bool = False,
    messages_field: str = "messages",
    prompt_field: str = "prompt",
    completion_field: str = "completion",
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
    filesystem: pafs.FileSystem | None = None,
    records_per_file: int = CHECKED_RECORDS,
) -> Source:
    """Refuse bad input on the driver, before any worker starts; returns the source.

    Lists the files of ``path`` and renders the first ``records_per_file``
    records of each with ``tokenizer``, as the workers will. Arguments as
    :func:`sft_dataset`.

    Raises:
        ValueError: a bad option (``format``, ``seq_len``).
        SFTDataError: naming the file and the record: no such path, a file
            that is not JSON lines / parquet, a missing field, a role the
            chat template refuses, a tokenizer without ``chat_template``
            under format ``chat``, a dataset without a record.
    """
    options = _options(
        format,
        seq_len,
        packing=packing,
        train_on_prompt=train_on_prompt,
        messages_field=messages_field,
        prompt_field=prompt_field,
        completion_field=completion_field,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
    )
    if options.format is Format.CHAT and not has_chat_template(tokenizer, options):
        raise SFTDataError(
            f"format 'chat' needs a tokenizer with a chat_template; "
            f"{type(tokenizer).__name__} {getattr(tokenizer, 'name_or_path', '')!r} has none: "
            "set chat_template or use format 'prompt_completion' / 'text'"
        )
    source = resolve_source(path, filesystem)
    seen = 0
    for file in source.files:
        for i, record in enumerate(read_head(source, file, records_per_file)):
            render_record(record, tokenizer, options, f"{file!r} record {i}")
            seen += 1
    if not seen:
        raise SFTDataError(
            f"data path {os.fspath(path)!r} holds no record ({len(source.files)} file(s))"
        )
    return source


def read_records(source: Source):
    """The records of ``source`` as a Ray dataset, each with its file in ``path``."""
    import ray.data

    from ray_fsdp_backend.storage.retrying_fs import unwrap

    fs = unwrap(source.filesystem)
    files = list(source.files)
    if source.kind == "parquet":
        return ray.data.read_parquet(files, filesystem=fs, include_paths=True)
    # Arrow's JSON reader (lines=False) reads JSON lines; Ray 2.60 refuses
    # filesystem= with lines=True.
    return ray.data.read_json(files, filesystem=fs, include_paths=True)


def pad_token_id(tokenizer) -> int:
    """The id padding uses: the tokenizer's pad token, else EOS, else 0 (never a target)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return 0


def rows_from_batch(batch, tokenizer, options: SFTOptions, counts: PackCounts | None = None):
    """Ray Data ``map_batches`` function (``batch_format="pyarrow"``): a batch of
    records to packed (or padded) rows."""
    table = batch
    paths = table.column(PATH_COLUMN).to_pylist() if PATH_COLUMN in table.column_names else None
    keep = [f for f in options.fields if f in table.column_names]
    columns = {f: table.column(f).to_pylist() for f in keep}
    documents = []
    for i in range(table.num_rows):
        record = {f: columns[f][i] for f in keep}
        where = f"a record of {paths[i]!r}" if paths else f"record {i} of a batch"
        documents.extend(render_record(record, tokenizer, options, where))
    return pack_documents(
        documents,
        options.seq_len,
        pad_token_id(tokenizer),
        packing=options.packing,
        split=options.format is Format.TEXT,
        counts=counts,
    )


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
    messages_field: str = "messages",
    prompt_field: str = "prompt",
    completion_field: str = "completion",
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
    filesystem: pafs.FileSystem | None = None,
):
    """A ``ray.data.Dataset`` of supervised fine-tuning rows from chat,
    prompt/completion or text records.

    Rows hold ``input_ids``, ``labels`` (aligned with ``input_ids`` as
    transformers takes them, unshifted; -100 where there is no loss) and
    ``position_ids`` (0 at every document start), each ``seq_len`` long.
    See docs/sft.md for the formats, masks and packing rules.

    Args:
        path: a JSON-lines or parquet file or a directory of them; local,
            ``s3://`` / ``gs://``, or a path on ``filesystem``.
        tokenizer: a fast Hugging Face tokenizer (its ``chat_template``
            renders ``chat`` records).
        format: ``"chat"``, ``"prompt_completion"`` or ``"text"``.
        seq_len: tokens per row.
        packing: several documents a row (first-fit decreasing); else one a row.
        train_on_prompt: the loss on every token, not only the answers.
        messages_field, prompt_field, completion_field: record field names.
        chat_template: a Jinja template, or the path of a file holding one,
            replacing the tokenizer's (docs/sft-rows.md).
        chat_template_kwargs: keyword arguments of every template call
            (``{"enable_thinking": False}``).
        filesystem: a ``pyarrow.fs`` filesystem ``path`` lives on.

    Raises:
        ValueError / SFTDataError: before any Ray work (see :func:`check_sft_source`).
    """
    kwargs = dict(
        format=format,
        seq_len=seq_len,
        packing=packing,
        train_on_prompt=train_on_prompt,
        messages_field=messages_field,
        prompt_field=prompt_field,
        completion_field=completion_field,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
    )
    source = check_sft_source(path, tokenizer, filesystem=filesystem, **kwargs)
    return rows_from_records(read_records(source), tokenizer, _options(**kwargs))


def sft_stats(path, tokenizer, *, filesystem=None, **kwargs) -> dict[str, int]:
    """What :func:`sft_dataset` with the same arguments makes of the data, as
    sums over the whole dataset (one streamed pass): ``records``,
    ``documents``, ``truncated``, ``split``, ``dropped``, ``rows``, ``tokens``,
    ``padding``, ``targets``, and ``padding_fraction`` (padding / row tokens)."""
    source = check_sft_source(path, tokenizer, filesystem=filesystem, **kwargs)
    options = _options(**kwargs)
    fn = partial(counts_from_batch, tokenizer=tokenizer, options=options)
    counts = read_records(source).map_batches(
        fn, batch_size=RECORDS_PER_BATCH, batch_format="pyarrow"
    )
    names = list(PackCounts().as_dict())
    sums = counts.sum(names)
    totals = {name: int(sums[f"sum({name})"]) for name in names}
    cells = totals["rows"] * options.seq_len
    totals["padding_fraction"] = totals["padding"] / cells if cells else 0.0
    return totals
