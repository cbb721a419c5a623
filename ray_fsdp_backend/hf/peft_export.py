"""Export a PEFT model: its adapters as PEFT writes them, or merged into the base.

- :func:`export_peft` (``export_model(..., format="peft")``):
  ``adapter_model.safetensors`` (PEFT's key names, no adapter name) and
  ``adapter_config.json``, which ``PeftModel.from_pretrained(base, path)``
  reads. Adapters are a few per cent of the model: each is gathered one
  tensor at a time and rank 0 writes the file (other adapters than
  ``default`` go to a subdirectory of their name, as PEFT does).
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

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from ray_fsdp_backend.hf.peft import ADAPTER_WEIGHTS, peft_names
from ray_fsdp_backend.strategies.peft import peft_configs, tuner_layers, unwrap


def export_peft(model: nn.Module, path: str, *, dtype: torch.dtype | None = None) -> str:
    """Write the adapters of ``model`` to directory ``path`` in PEFT's format
    (see the module docstring). Collective: every rank calls it.

    Raises:
        ValueError: ``model`` has no PEFT adapters.
    """
    inner = unwrap(model)
    configs = peft_configs(inner)
    if not configs:
        raise ValueError(f"export_model format='peft': {type(inner).__name__} has no PEFT adapters")
    params = dict(inner.named_parameters())
    names = peft_names(inner, list(params))
    per_adapter: dict[str, dict[str, torch.Tensor]] = {a: {} for a in configs}
    for key, (adapter, saved) in names.adapters.items():
        full = _full_tensor(params[key])  # collective: every rank, same order
        per_adapter.setdefault(adapter, {})[saved] = full.to(dtype) if dtype else full
    if not dist.is_initialized() or dist.get_rank() == 0:
        for adapter, tensors in per_adapter.items():
            where = path if adapter == "default" else os.path.join(path, adapter)
            os.makedirs(where, exist_ok=True)
            save_file(tensors, os.path.join(where, ADAPTER_WEIGHTS), metadata={"format": "pt"})
            config = copy.deepcopy(configs[adapter])
            config.inference_mode = True
            config.save_pretrained(where)
    if dist.is_initialized():
        dist.barrier()
    return path


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).cpu()


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
