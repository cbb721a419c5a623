"""Byte-level text data, sharded across data-parallel ranks in a resumable order.

Tokens are the bytes of a UTF-8 text (vocabulary 256, nothing to download).
The corpus is cut into windows of ``seq_len + 1`` bytes; the *global* order in
which windows are read is fixed by the seed alone, epoch after epoch, and a
run remembers only one integer: ``position``, the number of windows the whole
job has consumed. Every micro-step the job reads ``micro_batch_size * dp_size``
windows and rank ``r`` takes the ``r``-th block of ``micro_batch_size`` of
them. Hence:

- ranks never read the same window within a global batch;
- resuming from a checkpoint (``position``) continues with exactly the
  batches the interrupted run would have read next;
- changing the number of workers while keeping the global batch size keeps
  the global order; only the per-rank slices change.

For datasets too large for one file, :func:`pack_text_rows` cuts a Ray Data
text dataset into the same fixed-length byte rows, which each worker reads
from ``ray.train.get_dataset_shard("train")`` (:class:`RayDataBatches`). A
Ray Data stream cannot seek, and ``streaming_split`` hands blocks to ranks as
they ask for them, so its position is a *count*: the rows the whole job has
read in the current epoch. On resume, at any worker count, each rank drops
its share of that count from the restarted stream, so the job reads as many
rows of the epoch as the interrupted run had left and the epoch ends where it
would have. Which rows are dropped follows Ray Data's block order on the new
attempt: with a deterministic dataset order (``DataContext.execution_options.
preserve_order = True``) and an unchanged worker count they are the rows
already read; otherwise some rows of that one epoch may be read again and as
many skipped. Later epochs are read whole.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from importlib import resources

import numpy as np
import torch

from ray_fsdp_backend.context_parallel.sequence import pack_documents, shift_labels

SHIPPED_CORPUS = "tiny_corpus.txt"
NEWLINE = 10
"""The byte that ends a document (a line) for ``data.packing``."""


def load_corpus(path: str | os.PathLike | None = None) -> torch.Tensor:
    """The bytes of a text file as int64 tokens; ``None`` is the shipped corpus."""
    if path is None:
        data = resources.files("ray_fsdp_backend.models").joinpath(SHIPPED_CORPUS).read_bytes()
    else:
        with open(path, "rb") as f:
            data = f.read()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def split_corpus(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``1 - val_fraction`` of the tokens for training, the rest for validation."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={val_fraction!r} must be in [0, 1)")
    cut = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:cut], tokens[cut:]


def encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)  # host: data


def decode(tokens: Iterable[int]) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


class WindowOrder:
    """PURE map from a global sample index to a window start offset.

    Epoch ``e`` visits every window once, in a permutation drawn from
    ``seed`` and ``e``, with all windows shifted by a per-epoch offset so
    successive epochs see different cut points.
    """

    def __init__(self, num_tokens: int, seq_len: int, seed: int) -> None:
        self.seq_len, self.seed = seq_len, seed
        # Keep room for the shift (< seq_len) and the extra target byte.
        self.num_windows = (num_tokens - 1 - seq_len) // seq_len
        if self.num_windows < 1:
            raise ValueError(
                f"corpus of {num_tokens} tokens is too short for seq_len={seq_len}: "
                f"need at least {2 * seq_len + 2}"
            )
        self._epoch, self._perm = -1, []

    def start(self, sample: int) -> int:
        epoch, index = divmod(sample, self.num_windows)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            # A list: reading a tensor element per row costs a scalar read each.
            perm = torch.randperm(self.num_windows, generator=gen).tolist()
            self._epoch, self._perm = epoch, perm
        shift = (epoch * 7919) % self.seq_len
        return self._perm[index] * self.seq_len + shift


def compute_rank_samples(position: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> range:
    """PURE: the global sample indices rank ``dp_rank`` reads at ``position``."""
    first = position + dp_rank * micro_batch_size
    return range(first, first + micro_batch_size)


class ShardedBatches:
    """One rank's stream of ``(inputs, targets)`` micro-batches, shape ``(B, seq_len)``.

    Args:
        tokens: the training tokens (every rank passes the same tensor).
        seq_len: tokens per row.
        micro_batch_size: rows per rank per micro-step.
        dp_rank, dp_size: this rank's data-parallel coordinates.
        seed: fixes the global order.
        position: global samples already consumed (from a checkpoint).
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int = 0,
        position: int = 0,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self.tokens, self.seq_len = tokens, seq_len
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.order = WindowOrder(len(tokens), seq_len, seed)
        self.position = position

    @property
    def global_batch_rows(self) -> int:
        return self.micro_batch_size * self.dp_size

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the next global micro-batch; advances ``position``."""
        samples = compute_rank_samples(
            self.position, self.micro_batch_size, self.dp_rank, self.dp_size
        )
        rows = [self._window(self.order.start(s)) for s in samples]
        self.position += self.global_batch_rows
        return split_rows(torch.stack(rows))

    def _window(self, start: int) -> torch.Tensor:
        return self.tokens[start : start + self.seq_len + 1]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def split_documents(tokens: torch.Tensor, separator: int = NEWLINE) -> list[torch.Tensor]:
    """The corpus cut after every ``separator`` token (a line of text per
    document, its newline included); empty pieces are dropped."""
    ends = (tokens == separator).nonzero().flatten() + 1
    bounds = [0, *ends.tolist(), len(tokens)]
    return [tokens[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


class PackedBatches(ShardedBatches):
    """``data.packing``: one rank's stream of packed micro-batches.

    The corpus's documents (lines) are concatenated into rows of ``seq_len``
    tokens once (:func:`~ray_fsdp_backend.context_parallel.pack_documents`);
    ``position_ids`` restart at every document, which the model turns into
    per-document attention, and a target that would cross into the next
    document is ignored (-100). Rows are read in the same resumable global
    order as :class:`ShardedBatches` (a permutation per epoch, sharded by
    ``dp_rank``), so ``position`` resumes exactly. ``next_batch`` returns a dict:
    ``input_ids``, ``targets`` (already shifted), ``position_ids``.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, *args, **kwargs) -> None:
        """``tokens`` and ``seq_len`` as packed rows; the rest as :class:`ShardedBatches`."""
        packed = pack_documents(split_documents(tokens), seq_len)
        self.rows = {
            "input_ids": packed["input_ids"],
            "targets": shift_labels(packed["labels"], packed["position_ids"]),
            "position_ids": packed["position_ids"],
        }
        # Each row is a "window" of one index: the same per-epoch permutation.
        rows = len(packed["input_ids"])
        super().__init__(torch.arange(rows + 2), 1, *args, **kwargs)

    def next_batch(self) -> dict[str, torch.Tensor]:
        samples = compute_rank_samples(
            self.position, self.micro_batch_size, self.dp_rank, self.dp_size
        )
        index = torch.tensor([self.order.start(s) for s in samples])  # host: data
        self.position += self.global_batch_rows
        return {key: rows[index] for key, rows in self.rows.items()}


class RayDataBatches:
    """Micro-batches from a Ray Data shard of fixed-length token rows
    (:func:`pack_text_rows`), epoch after epoch.

    Every rank's shard has the same number of rows (``streaming_split(equal=True)``),
    so all ranks start each epoch together. ``state_dict`` holds the rows the
    job read in this epoch; :meth:`load_state_dict` makes the next epoch
    iteration drop this rank's share of them (see the module docstring).
    """

    def __init__(self, shard, micro_batch_size: int, dp_size: int = 1) -> None:
        self.shard, self.micro_batch_size, self.dp_size = shard, micro_batch_size, dp_size
        self.epoch, self.epoch_rows, self._skip_batches = 0, 0, 0
        self._it: Iterator | None = None  # None: the epoch's stream is not open yet

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        for _ in range(2):
            for batch in self._it or ():
                self.epoch_rows += self.micro_batch_size * self.dp_size
                return self.to_batch(batch)
            if self._it is not None:  # the epoch's stream ran out
                self.epoch, self.epoch_rows = self.epoch + 1, 0
            self._it = self._new_epoch()
        raise RuntimeError("the Ray Data shard has fewer rows than one micro-batch")

    def to_batch(self, rows: dict[str, torch.Tensor]):
        """A micro-batch from the shard's rows: byte rows as ``(inputs, targets)``."""
        return split_rows(rows["tokens"])

    def epoch_batches(self) -> Iterator:
        """The shard's micro-batches of one epoch, in the shard's order."""
        return iter(self.shard.iter_torch_batches(batch_size=self.micro_batch_size, drop_last=True))

    def _new_epoch(self) -> Iterator:
        it = self.epoch_batches()
        for _ in range(self._skip_batches):
            next(it, None)
        self._skip_batches = 0
        return it

    @property
    def position(self) -> int:
        """Rows the job read in the current epoch (the ``data_position`` metric;
        a Ray Data input has no global order beyond its epoch)."""
        return self.epoch_rows

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "epoch_rows": self.epoch_rows}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.epoch_rows = int(state.get("epoch", 0)), int(state.get("epoch_rows", 0))
        self._skip_batches = skipped_batches(self.epoch_rows, self.micro_batch_size, self.dp_size)


def skipped_batches(epoch_rows: int, micro_batch_size: int, dp_size: int) -> int:
    """PURE: micro-batches each rank drops to resume after ``epoch_rows`` rows
    read by the whole job (rounded down: a partial global micro-batch is read again)."""
    return epoch_rows // (micro_batch_size * dp_size)


def pack_text_rows(batch: dict[str, np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
    """Ray Data ``map_batches`` function: text rows in, fixed-length byte rows out.

    The texts of one batch are joined with newlines and cut into rows of
    ``seq_len + 1`` tokens (inputs plus the shifted target); the partial tail
    is dropped. Fixed-length rows let ``streaming_split(equal=True)`` give every
    rank the same number of batches, so no rank waits in a collective for one
    that has run out of data.
    """
    data = "\n".join(str(t) for t in batch["text"]).encode("utf-8")
    row_len = seq_len + 1
    n = len(data) // row_len
    rows = np.frombuffer(data[: n * row_len], dtype=np.uint8).reshape(n, row_len)
    return {"tokens": rows.astype(np.int64)}


def split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, seq_len + 1)`` token rows to ``(inputs, targets)``."""
    return rows[:, :-1], rows[:, 1:]


def tokenize_corpus(cfg, path: str | None) -> torch.Tensor:
    """The corpus (``data.path``, or the shipped one) as the ids of the
    tokenizer saved beside ``cfg.pretrained``'s checkpoint (``cfg``: a
    ``PretrainedModelConfig``), one long int64 tensor."""
    from ray_fsdp_backend.hf.models import load_tokenizer

    text = load_corpus(path).to(torch.uint8).numpy().tobytes().decode("utf-8", errors="replace")
    tokenizer = load_tokenizer(cfg.pretrained)
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)  # host: data
