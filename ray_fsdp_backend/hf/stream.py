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

Memory: a rank holds one bucket, the tensor being gathered counted in it
(a bucket is sent before a tensor that would overflow it is gathered), plus
that one gather's buffers (gloo's all-gather fills a buffer of the output's
size, then copies it out). Measured (tests/dist/test_stream_memory.py, a
36 MiB model, largest tensor 2 MiB, FSDP2 and FSDP2 x tp 2 on 2 gloo ranks):
a 4 MiB bucket peaked at 5.0-6.3 MiB per rank, a 12 MiB one at 12.3-13.6 MiB.
That needs the caller to drop each bucket before asking for the next
(``del bucket`` at the end of the loop body): a ``for`` loop's variable
keeps the last bucket alive while the next one fills (two buckets: 25 MiB
at 12 MiB).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import NamedTuple

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
    dtype = default_export_dtype(model, "hf", dtype)
    state = export_state(model, unwrap(model))
    yield from buckets(_gathers(state, dtype, pipeline_group), bucket_bytes)


def buckets(
    entries: Iterable[tuple[str, int, Callable[[], torch.Tensor]]], bucket_bytes: int | str | None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``[(name, tensor), ...]`` lists of at most ``bucket_bytes`` (None:
    :data:`DEFAULT_BUCKET_BYTES`; a tensor larger than that alone) from
    ``(name, bytes, make)`` entries: a bucket is yielded before the entry
    that would overflow it is made (gathered), so a rank never holds more.

    Raises:
        ValueError: a bad ``bucket_bytes``."""
    limit = parse_size(DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes)
    bucket, size = [], 0
    for name, nbytes, make in entries:
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, make()))
        size += nbytes
    if bucket:
        yield bucket


class _Peers(NamedTuple):
    """The ranks a tensor is broadcast over, this rank's place among them,
    and the device a received tensor is allocated on."""

    group: dist.ProcessGroup | None
    rank: int
    device: torch.device


def _gathers(
    state: dict[str, torch.Tensor], dtype: torch.dtype, group: dist.ProcessGroup | None
) -> Iterator[tuple[str, int, Callable[[], torch.Tensor]]]:
    """``(name, bytes, gather)`` of every key the ranks of ``group`` hold,
    in the export's order: ``gather()`` (collective, called once, in order)
    returns the full tensor in the export's dtype; a key not every rank of
    ``group`` holds is broadcast from its first holder (the one the export
    writes). The bytes are known before the gather: the bucket is sent first."""
    device = next(t.device for t in state.values())
    state, groups = gather_holders(state, group)
    holders: dict[str, list[int]] = {}
    for ranks, keys in groups:
        for key in keys:
            holders.setdefault(key, []).extend(ranks)
    world = sum(len(ranks) for ranks, _ in groups)
    peers = _Peers(group, dist.get_rank(group) if world > 1 else 0, device)
    for name in list(state):
        tensor = state.pop(name)  # the merged copy of a PEFT layer is dropped once sent
        kind = export_dtype(tensor, dtype)
        source = holders[name][0] if len(holders[name]) < world else None
        yield name, tensor.numel() * kind.itemsize, partial(_gather, tensor, kind, source, peers)


def _gather(
    tensor: torch.Tensor, kind: torch.dtype, source: int | None, peers: _Peers
) -> torch.Tensor:
    """``tensor`` whole in ``kind``: gathered within its mesh where this
    rank holds it; with a ``source`` (a pipeline stage's tensor), broadcast
    from that rank of ``peers`` to the other stages."""
    full = None if tensor.is_meta else full_tensor(tensor.detach()).to(kind).contiguous()
    if source is not None:
        if peers.rank != source:
            full = None  # a holder's own copy, dropped before the receive
            full = torch.empty(tensor.shape, dtype=kind, device=peers.device)
        dist.broadcast(full, group_src=source, group=peers.group)
    return full
