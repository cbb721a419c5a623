"""Per-rank buffers in a checkpoint.

DCP treats a plain (non-DTensor) tensor as replicated and stores one copy, so
buffers that differ between ranks (running statistics under DDP with
``broadcast_buffers: false``, or under FSDP, which never syncs buffers) would
all come back as one rank's values. Each rank therefore also keeps its own
persistent plain buffers in its extra-state file. On restore every rank
that saved such a file gets its own buffers back (all ranks at the same
world size; after a reshard, the ranks that existed before); a rank that
did not (a new rank after growing) keeps what DCP loaded.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def rank_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's persistent plain buffers, copied to the host, by name."""
    persistent = set(model.state_dict(keep_vars=True))
    return {
        name: buf.detach().to("cpu", copy=True)
        for name, buf in model.named_buffers()
        if name in persistent and not isinstance(buf, DTensor)
    }


@torch.no_grad()
def restore_rank_buffers(model: nn.Module, saved: Mapping[str, torch.Tensor]) -> None:
    """Copy the buffers ``rank_buffers`` saved back into ``model``."""
    buffers = dict(model.named_buffers())
    for name, value in saved.items():
        if name in buffers:
            buffers[name].copy_(value)
