"""What the workers make of ``rfb.sft_dataset`` rows (``data.format``
``chat`` / ``sharegpt`` / ``alpaca`` / ``prompt_completion``; the driver
side is :mod:`.sft`).

:class:`SftBatches` turns a shard's rows into the trainer's micro-batches
(targets shifted within each document), reshuffles each epoch (seeded by
``train.seed`` and the epoch) and resumes like
:class:`~ray_fsdp_backend.trainer.data.corpus.RayDataBatches`; :func:`eval_batches`
gives each dp rank its share of the held-out rows, padded so that every rank
runs the same number of forwards (FSDP's all-gathers are collective).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ray_fsdp_backend.context_parallel.sequence import IGNORE_INDEX, shift_labels
from ray_fsdp_backend.trainer.data.corpus import RayDataBatches
from ray_fsdp_backend.trainer.data.sft import EVAL_DATASET

__all__ = ["EVAL_DATASET", "SftBatches", "eval_batches", "pad_rows", "to_micro_batch"]


def to_micro_batch(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``rfb.sft_dataset`` rows as the trainer's micro-batch: ``targets`` are
    the labels shifted within each document (a document's last token
    predicts nothing), as :class:`~ray_fsdp_backend.trainer.data.corpus.PackedBatches`
    gives them."""
    positions = rows["position_ids"].long()
    batch = {
        "input_ids": rows["input_ids"].long(),
        "targets": shift_labels(rows["labels"].long(), positions),
        "position_ids": positions,
    }
    # Preference rows (rfb.preference_dataset): each token's pair, unshifted.
    batch |= {key: rows[key].long() for key in PAIR_COLUMNS if key in rows}
    return batch


PAIR_COLUMNS = ("sequence_ids", "pair_index")
"""The columns preference rows add (-1 on padding); passed through as they are."""


SHUFFLE_BUFFER_TOKENS = 2**22
"""Tokens of rows an epoch's shuffle holds (about 100 MB of int64 rows); a
shard of no more rows is reshuffled whole each epoch."""


class SftBatches(RayDataBatches):
    """One rank's micro-batches of ``rfb.sft_dataset`` rows (its
    ``MeshDataConfig`` shard), epoch after epoch, each epoch in its own order:
    the shard's rows pass a shuffle buffer of :data:`SHUFFLE_BUFFER_TOKENS`
    seeded by ``seed`` and the epoch, so two epochs differ and a resume in an
    epoch reads that epoch's order (given the shard's rows in the same order).
    The data position (rows the job read in this epoch) resumes as
    :class:`RayDataBatches`'s does."""

    def __init__(
        self, shard, micro_batch_size: int, dp_size: int = 1, *, seq_len: int, seed: int = 0
    ) -> None:
        super().__init__(shard, micro_batch_size, dp_size)
        self.seed = seed
        self.buffer_rows = max(micro_batch_size, SHUFFLE_BUFFER_TOKENS // seq_len)

    def to_batch(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return to_micro_batch(rows)

    def epoch_batches(self) -> Iterator:
        """This epoch's micro-batches of the shard, shuffled by (seed, epoch)."""
        return iter(
            self.shard.iter_torch_batches(
                batch_size=self.micro_batch_size,
                drop_last=True,
                local_shuffle_buffer_size=self.buffer_rows,
                local_shuffle_seed=epoch_seed(self.seed, self.epoch),
            )
        )


def epoch_seed(seed: int, epoch: int) -> int:
    """PURE: the shuffle seed of ``epoch`` in a run seeded ``seed``."""
    return (seed * 1_000_003 + epoch) % 2**32


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
    seq, device = batch["input_ids"].shape[1], batch["input_ids"].device
    fill = {
        "input_ids": torch.zeros(missing, seq, dtype=torch.long, device=device),
        "targets": torch.full((missing, seq), IGNORE_INDEX, dtype=torch.long, device=device),
        "position_ids": torch.arange(seq, device=device).expand(missing, seq),
        **{
            key: torch.full((missing, seq), -1, dtype=torch.long, device=device)
            for key in PAIR_COLUMNS
        },
    }
    return {k: torch.cat([batch[k], fill[k]]) for k in batch}
