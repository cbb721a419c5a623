"""Small collectives the checkpoint and Hugging Face layers share.

One helper today: read something once (on rank 0) and give every rank the
same answer, or the same error, so no rank waits on a collective that
another abandoned.
"""

from __future__ import annotations

import torch.distributed as dist


def broadcast_from_rank0(compute):
    """``compute()`` on rank 0, its result on every rank (collective when a
    process group of more than one rank is up; a plain call otherwise). An
    exception on rank 0 is raised on every rank, so none waits forever."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return compute()
    outcome = None
    if dist.get_rank() == 0:
        try:
            outcome = ("ok", compute())
        except Exception as exc:
            outcome = ("error", exc)
    box = [outcome]
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value
