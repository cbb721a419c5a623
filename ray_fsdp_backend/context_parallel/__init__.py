"""Context parallelism: one sequence split across the ranks of a cp group.

- :mod:`.sequence` (pure): which tokens a rank holds, shifted labels,
  document ids, packing;
- :mod:`.attention`: causal, per-document attention (the local kernel);
- :mod:`.ulysses`: the all-to-all exchange around that kernel (any device);
- :mod:`.ring`: torch's ring attention (CUDA);
- :mod:`.apply`: swap a model's attention for one of them.

See docs/long-context.md.
"""

from ray_fsdp_backend.context_parallel.apply import (
    ContextParallelBackend,
    apply_context_parallel,
    global_token_count,
)
from ray_fsdp_backend.context_parallel.attention import ContextParallelAttention, causal_attention
from ray_fsdp_backend.context_parallel.sequence import (
    IGNORE_INDEX,
    pack_documents,
    shard_sequence,
    shift_labels,
)

__all__ = [
    "IGNORE_INDEX",
    "ContextParallelAttention",
    "ContextParallelBackend",
    "apply_context_parallel",
    "causal_attention",
    "global_token_count",
    "pack_documents",
    "shard_sequence",
    "shift_labels",
]
