"""A sharded model's full weights under HF names, in buckets: what a rollout engine reloads.

An online-RL loop sends the policy's new weights to its rollout engines
after each update (vLLM's ``reload_weights``, SGLang's
``update_weights_from_tensor``): full tensors under the checkpoint's names,
in buckets of a few hundred MB (one tensor at a time was 12x slower for a
16B MoE in SGLang users' reports; the whole model at once does not fit on a
rank). :func:`stream_weights` yields them from the state the export writes
(:func:`~ray_fsdp_backend.hf.export.export_model`'s names: transformers'
``save_pretrained`` keys, experts split per expert, a PEFT model's adapters
merged into its base), gathering one tensor at a time: the bytes streamed
equal the export's tensors bit for bit. Every rank calls it and iterates it
to the end (each gather is a collective); every rank receives every bucket,
and the caller picks the rank that sends them on.

Pipeline stages (each rank holds only its stage's layers): the stages'
``(name, shape, dtype)`` lists are exchanged once over the pipeline group
(one rank of each stage); then, key by key in the export's order (stage 0's
first), the stage holding a tensor gathers it within its own mesh, as
without pipelining, and broadcasts it over the pipeline group to the other
stages, which receive it into a tensor of the listed shape.

Memory: a rank holds the bucket being filled, the tensor being added and
what its gather needs for that one tensor (tests/dist/test_stream_memory.py
measures it; docs/rl.md gives the numbers).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ray_fsdp_backend.compat.peft import unwrap
from ray_fsdp_backend.distributed.collectives import full_tensor
from ray_fsdp_backend.hf.export import default_export_dtype, export_state
from ray_fsdp_backend.hf.holders import gather_holders
from ray_fsdp_backend.hf.writer import export_dtype
from ray_fsdp_backend.settings.checks import parse_size

DEFAULT_BUCKET_BYTES = 512 * 2**20


def stream_weights(
    model: nn.Module,
    *,
    bucket_bytes: int | str | None = None,
    dtype: torch.dtype | None = None,
    pipeline_group: dist.ProcessGroup | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield ``model``'s full weights as lists of ``(hf_name, tensor)`` of
    at most ``bucket_bytes`` each (None: :data:`DEFAULT_BUCKET_BYTES`; a
    tensor larger than that alone), in the export's key order, each tensor
    whole, contiguous, on this rank's device and in ``dtype`` (default: the
    export's, that of the weights ``load_pretrained`` read). A pipeline
    stage streams the whole model too: ``pipeline_group`` is this rank's
    pipeline peers (``mesh["pp"]``, one rank per stage; ``ctx.stream_weights``
    passes it), None: every rank (correct for any layout, more traffic
    under pipeline parallelism). Collective: every rank iterates to the end.

    Raises:
        ValueError: a bad ``bucket_bytes``.
    """
    limit = parse_size(DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes)
    dtype = default_export_dtype(model, "hf", dtype)
    bucket, size = [], 0
    for name, full in _full_tensors(export_state(model, unwrap(model)), dtype, pipeline_group):
        if bucket and size + full.nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, full))
        size += full.nbytes
    if bucket:
        yield bucket


def _full_tensors(
    state: dict[str, torch.Tensor], dtype: torch.dtype, group: dist.ProcessGroup | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor in the export's dtype)`` of every key the ranks
    of ``group`` hold, one at a time; a key not every rank of ``group``
    holds is broadcast from its first holder (the one the export writes)."""
    device = next(t.device for t in state.values())
    state, groups = gather_holders(state, group)
    holders: dict[str, list[int]] = {}
    for ranks, keys in groups:
        for key in keys:
            holders.setdefault(key, []).extend(ranks)
    world = sum(len(ranks) for ranks, _ in groups)
    me = dist.get_rank(group) if world > 1 else 0
    for name in list(state):
        tensor = state.pop(name)  # the merged copy of a PEFT layer is dropped once sent
        shape, kind = tensor.shape, export_dtype(tensor, dtype)
        if not tensor.is_meta:
            tensor = full_tensor(tensor.detach()).to(kind).contiguous()
        source = holders[name][0]  # the export writes its first holder's
        if len(holders[name]) < world:  # a pipeline stage's: theirs to the other stages
            if me != source:
                tensor = None  # a holder's own copy, dropped before the receive
                tensor = torch.empty(shape, dtype=kind, device=device)
            dist.broadcast(tensor, group_src=source, group=group)
        yield name, tensor
