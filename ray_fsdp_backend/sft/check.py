"""Every record checked on the driver before any worker starts: :func:`check_records`.

One streamed pass over the files (:func:`~ray_fsdp_backend.sft.records.open_records`),
in this process, without Ray: ``validate`` and ``plan`` then answer with no
cluster, a problem names its record as ``FILE:LINE`` (``FILE#ROW``), and the
records are rendered with the very functions the Ray Data workers run, so a
record the check passes is one the workers take. The pass costs what
rendering costs (one core); it is cached (:mod:`.check_cache`) by the files'
content, the tokenizer and the options, so ``train`` after ``validate`` reads
the files once to hash them and renders nothing.

A problem is a record that cannot be trained as written: not JSON, a missing
field, content that is not text, a role no template knows, a template that
refuses the conversation, a record with no trainable token. The rows and
padding are counted by packing the documents in groups of
:data:`RECORDS_PER_BATCH` in file order, as the workers pack their batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_fsdp_backend.sft.packing import IGNORE_INDEX, PackCounts, pack_documents
from ray_fsdp_backend.sft.records import (
    Format,
    SFTDataError,
    SFTOptions,
    Source,
    is_held_out,
    open_records,
    parse_record,
)
from ray_fsdp_backend.sft.render import render_record

RECORDS_PER_BATCH = 1024
"""Records packed together: the more, the less padding (one partly filled
row at most per few rows of a batch); each batch is packed on its own."""

PROBLEMS_SHOWN = 20
"""Problems a refusal lists; the rest are counted."""

SPLITS = ("train", "eval")


@dataclass
class RecordCheck:
    """What the check found: per split (``train``, ``eval``) the
    :class:`~ray_fsdp_backend.sft.packing.PackCounts` of its rows, and the
    problems (the first :data:`PROBLEMS_SHOWN`, and how many in all)."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    problem_count: int = 0
    read: int = 0
    """Records read, the refused included."""
    source: Source | None = field(default=None, compare=False, repr=False)
    """The files checked (not cached: resolved again each time)."""

    def cached(self) -> dict:
        """What the cache keeps."""
        return {
            "counts": self.counts,
            "problems": self.problems,
            "problem_count": self.problem_count,
            "read": self.read,
        }

    def rows(self, split: str = "train") -> int:
        return self.counts[split]["rows"]

    def add_problem(self, message: str) -> None:
        self.problem_count += 1
        if len(self.problems) < PROBLEMS_SHOWN:
            self.problems.append(message)

    def summary(self, names: dict[str, str] | None = None) -> str:
        """The records read and refused, then the counts of each split that
        has records (``names``: a split's name shown, if not its own)."""
        lines = [f"{self.read} records read, {self.problem_count} refused"]
        for split, c in self.counts.items():
            if c["records"] or split == "train":
                name = (names or {}).get(split, split)
                lines.append(
                    f"{name}: {c['records']} records, {c['documents']} rendered, "
                    f"{c['truncated']} truncated to seq_len, {c['dropped']} dropped (no target "
                    f"left within seq_len), {c['rows']} rows, {c['padding']} padding tokens"
                )
        return "; ".join(lines)

    def error(self, path: str) -> SFTDataError:
        """The refusal: the problems shown, the count of the rest, the counts."""
        rest = self.problem_count - len(self.problems)
        more = [f"... and {rest} more problem record(s)"] if rest else []
        listed = "\n  ".join([*self.problems, *more])
        return SFTDataError(
            f"{self.problem_count} record(s) of {path} cannot be trained as written:\n  "
            f"{listed}\n  (counts: {self.summary()})"
        )


def check_records(
    source: Source, tokenizer, options: SFTOptions, eval_fraction: float | None, seed: int
) -> RecordCheck:
    """Every record of ``source`` read, split, rendered and packed as the
    workers will (see the module docstring); nothing raised for a record."""
    result = RecordCheck()
    totals = {split: PackCounts() for split in SPLITS}
    pending = {split: _Batch() for split in SPLITS}
    for file in source.files:
        for raw in open_records(source, file):
            result.read += 1
            split = "eval" if is_held_out(raw, eval_fraction, seed) else "train"
            documents = _documents(raw, tokenizer, options, result)
            if documents is None:
                continue
            pending[split].add(documents)
            if pending[split].records == RECORDS_PER_BATCH:
                pending[split].pack(options, tokenizer, totals[split])
    for split in SPLITS:
        pending[split].pack(options, tokenizer, totals[split])
        result.counts[split] = totals[split].as_dict()
    return result


def _documents(raw, tokenizer, options: SFTOptions, result: RecordCheck):
    """The record's ``(input_ids, labels)`` documents, or None with its problem noted."""
    try:
        documents = render_record(parse_record(raw), tokenizer, options, raw.where)
    except SFTDataError as exc:
        result.add_problem(str(exc))
        return None
    if not any((labels[1:] != IGNORE_INDEX).any() for _, labels in documents):
        result.add_problem(
            f"{raw.where}: no trainable token (no assistant turn of weight 1, or an empty "
            "completion); such a record teaches nothing"
        )
        return None
    return documents


def pad_token_id(tokenizer) -> int:
    """The id padding uses: the tokenizer's pad token, else EOS, else 0 (never a target)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return 0


def pack_rows(
    documents: list,
    options: SFTOptions,
    tokenizer,
    counts: PackCounts | None = None,
    records: int | None = None,
):
    """``documents`` (of ``records`` records; None: one each) packed (or
    padded) into rows as ``options`` ask; ``counts`` updated."""
    return pack_documents(
        documents,
        options.seq_len,
        pad_token_id(tokenizer),
        packing=options.packing,
        split=options.format is Format.TEXT,
        counts=counts,
        records=records,
    )


@dataclass
class _Batch:
    """The documents of the records pending for one split's next pack."""

    documents: list = field(default_factory=list)
    records: int = 0

    def add(self, documents: list) -> None:
        self.documents.extend(documents)
        self.records += 1

    def pack(self, options: SFTOptions, tokenizer, counts: PackCounts) -> None:
        """Pack and count the batch, then empty it."""
        if self.documents:
            pack_rows(self.documents, options, tokenizer, counts, self.records)
        self.documents, self.records = [], 0
