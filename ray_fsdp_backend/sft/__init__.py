"""Supervised fine-tuning data: chat, prompt/completion and text records to
packed token rows on Ray Data (docs/sft.md).

- :mod:`.records`: where records come from, what a record must hold;
- :mod:`.render`: a record to tokens and loss labels, through the chat template;
- :mod:`.packing`: PURE, token documents to fixed-length rows;
- :mod:`.dataset`: the Ray Data pipeline and the driver-side check.

Nothing here imports ``transformers``: the caller hands a tokenizer in.
"""

from ray_fsdp_backend.sft.dataset import (
    check_sft_source,
    rows_from_records,
    sft_dataset,
    sft_stats,
)
from ray_fsdp_backend.sft.packing import PackCounts, pack_documents
from ray_fsdp_backend.sft.records import Format, SFTDataError, SFTOptions

__all__ = [
    "Format",
    "PackCounts",
    "SFTDataError",
    "SFTOptions",
    "check_sft_source",
    "pack_documents",
    "rows_from_records",
    "sft_dataset",
    "sft_stats",
]
