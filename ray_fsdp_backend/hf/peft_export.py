"""Export a PEFT model: its adapters as PEFT writes them, or merged into the base.

- :func:`export_peft` (``export_model(..., format="peft")``):
  ``adapter_model.safetensors`` (PEFT's key names, no adapter name) and
  ``adapter_config.json``, which ``PeftModel.from_pretrained(base, path)``
  reads. Adapters are a few per cent of the model: each is gathered one
  tensor at a time and rank 0 writes the file (other adapters than
  ``default`` go to a subdirectory of their name, as PEFT does).
- :func:`gathered_adapters`: the tensors of that file, one at a time, also
  what :func:`~ray_fsdp_backend.hf.adapter_stream.stream_adapters` sends
  to a rollout engine.
- :func:`merge_adapters` (``format="hf"`` on a PEFT model): ``W + scale B A``
  of every adapted layer, under the base model's names, on the sharded
  weights: ``B`` keeps ``W``'s row sharding, only the small ``A`` is
  gathered (DTensor's matmul does that), so the merged model is never whole
  on one rank. The Hugging Face writer then writes it like any model.

The layer's own ``get_delta_weight`` computes ``scale B A`` (fan-in/fan-out
layouts and rsLoRA scaling included), so this module does not redo PEFT's
arithmetic.
"""

from __future__ import annotations

import copy
import os
import posixpath
import tempfile
from collections.abc import Iterator

import pyarrow.fs as pafs
import torch
import torch.distributed as dist
from safetensors.torch import save
from torch import nn
from torch.distributed.tensor import DTensor

from ray_fsdp_backend.compat.peft import peft_configs, tuner_layers, unwrap
from ray_fsdp_backend.distributed.collectives import agreed, full_tensor
from ray_fsdp_backend.hf.peft import ADAPTER_WEIGHTS, peft_names
from ray_fsdp_backend.hf.writer import write_bytes


def export_peft(
    model: nn.Module,
    fs: pafs.FileSystem,
    root: str,
    *,
    max_shard_size=None,
    dtype: torch.dtype | None = None,
    uri: str | None = None,
) -> None:
    """Write the adapters of ``model`` to directory ``root`` of ``fs`` in
    PEFT's format (see the module docstring; ``max_shard_size`` unused: one
    file per adapter; ``uri`` names the target in messages; rank 0 writes
    every file). Collective: every rank calls it, and every rank returns
    only once rank 0 has written every file; a failure on any rank (a
    gather, rank 0's write) raises on every rank at once
    (:func:`~ray_fsdp_backend.distributed.collectives.agreed`).

    Raises:
        ValueError: ``model`` has no PEFT adapters.
        RankFailedError: a gather or a write failed on some rank (named,
            with its error).
    """
    configs = adapter_configs(model, "export_model format='peft'")
    per_adapter: dict[str, dict[str, torch.Tensor]] = {a: {} for a in configs}
    doing = f"exporting the adapters to {uri or root!r}"
    for adapter, saved, full in gathered_adapters(model, doing, dtype):
        per_adapter.setdefault(adapter, {})[saved] = full
    with agreed(doing):  # every rank, rank 0's outcome
        if not dist.is_initialized() or dist.get_rank() == 0:
            for adapter, tensors in per_adapter.items():
                where = root if adapter == "default" else posixpath.join(root, adapter)
                _write_adapter(fs, where, tensors, configs[adapter])


def _write_adapter(fs: pafs.FileSystem, where: str, tensors: dict, config) -> None:
    """``adapter_model.safetensors``, then ``adapter_config.json``, each whole."""
    fs.create_dir(where, recursive=True)
    data = save(tensors, metadata={"format": "pt"})
    write_bytes(fs, posixpath.join(where, ADAPTER_WEIGHTS), data)
    config = copy.deepcopy(config)
    config.inference_mode = True
    with tempfile.TemporaryDirectory(prefix="rfb-export-") as local:
        config.save_pretrained(local)
        for name in sorted(os.listdir(local)):
            with open(os.path.join(local, name), "rb") as f:
                write_bytes(fs, posixpath.join(where, name), f.read())


def adapter_configs(model: nn.Module, what: str) -> dict:
    """Adapter name -> PEFT config of ``model``; raises ValueError naming
    ``what`` when it has none."""
    configs = peft_configs(unwrap(model))
    if not configs:
        raise ValueError(f"{what}: {type(unwrap(model)).__name__} has no PEFT adapters")
    return configs


def gathered_adapters(
    model: nn.Module, doing: str, dtype: torch.dtype | None
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(adapter, name in PEFT's file, full host tensor)`` of each adapter
    parameter of ``model``, gathered one at a time (collective: every rank
    iterates to the end; a failed gather raises on every rank, naming
    ``doing`` and the parameter)."""
    inner = unwrap(model)
    params = dict(inner.named_parameters())
    for key, (adapter, saved) in peft_names(inner, list(params)).adapters.items():
        with agreed(f"{doing} (gathering {key!r})"):
            full = full_tensor(params[key].detach()).cpu()  # collective: every rank, same order
            full = full.to(dtype) if dtype else full
        yield adapter, saved, full


def merge_adapters(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the PEFT model's state dict, maybe sharded) as the base
    model's state dict with every active adapter merged into its layer's
    weight. Adapter tensors are dropped."""
    inner = unwrap(model)
    names = peft_names(inner, list(state))
    merged = {key: state[key] for key in names.base}
    with torch.no_grad():
        for name, layer in tuner_layers(inner):
            key = f"{name}.base_layer.weight"
            if key not in merged or layer.merged:
                continue
            with agreed(f"merging the adapters of {name}"):  # DTensor ops: collectives
                weight = merged[key]
                for adapter in layer.active_adapters:
                    if adapter in getattr(layer, "lora_A", {}):
                        weight = _plus(weight, layer.get_delta_weight(adapter))
                merged[key] = weight
    return {names.base[k]: v for k, v in merged.items()}


def _plus(weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``weight + delta`` in the wider dtype, laid out as ``weight`` is."""
    total = weight.to(torch.promote_types(weight.dtype, delta.dtype)) + delta
    if isinstance(weight, DTensor):
        total = total.redistribute(weight.device_mesh, weight.placements)
    return total
