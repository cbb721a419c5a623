"""Every preference record checked on the driver before any worker starts:
:func:`check_pairs`, the preference twin of :mod:`ray_fsdp_backend.sft.check`
(the same streamed pass without Ray, the same ``FILE:LINE`` / ``FILE#ROW``
problems, the same cache).

A problem is a record that cannot be trained as written: not JSON, a missing
``chosen`` / ``rejected``, identical responses, a conversational pair whose
prompts differ, a message SFT would refuse, a template that refuses the
conversation, a response with no trainable token, a pair that cannot fit
``seq_len`` even with its responses cut (its two prompts leave no room for a
response token each: the workers would drop it, as TRL drops it, without a
word). Each record's global index (``pair_index``) is its
place among all records of the source, both splits, counted from 0: files in
sorted order, records in file order; the check counts each file's records so
the workers can number theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_fsdp_backend.preference.packing import PairCounts, fit_pair, pack_pairs, prompt_length
from ray_fsdp_backend.preference.pairs import PreferenceOptions, read_pair
from ray_fsdp_backend.preference.render import pair_documents
from ray_fsdp_backend.sft.check import RECORDS_PER_BATCH, SPLITS, RecordCheck, pad_token_id
from ray_fsdp_backend.sft.packing import IGNORE_INDEX
from ray_fsdp_backend.sft.records import (
    SFTDataError,
    Source,
    is_held_out,
    open_records,
    parse_record,
)


@dataclass
class PairCheck(RecordCheck):
    """:class:`~ray_fsdp_backend.sft.check.RecordCheck` of pairs: per split the
    :class:`~ray_fsdp_backend.preference.packing.PairCounts`, the records
    of each file (for ``pair_index``)."""

    file_records: list[int] = field(default_factory=list)

    def cached(self) -> dict:
        return {**super().cached(), "file_records": self.file_records}

    def offsets(self) -> dict[str, int]:
        """Each file's first ``pair_index`` (needs ``source``)."""
        starts, at = {}, 0
        for file, n in zip(self.source.files, self.file_records, strict=True):
            starts[file] = at
            at += n
        return starts

    def summary(self) -> str:
        lines = [f"{self.read} pairs read, {self.problem_count} refused"]
        for split, c in self.counts.items():
            if c["records"] or split == "train":
                lines.append(
                    f"{split}: {c['records']} pairs rendered, {c['truncated']} with responses "
                    f"truncated to seq_len, {c['pairs']} packed into {c['rows']} rows, "
                    f"{c['padding']} padding tokens"
                )
        return "; ".join(lines)


def check_pairs(
    source: Source,
    tokenizer,
    options: PreferenceOptions,
    eval_fraction: float | None,
    seed: int,
) -> PairCheck:
    """Every record of ``source`` read, split, rendered and packed as the
    workers will; nothing raised for a record (module docstring)."""
    result = PairCheck()
    totals = {split: PairCounts() for split in SPLITS}
    pending = {split: _Batch() for split in SPLITS}
    index = 0
    for file in source.files:
        before = result.read
        for raw in open_records(source, file):
            result.read += 1
            split = "eval" if is_held_out(raw, eval_fraction, seed) else "train"
            documents = render_pair(raw, tokenizer, options, result)
            if documents is not None:
                pending[split].add(documents, index)
                if len(pending[split].pairs) == RECORDS_PER_BATCH:
                    pending[split].pack(options, tokenizer, totals[split])
            index += 1
        result.file_records.append(result.read - before)
    for split in SPLITS:
        pending[split].pack(options, tokenizer, totals[split])
        result.counts[split] = totals[split].as_dict()
    return result


def render_pair(raw, tokenizer, options: PreferenceOptions, result: RecordCheck):
    """The record's ``(chosen, rejected)`` documents, or None with its problem noted."""
    try:
        pair = read_pair(parse_record(raw), options, raw.where)
        documents = pair_documents(pair, tokenizer, options, raw.where)
    except SFTDataError as exc:
        result.add_problem(str(exc))
        return None
    for name, (_, labels) in zip(
        (options.chosen_field, options.rejected_field), documents, strict=True
    ):
        if not (labels[1:] != IGNORE_INDEX).any():
            result.add_problem(
                f"{raw.where}: the {name!r} response has no trainable token (no assistant "
                "turn of weight 1 after the prompt); such a pair teaches nothing"
            )
            return None
    if fit_pair(documents, options.seq_len)[0] is None:
        prompts = sum(prompt_length(labels) for _, labels in documents)
        result.add_problem(
            f"{raw.where}: the pair cannot fit seq_len={options.seq_len} even with its responses "
            f"cut: its two documents share one row and their prompts take {prompts} tokens; "
            f"raise seq_len to at least {prompts + 2} or shorten the prompt"
        )
        return None
    return documents


def pack_pair_rows(pairs, indices, options: PreferenceOptions, tokenizer, counts=None):
    """``pairs`` packed (or one a row) as ``options`` ask; ``counts`` updated."""
    return pack_pairs(
        pairs,
        indices,
        options.seq_len,
        pad_token_id(tokenizer),
        packing=options.packing,
        counts=counts,
    )


@dataclass
class _Batch:
    """The pairs pending for one split's next pack, with their indices."""

    pairs: list = field(default_factory=list)
    indices: list = field(default_factory=list)

    def add(self, documents, index: int) -> None:
        self.pairs.append(documents)
        self.indices.append(index)

    def pack(self, options: PreferenceOptions, tokenizer, counts: PairCounts) -> None:
        if self.pairs:
            pack_pair_rows(self.pairs, self.indices, options, tokenizer, counts)
        self.pairs, self.indices = [], []
