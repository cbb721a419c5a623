"""Chat and prompt/completion records for ``ray-fsdp train`` (``data.format``
``chat`` / ``prompt_completion``).

On the driver, before any worker starts, :func:`sft_input_errors` reads the
records with the checkpoint's tokenizer (a missing field, no chat template,
an empty dataset, a file that is not JSON / parquet) and
:func:`build_sft_datasets` builds the datasets with exactly
``rfb.sft_dataset``: the training rows in a seeded order, split by
data-parallel group through ``rfb.MeshDataConfig`` like the text
``ray_data`` source, and the held-out rows (``data.eval_path``, or
``data.eval_fraction`` of the training rows picked by a seeded hash),
materialised once in the object store and read whole by every rank.

On the workers, :class:`SftBatches` turns a shard's rows into the trainer's
micro-batches (targets shifted within each document) and resumes like
:class:`~ray_fsdp_backend.trainer.data.RayDataBatches`; :func:`eval_batches`
gives each dp rank its share of the held-out rows, padded so that every rank
runs the same number of forwards (FSDP's all-gathers are collective).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from ray_fsdp_backend.context_parallel.sequence import IGNORE_INDEX, shift_labels
from ray_fsdp_backend.trainer.data import RayDataBatches

EVAL_DATASET = "eval"
"""The held-out dataset's name among the trainer's datasets (not split by rank)."""


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
    from ray_fsdp_backend.hf.models import load_tokenizer
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


def build_sft_datasets(spec) -> dict[str, Any]:
    """``{"train": rows, "eval": held-out rows}`` (``eval`` only with an eval
    set): ``rfb.sft_dataset`` over ``data.path`` with the checkpoint's
    tokenizer, the training rows shuffled with ``train.seed``."""
    import ray_fsdp_backend as rfb
    from ray_fsdp_backend.hf.models import load_tokenizer

    data, seed = spec.data, spec.train.seed
    tokenizer = load_tokenizer(spec.model.pretrained)
    options = sft_options(data, spec.model.seq_len)
    train = rfb.sft_dataset(data.path, tokenizer, **options)
    held_out = None
    if data.eval_path is not None:
        held_out = rfb.sft_dataset(data.eval_path, tokenizer, **options)
    elif data.eval_fraction is not None:
        pick = HeldOut(data.eval_fraction, seed)
        held_out = train.filter(pick)
        train = train.filter(pick.complement)
    datasets = {"train": train.random_shuffle(seed=seed)}
    if held_out is not None:
        datasets[EVAL_DATASET] = held_out.materialize()
    return datasets


class HeldOut:
    """PURE: whether a packed row is held out, from a seeded hash of its
    tokens (the same rows on every run with the same seed, whatever the
    block layout)."""

    def __init__(self, fraction: float, seed: int) -> None:
        self.threshold = int(fraction * 2**32)
        self.salt = seed.to_bytes(8, "little", signed=True)

    def __call__(self, row: dict[str, Any]) -> bool:
        tokens = np.asarray(row["input_ids"], dtype=np.int64).tobytes()
        return zlib.crc32(self.salt + tokens) < self.threshold

    def complement(self, row: dict[str, Any]) -> bool:
        return not self(row)


def to_micro_batch(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``rfb.sft_dataset`` rows as the trainer's micro-batch: ``targets`` are
    the labels shifted within each document (a document's last token
    predicts nothing), as :class:`~ray_fsdp_backend.trainer.data.PackedBatches` gives them."""
    positions = rows["position_ids"].long()
    return {
        "input_ids": rows["input_ids"].long(),
        "targets": shift_labels(rows["labels"].long(), positions),
        "position_ids": positions,
    }


class SftBatches(RayDataBatches):
    """One rank's micro-batches of ``rfb.sft_dataset`` rows (its
    ``MeshDataConfig`` shard), epoch after epoch; the data position (rows the
    job read in this epoch) resumes as :class:`RayDataBatches`'s does."""

    def to_batch(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return to_micro_batch(rows)


def eval_batches(
    global_batches: Iterable[dict[str, torch.Tensor]],
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
) -> Iterator[dict[str, torch.Tensor]]:
    """This dp rank's micro-batches of the whole held-out set, from its rows
    in batches of ``micro_batch_size * dp_size`` (``iter_torch_batches``):
    of each, the ``dp_rank``-th block; a short block is filled with rows that
    carry no loss, so every rank runs as many forwards."""
    first = dp_rank * micro_batch_size
    for rows in global_batches:
        batch = to_micro_batch(rows)
        mine = {k: v[first : first + micro_batch_size] for k, v in batch.items()}
        yield pad_rows(mine, micro_batch_size)


def pad_rows(batch: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """``batch`` with rows appended up to ``rows``: token 0, no target,
    positions ``0 .. seq-1``."""
    missing = rows - len(batch["input_ids"])
    if missing <= 0:
        return batch
    seq = batch["input_ids"].shape[1]
    fill = {
        "input_ids": torch.zeros(missing, seq, dtype=torch.long),
        "targets": torch.full((missing, seq), IGNORE_INDEX, dtype=torch.long),
        "position_ids": torch.arange(seq).expand(missing, seq),
    }
    return {k: torch.cat([batch[k], fill[k]]) for k in batch}
