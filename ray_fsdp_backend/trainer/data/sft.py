"""Chat and prompt/completion records for ``ray-fsdp train`` (``data.format``
``chat`` / ``prompt_completion``).

On the driver, before any worker starts,
:func:`~ray_fsdp_backend.trainer.schema.sft.sft_input_errors` reads the
records with the checkpoint's tokenizer (a missing field, no chat template,
an empty dataset, a file that is not JSON / parquet) and
:func:`build_sft_datasets` builds the datasets with exactly
``rfb.sft_dataset``: the training rows in a seeded order, split by
data-parallel group through ``rfb.MeshDataConfig`` like the text
``ray_data`` source, and the held-out rows (``data.eval_path``, or
``data.eval_fraction`` of the training rows picked by a seeded hash),
materialised once in the object store and read whole by every rank.

What the workers make of the rows is :mod:`.sft_batches`. Nothing here
imports torch or Ray at module level: ``plan`` and ``validate`` run
:func:`~ray_fsdp_backend.trainer.schema.sft.sft_input_errors` (docs/parallelism.md, "Planning
a layout").
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from ray_fsdp_backend.trainer.schema.sft import sft_options

EVAL_DATASET = "eval"
"""The held-out dataset's name among the trainer's datasets (not split by rank)."""


def build_sft_datasets(spec) -> dict[str, Any]:
    """``{"train": rows, "eval": held-out rows}`` (``eval`` only with an eval
    set): ``rfb.sft_dataset`` over ``data.path`` with the checkpoint's
    tokenizer, the training rows shuffled with ``train.seed``."""
    import ray_fsdp_backend as rfb
    from ray_fsdp_backend.hf.metadata import load_tokenizer

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
