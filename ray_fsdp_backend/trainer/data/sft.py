"""Chat and prompt/completion records for ``ray-fsdp train`` (``data.format``
``chat`` / ``sharegpt`` / ``alpaca`` / ``prompt_completion``).

On the driver, before any worker starts,
:func:`~ray_fsdp_backend.trainer.schema.sft.sft_input_errors` checks every
record with the checkpoint's tokenizer (cached, so the second check here
costs a hash of the files) and :func:`build_sft_datasets` builds the
datasets with exactly ``rfb.sft_dataset``: the training rows shuffled once
with ``train.seed`` and split by data-parallel group through
``rfb.MeshDataConfig`` like the text ``ray_data`` source (each epoch is then
reshuffled on its rank, :mod:`.sft_batches`), and the held-out rows
(``data.eval_path``, or the ``data.eval_fraction`` of the *records* a seeded
hash of each record's text picks, before rendering), materialised once in
the object store and read whole by every rank. The training rows of a small
dataset (:data:`SMALL_DATASET_BYTES`) are materialised too, built once for
every epoch.

What the workers make of the rows is :mod:`.sft_batches`. Nothing here
imports torch or Ray at module level: ``plan`` and ``validate`` run
:func:`~ray_fsdp_backend.trainer.schema.sft.sft_input_errors` (docs/parallelism.md, "Planning
a layout").
"""

from __future__ import annotations

from typing import Any

from ray_fsdp_backend.trainer.schema.sft import sft_options, split_options

EVAL_DATASET = "eval"
"""The held-out dataset's name among the trainer's datasets (not split by rank)."""

SMALL_DATASET_BYTES = 64 * 2**20
"""Record files up to this size (all of ``data.path``) have their training
rows built once and kept in Ray's object store: every epoch reads them
there instead of reading, rendering and tokenizing the records again (a
30-record set is an epoch a step). Rows take about 24 bytes a token
(``input_ids``, ``labels``, ``position_ids`` as int64) and text about 3-4
bytes a token, so 64 MiB of records is at most about 0.5 GiB of rows."""


def build_sft_datasets(spec, small_bytes: int = SMALL_DATASET_BYTES) -> dict[str, Any]:
    """``{"train": rows, "eval": held-out rows}`` (``eval`` only with an eval
    set): ``rfb.sft_dataset`` over ``data.path`` with the checkpoint's
    tokenizer, the training rows shuffled with ``train.seed`` and, when the
    record files hold at most ``small_bytes``, materialised."""
    import ray_fsdp_backend as rfb
    from ray_fsdp_backend.hf.metadata import load_tokenizer

    data, seed = spec.data, spec.train.seed
    tokenizer = load_tokenizer(spec.model.pretrained)
    options = sft_options(data, spec.model.seq_len)
    split = split_options(data, seed)
    rows = rfb.preference_dataset if data.format == "preference" else rfb.sft_dataset
    train = rows(data.path, tokenizer, **split, **options)
    held_out = None
    if data.eval_path is not None:
        held_out = rows(data.eval_path, tokenizer, **options)
    elif data.eval_fraction is not None:
        held_out = rows(data.path, tokenizer, split="eval", **split, **options)
    train = train.random_shuffle(seed=seed)
    if records_bytes(data.path) <= small_bytes:
        train = train.materialize()
    datasets = {"train": train}
    if held_out is not None:
        datasets[EVAL_DATASET] = held_out.materialize()
    return datasets


def records_bytes(path: str) -> int:
    """The size of the record files at ``path`` (a file or a directory)."""
    from ray_fsdp_backend.sft.records import resolve_source

    source = resolve_source(path)
    return sum(info.size for info in source.filesystem.get_file_info(list(source.files)))
