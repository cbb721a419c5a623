"""Export a model's full weights: Hugging Face layout (:mod:`.writer`) or
one safetensors file."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def export_model(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    format: str = "hf",
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
) -> str:
    """Write the full weights of ``model`` (FSDP2, HSDP, DDP or plain) to ``path``.

    ``format="hf"``: directory ``path`` in Hugging Face layout, sharded
    safetensors of at most ``max_shard_size``, their index and, for a
    ``transformers`` model, ``config.json`` and ``generation_config.json``:
    ``AutoModelForCausalLM.from_pretrained(path)`` loads it (a PEFT model's
    adapters merged into the base weights). Each rank writes
    what it owns; no rank gathers the model. ``dtype`` defaults to the dtype
    of the weights ``load_pretrained`` read, else the parameters' dtype.
    ``format="safetensors"`` (also chosen by a ``path`` ending in
    ``.safetensors``): one file, see :func:`export_single_file`. Collective:
    every rank calls it; returns ``path`` once complete. ``format="peft"``:
    a PEFT model's adapters as ``PeftModel.from_pretrained`` reads them
    (:mod:`.peft_export`).

    Raises:
        ValueError: an unknown ``format`` or a bad ``max_shard_size``.
    """
    path = os.fspath(path)
    if format not in ("hf", "safetensors", "peft"):
        raise ValueError(f"export_model format={format!r} is not one of hf, safetensors, peft")
    if format == "peft":
        from ray_fsdp_backend.hf.peft_export import export_peft

        return export_peft(model, path, dtype=dtype)
    if format == "hf" and not path.endswith(".safetensors"):
        from ray_fsdp_backend.hf.load import pretrained_dtype
        from ray_fsdp_backend.hf.writer import export_hf

        dtype = dtype or pretrained_dtype(model) or next(model.parameters()).dtype
        return export_hf(model, path, max_shard_size=max_shard_size, dtype=dtype)
    return export_single_file(model, path, dtype=dtype)


def export_single_file(
    model: nn.Module, path: str | os.PathLike, *, dtype: torch.dtype | None = None
) -> str:
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
    if dtype is not None:
        state = {k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
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
