"""Export a model's full, unsharded weights as one safetensors file."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def export_model(model: nn.Module, path: str | os.PathLike) -> str:
    """Gather the full state dict of ``model`` (FSDP2, HSDP, DDP or plain) and
    write it once, from rank 0, as a safetensors file at ``path``.

    Keys are the plain model's (no ``module.`` prefix), so
    ``model.load_state_dict(safetensors.torch.load_file(path))`` works on an
    unwrapped model without this package and without unpickling. Tied weights
    are stored under each of their names. Collective: every rank calls it; it
    returns ``path`` after the file is complete.
    """
    path = os.fspath(path)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_safetensors(state, path)
    if dist.is_initialized():
        dist.barrier()
    return path


def write_safetensors(state: dict, path: str) -> None:
    """Write the tensors of ``state`` to ``path`` (a temporary file renamed
    into place, so a crash never leaves a truncated export)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        value = value.detach().cpu().contiguous()
        # safetensors refuses tensors sharing storage (tied weights): copy repeats.
        if value.data_ptr() in seen:
            value = value.clone()
        seen.add(value.data_ptr())
        tensors[key] = value
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)
