"""Supervised fine-tuning data: chat, prompt/completion and text records to
packed token rows on Ray Data (docs/sft.md).

- :mod:`.options`: the format and options, checked;
- :mod:`.records`: where records come from, each record's place and text;
- :mod:`.conversation`: what a record must hold, as messages;
- :mod:`.render`: a record to token documents and loss labels, through the chat template;
- :mod:`.templates`: ``chat_template`` read, the families' training patches;
- :mod:`.packing`: PURE, token documents to fixed-length rows;
- :mod:`.check`, :mod:`.check_cache`: every record checked on the driver, cached;
- :mod:`.dataset`: the Ray Data pipeline.

Nothing here imports ``transformers``: the caller hands a tokenizer in.
"""

from ray_fsdp_backend.sft.check import RecordCheck
from ray_fsdp_backend.sft.dataset import (
    check_sft_source,
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
    "RecordCheck",
    "sft_dataset",
    "sft_stats",
]
