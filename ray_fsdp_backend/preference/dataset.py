"""Preference pairs on Ray Data: files -> records -> packed pair rows, on CPU
workers, exactly as :mod:`ray_fsdp_backend.sft.dataset` builds SFT rows.

Before any Ray work :func:`check_preference_source` checks every record on
the driver (:mod:`.check`; cached like SFT's check) and refuses bad pairs
naming each (``FILE:LINE`` / ``FILE#ROW``). The workers then read each file
whole, cut it into records with SFT's reader, number them (``pair_index``:
the file's first index, from the check, plus the record's place in the file),
keep those of the asked split (``eval_fraction``: a seeded hash of each
record's text, before rendering) and render and pack each batch of records
into rows (:mod:`.packing`).
"""

from __future__ import annotations

import dataclasses
import io
import os
from functools import partial

import pyarrow as pa
import pyarrow.fs as pafs

from ray_fsdp_backend.preference.check import PairCheck, check_pairs, pack_pair_rows
from ray_fsdp_backend.preference.packing import PairCounts
from ray_fsdp_backend.preference.pairs import PreferenceOptions, read_pair
from ray_fsdp_backend.preference.render import pair_documents
from ray_fsdp_backend.sft import check_cache
from ray_fsdp_backend.sft.check import RECORDS_PER_BATCH
from ray_fsdp_backend.sft.records import (
    RawRecord,
    SFTDataError,
    file_records,
    is_held_out,
    parse_record,
    resolve_source,
)

__all__ = ["check_preference_source", "preference_dataset"]

ROW_COLUMNS = ("input_ids", "labels", "position_ids", "sequence_ids", "pair_index")
"""The columns of every row, each ``seq_len`` int64 values (:mod:`.packing`)."""

_RECORD_SCHEMA = pa.schema([("where", pa.string()), ("text", pa.string()), ("index", pa.int64())])
CHECK_VERSION = 1
"""Bumped when what the preference check computes changes (part of its cache key)."""


def check_preference_source(
    path: str | os.PathLike,
    tokenizer,
    *,
    seq_len: int,
    eval_fraction: float | None = None,
    seed: int = 0,
    filesystem: pafs.FileSystem | None = None,
    cache: bool = True,
    **options,
) -> PairCheck:
    """Every preference record of ``path`` checked on the driver, before any
    worker starts (a function of its own, not ``check_sft_source(format=...)``:
    its records, counts and rows differ).

    Reads, renders and packs every pair as :func:`preference_dataset` with the
    same arguments will (``options``: its field names, ``packing`` and chat
    options) and splits them by ``eval_fraction`` / ``seed``; cached by the
    files' content, the tokenizer and the options (``cache=False`` always reads).

    Returns:
        The :class:`~ray_fsdp_backend.preference.check.PairCheck`: per split
        the pairs rendered, truncated, packed, the rows and padding.

    Raises:
        ValueError: a bad option.
        SFTDataError: no such path, no record, or bad records, each named
            ``FILE:LINE`` (``FILE#ROW``) with what is wrong, then the counts.
    """
    opts = PreferenceOptions.build(seq_len=seq_len, **options)
    source = resolve_source(path, filesystem)
    settings = {
        "preference": CHECK_VERSION,
        **dataclasses.asdict(opts),
        "eval_fraction": eval_fraction,
        "seed": seed,
    }
    key = check_cache.check_key(source, tokenizer, settings) if cache else None
    found = check_cache.load(key, PairCheck) if key else None
    if found is None:
        found = check_pairs(source, tokenizer, opts, eval_fraction, seed)
        if key:
            check_cache.store(key, found.cached())
    found.source = source
    if found.problem_count:
        raise found.error(os.fspath(path))
    if not found.read:
        raise SFTDataError(
            f"data path {os.fspath(path)!r} holds no record ({len(source.files)} file(s))"
        )
    return found


def records_from_file(batch: pa.Table, kind: str, offsets: dict, eval_fraction, seed, split):
    """Ray Data ``map_batches`` function (one file a batch): the file's bytes
    to its records of ``split``: ``where``, ``text``, ``index`` (``pair_index``)."""
    rows = {"where": [], "text": [], "index": []}
    files = zip(batch.column("path").to_pylist(), batch.column("bytes").to_pylist(), strict=True)
    for path, data in files:
        for k, raw in enumerate(file_records(kind, path, io.BytesIO(data))):
            if is_held_out(raw, eval_fraction, seed) == (split == "eval"):
                rows["where"].append(raw.where)
                rows["text"].append(raw.text)
                rows["index"].append(offsets[path] + k)
    return pa.table(rows, schema=_RECORD_SCHEMA)


def rows_from_batch(batch, tokenizer, options: PreferenceOptions, counts: PairCounts | None = None):
    """Ray Data ``map_batches`` function: a batch of records to pair rows."""
    pairs = []
    columns = (batch.column(c).to_pylist() for c in ("where", "text"))
    for where, text in zip(*columns, strict=True):
        pair = read_pair(parse_record(RawRecord(where, text)), options, where)
        pairs.append(pair_documents(pair, tokenizer, options, where))
    indices = batch.column("index").to_pylist()
    return pack_pair_rows(pairs, indices, options, tokenizer, counts)


def preference_dataset(
    path: str | os.PathLike,
    tokenizer,
    *,
    seq_len: int,
    packing: bool = True,
    prompt_field: str = "prompt",
    chosen_field: str = "chosen",
    rejected_field: str = "rejected",
    tools_field: str = "tools",
    roles: dict[str, str] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
    eval_fraction: float | None = None,
    split: str = "train",
    seed: int = 0,
    filesystem: pafs.FileSystem | None = None,
):
    """A ``ray.data.Dataset`` of preference rows from ``{prompt, chosen,
    rejected}`` records (text or chat messages; docs/preference.md).

    Each row holds :data:`ROW_COLUMNS`, ``seq_len`` int64 values each:
    ``input_ids``, ``labels`` (unshifted, -100 on prompts and padding),
    ``position_ids`` (0 at every document start) as SFT rows, and per token
    ``sequence_ids`` (pair ``p`` of the row: ``2p`` its chosen document,
    ``2p + 1`` its rejected one; padding -1) and ``pair_index`` (the pair's
    record's place among all records of ``path``, both splits, counted from 0
    over the files in sorted order: the same across epochs, restarts, worker
    counts and splits, for as long as the files are; padding -1). A pair's
    two documents always share a row.

    Args:
        path: a JSON-lines or parquet file or a directory of them; local,
            ``s3://`` / ``gs://``, or a path on ``filesystem``.
        tokenizer: a fast Hugging Face tokenizer (its ``chat_template``
            renders conversational pairs).
        seq_len: tokens per row; a pair longer has its responses cut, one
            whose prompts leave no room is refused by the check.
        packing: several pairs a row (first-fit decreasing); else one a row.
        prompt_field, chosen_field, rejected_field: the record's fields
            (TRL's names by default); no prompt field: the prompt is the
            responses' shared prefix (TRL's ``extract_prompt``).
        tools_field, roles, chat_template, chat_template_kwargs: as
            :func:`~ray_fsdp_backend.sft.sft_dataset` takes them.
        eval_fraction, split, seed: the held-out records, as ``sft_dataset``
            picks them (a seeded hash of each record's text).
        filesystem: a ``pyarrow.fs`` filesystem ``path`` lives on.

    Raises:
        ValueError / SFTDataError: before any Ray work (see
            :func:`check_preference_source`).
    """
    if split not in ("train", "eval") or (split == "eval" and not eval_fraction):
        raise ValueError(f"split={split!r} must be 'train', or 'eval' with an eval_fraction")
    options = dict(
        packing=packing,
        prompt_field=prompt_field,
        chosen_field=chosen_field,
        rejected_field=rejected_field,
        tools_field=tools_field,
        roles=roles,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
    )
    checked = check_preference_source(
        path,
        tokenizer,
        seq_len=seq_len,
        eval_fraction=eval_fraction,
        seed=seed,
        filesystem=filesystem,
        **options,
    )
    if not checked.counts[split]["records"]:
        raise SFTDataError(
            f"eval_fraction={eval_fraction} with seed={seed} holds out none of the "
            f"{checked.counts['train']['records']} pairs of {os.fspath(path)!r}; "
            "raise eval_fraction or give more records"
        )
    return _rows(
        checked,
        tokenizer,
        PreferenceOptions.build(seq_len=seq_len, **options),
        eval_fraction,
        seed,
        split,
    )


def _rows(checked: PairCheck, tokenizer, options: PreferenceOptions, eval_fraction, seed, split):
    import ray.data

    from ray_fsdp_backend.storage.retrying_fs import unwrap

    source = checked.source
    files = ray.data.read_binary_files(
        list(source.files), filesystem=unwrap(source.filesystem), include_paths=True
    )
    read = partial(
        records_from_file,
        kind=source.kind,
        offsets=checked.offsets(),
        eval_fraction=eval_fraction,
        seed=seed,
        split=split,
    )
    records = files.map_batches(read, batch_size=1, batch_format="pyarrow")
    render = partial(rows_from_batch, tokenizer=tokenizer, options=options)
    return records.map_batches(render, batch_size=RECORDS_PER_BATCH, batch_format="pyarrow")
