"""Free a wrapped model's and its optimizer's memory between phases, and get it back bit for bit.

A colocated RL loop runs the rollout engine and the trainer on the same
devices in turn: while the engine generates, the trainer's parameters,
gradients and optimizer state must not hold device memory (verl's
``engine.to("cpu")``, NeMo-RL's ``offload_before_refit``). :func:`offload`
copies the bytes of every such tensor's storage to host memory (pinned when
the storage is on a GPU, so the copies back are asynchronous) and resizes
the storage to zero; :func:`onload` resizes it back and copies the bytes
in. The tensors themselves — FSDP2's sharded parameters and their flat
padded storage, DTensor optimizer states, tied weights, views — stay the
same Python objects with the same strides and aliasing, so nothing that
refers to them (the optimizer's ``param_groups``, FSDP's
``FSDPParam``s, a tp plan's DTensors) notices, and the next step is
bit-identical to one without the round trip. (FSDP2 frees its unsharded
parameters the same way, by resizing their storage.)

Moving the modules instead (``model.to("cpu")``) would make new parameter
tensors for the optimizer to lose track of, and leaves the optimizer state
where it was; torch has no call that moves an optimizer's state in place.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

_OFFLOADED = "_rfb_offloaded"
"""The attribute on the model that holds its offloaded bytes."""


def offload(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Copy the storage of every parameter, gradient, buffer and optimizer
    state tensor of ``model`` / ``optimizer`` to host memory and free it
    (resized to 0 bytes). FSDP units still gathered (a head kept unsharded
    after forward) are resharded first. Returns the bytes freed.

    Raises:
        RuntimeError: ``model`` is offloaded already."""
    if getattr(model, _OFFLOADED, None) is not None:
        raise RuntimeError(f"{type(model).__name__} is offloaded already: onload it first")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    saved = []
    for storage in _storages(model, optimizer):
        host = torch.empty(  # host: where the offloaded bytes wait
            storage.nbytes(), dtype=torch.uint8, pin_memory=storage.is_cuda
        )
        host.copy_(_as_bytes(storage), non_blocking=storage.is_cuda)
        saved.append((storage, host))
    if any(storage.is_cuda for storage, _ in saved):
        torch.cuda.current_stream().synchronize()  # the copies out before the frees
    for storage, _ in saved:
        storage.resize_(0)
    setattr(model, _OFFLOADED, (saved, optimizer))
    return sum(host.numel() for _, host in saved)


def onload(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Give back the storage :func:`offload` freed, with the same bytes.
    Returns the bytes restored.

    Raises:
        RuntimeError: ``model`` is not offloaded, or was offloaded with
            another optimizer (or none)."""
    offloaded = getattr(model, _OFFLOADED, None)
    if offloaded is None:
        raise RuntimeError(f"{type(model).__name__} is not offloaded")
    saved, offloaded_optimizer = offloaded
    if offloaded_optimizer is not optimizer:
        raise RuntimeError(
            f"{type(model).__name__} was offloaded with "
            f"{type(offloaded_optimizer).__name__ if offloaded_optimizer else 'no optimizer'}: "
            "onload it with the same"
        )
    for storage, host in saved:
        storage.resize_(host.numel())
        _as_bytes(storage).copy_(host, non_blocking=host.is_pinned())
    delattr(model, _OFFLOADED)
    return sum(host.numel() for _, host in saved)


def is_offloaded(model: nn.Module) -> bool:
    return getattr(model, _OFFLOADED, None) is not None


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _storages(model: nn.Module, optimizer) -> Iterator[torch.UntypedStorage]:
    """Each distinct non-empty storage under the model's parameters (and
    their gradients), buffers and the optimizer's state, once."""
    seen = set()
    for tensor in _tensors(model, optimizer):
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        yield storage


def _tensors(model: nn.Module, optimizer) -> Iterator[torch.Tensor]:
    for param in model.parameters():
        yield param
        if param.grad is not None:
            yield param.grad
    yield from model.buffers()
    if optimizer is not None:
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
