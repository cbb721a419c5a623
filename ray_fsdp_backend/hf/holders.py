"""Which ranks hold which tensors of an export, for models whose ranks hold
different parts (pipeline stages: each rank only its stage's layers, under
their original names).

Every rank sends the names, shapes and dtypes of its state (one
``all_gather_object``); ranks with the same key set form a group (a
pipeline stage and its data-parallel ranks; without pipeline parallelism
one group of every rank). The export plan is cut per group
(:func:`plan_group_files`): each file holds one group's tensors and is
written by one of its ranks, so a tensor is gathered only over the ranks
that hold it. The other groups' tensors appear on a rank as meta tensors
(shape and dtype, no data): enough for the headers, the index and the
size checks every rank computes.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from ray_fsdp_backend.hf.writer import FilePlan, plan_export

Groups = list[tuple[tuple[int, ...], list[str]]]
"""``(ranks, keys)`` of each group, in rank order."""


def gather_holders(
    state: dict[str, torch.Tensor], group: dist.ProcessGroup | None = None
) -> tuple[dict[str, torch.Tensor], Groups]:
    """Collective over ``group`` (None: every rank): ``state`` completed with
    meta tensors for the keys its other ranks hold (the first holder's
    order: stage 0's keys first), and the groups of ranks (ranks in
    ``group``) holding the same keys."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    mine = [(k, tuple(v.shape), v.dtype) for k, v in state.items()]
    if world == 1:
        return state, [((0,), list(state))]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    by_keys: dict[tuple[str, ...], list[int]] = {}
    full: dict[str, torch.Tensor] = {}
    for rank, entries in enumerate(everyone):
        by_keys.setdefault(tuple(k for k, _, _ in entries), []).append(rank)
        for key, shape, dtype in entries:
            if key not in full:
                full[key] = state.get(key, torch.empty(shape, dtype=dtype, device="meta"))
    return full, [(tuple(ranks), list(keys)) for keys, ranks in by_keys.items()]


def plan_group_files(sizes: dict[str, int], groups: Groups, max_bytes: int) -> list[FilePlan]:
    """:func:`~ray_fsdp_backend.hf.writer.plan_export` per group (its keys
    over its ranks; a key held by several groups goes to the first), the
    files numbered over all groups. One group: ``plan_export`` itself."""
    if len(groups) == 1:
        ranks, _ = groups[0]
        return [replace(f, owner=ranks[f.owner]) for f in plan_export(sizes, max_bytes, len(ranks))]
    parts, taken = [], set()
    for ranks, keys in groups:
        own = {k: sizes[k] for k in keys if k not in taken}
        taken |= own.keys()
        if own:
            parts += [(f.keys, ranks[f.owner]) for f in plan_export(own, max_bytes, len(ranks))]
    count = len(parts)
    return [
        FilePlan(f"model-{i + 1:05d}-of-{count:05d}.safetensors", keys, owner)
        for i, (keys, owner) in enumerate(parts)
    ]
