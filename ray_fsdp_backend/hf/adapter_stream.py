"""A LoRA model's adapters alone, in buckets: an adapter-only weight sync to rollout engines.

A LoRA run's rollout engine can keep the checkpoint's base and take only
the adapters after each update (``rollout.sync: adapters``, docs/rl.md):
a few per cent of the merged model's bytes. :func:`stream_adapters` yields
the tensors a PEFT adapter export writes to ``adapter_model.safetensors``
(:func:`~ray_fsdp_backend.hf.peft_export.export_peft`: PEFT's names, no
adapter name, each gathered whole from its shards one at a time), so an
engine applies them as it would load that file: transformers' ``peft``
model, vLLM's ``LoRARequest``. Every rank calls it and iterates it to the
end; every rank receives every bucket.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ray_fsdp_backend.hf.peft_export import adapter_configs, gathered_adapters
from ray_fsdp_backend.hf.stream import buckets


def stream_adapters(
    model: nn.Module,
    *,
    bucket_bytes: int | str | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield the LoRA adapters of ``model`` as lists of ``(name, tensor)``
    of at most ``bucket_bytes`` each (None:
    :data:`~ray_fsdp_backend.hf.stream.DEFAULT_BUCKET_BYTES`; a tensor
    larger than that alone), each tensor whole, contiguous, on the host and
    in ``dtype`` (default: the adapters' own), named as in PEFT's
    ``adapter_model.safetensors``. Collective: every rank iterates to the end.

    Raises:
        ValueError: ``model`` has no PEFT adapters, or more than one (an
            engine applies one), or is a pipeline stage (its ranks hold only
            their stage's adapters), or a bad ``bucket_bytes``.
    """
    configs = adapter_configs(model, "stream_weights(adapters=True)")
    if len(configs) > 1:
        raise ValueError(
            f"stream_weights(adapters=True): the model has adapters {sorted(configs)}; "
            "a rollout engine applies one"
        )
    if getattr(model, "pipeline_plan", None) is not None:
        raise ValueError(
            "stream_weights(adapters=True): a pipeline stage holds only its own layers' "
            "adapters under pipeline_parallel_size > 1; use export_model format='peft'"
        )
    adapters = gathered_adapters(model, "streaming the adapters", dtype)
    entries = ((name, full.nbytes, full.contiguous) for _, name, full in adapters)
    yield from buckets(entries, bucket_bytes)
