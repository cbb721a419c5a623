"""A sharded model's full weights under HF names, in buckets: what a rollout engine reloads.

An online-RL loop sends the policy's new weights to its rollout engines
after each update (vLLM's ``reload_weights``, SGLang's
``update_weights_from_tensor``): full tensors under the checkpoint's names,
in buckets of a few hundred MB (one tensor at a time was 12x slower for a
16B MoE in SGLang users' reports; the whole model at once does not fit on a
rank). :func:`stream_weights` yields them from the state the export writes
(:func:`~ray_fsdp_backend.hf.export.export_model`'s names: transformers'
``save_pretrained`` keys, experts split per expert, a PEFT model's adapters
merged into its base), gathering one tensor at a time, so a rank holds at
most one bucket plus the tensor being added: the bytes streamed equal the
export's tensors bit for bit. Every rank calls it and iterates it to the
end (each gather is a collective); every rank receives every bucket, and
the caller picks the rank that sends them on.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ray_fsdp_backend.compat.peft import unwrap
from ray_fsdp_backend.distributed.collectives import full_tensor
from ray_fsdp_backend.hf.export import default_export_dtype, export_state
from ray_fsdp_backend.hf.writer import export_dtype
from ray_fsdp_backend.settings.checks import parse_size

DEFAULT_BUCKET_BYTES = 512 * 2**20


def stream_weights(
    model: nn.Module,
    *,
    bucket_bytes: int | str | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield ``model``'s full weights as lists of ``(hf_name, tensor)`` of
    at most ``bucket_bytes`` each (None: :data:`DEFAULT_BUCKET_BYTES`; a
    tensor larger than that alone), in the
    export's key order, each tensor whole, contiguous, on this rank's device
    and in ``dtype`` (default: the export's, that of the weights
    ``load_pretrained`` read). Collective: every rank iterates to the end.

    Raises:
        ValueError: ``model`` is a pipeline stage (its ranks hold only their
            stage's layers: stream from each stage's ranks, or export), or a
            bad ``bucket_bytes``.
    """
    if getattr(model, "pipeline_plan", None) is not None:
        raise ValueError(
            "stream_weights: a pipeline stage holds only its own layers under "
            "pipeline_parallel_size > 1; use export_model (each stage writes its files)"
        )
    limit = parse_size(DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes)
    dtype = default_export_dtype(model, "hf", dtype)
    state = export_state(model, unwrap(model))
    bucket, size = [], 0
    for name in list(state):
        tensor = state.pop(name)  # the merged copy of a PEFT layer is dropped once sent
        full = full_tensor(tensor.detach())
        full = full.to(export_dtype(full, dtype)).contiguous()
        if bucket and size + full.nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, full))
        size += full.nbytes
    if bucket:
        yield bucket
