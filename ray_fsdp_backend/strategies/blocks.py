"""Which submodules are "blocks", and the changes applied to them in place.

Used by every strategy before it wraps: FSDP shards each block as one unit,
and activation checkpointing recomputes each block in backward.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from ray_fsdp_backend.compat.peft import (
    check_meta_initialisable,
    is_peft_model,
    note_random_frozen,
    reset_adapters,
)
from ray_fsdp_backend.strategies.cpu_rng import (
    full_copies_into_shards,
    single_process_rng_on_cpu_meshes,
)

_logger = logging.getLogger(__name__)

STAGE_MODULES = "pipeline_stage_modules"
"""The attribute in which a model cut into virtual pipeline stages
(:func:`ray_fsdp_backend.pipeline.split.split_for_stages`) lists one module
per stage."""


def pipeline_roots(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 makes roots: each virtual stage's module of a model
    :func:`~ray_fsdp_backend.pipeline.split.split_for_stages` cut (torch's
    PipelineStage then drives each one's gradient sync), else the model itself."""
    return list(model.__dict__.get(STAGE_MODULES, ())) or [model]


def find_blocks(model: nn.Module, class_names: Sequence[str] = ()) -> list[nn.Module]:
    """The model's blocks, outermost first and never one inside another.

    With ``class_names``: every module whose class name is listed. Without:
    every child of every ``nn.ModuleList`` (the transformer-layers
    convention). A block whose parameters are also used outside it (a tied
    weight) is left to the enclosing unit, so tied weights share one group.

    Raises:
        ValueError: a listed class name matches no module.
    """
    if class_names:
        wanted = set(class_names)
        candidates = [m for m in model.modules() if type(m).__name__ in wanted]
        missing = wanted - {type(m).__name__ for m in candidates}
        if missing:
            raise ValueError(
                f"fsdp_block_classes={sorted(class_names)}: no module of class "
                f"{sorted(missing)} in {type(model).__name__}"
            )
    else:
        candidates = [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m]
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for block in candidates:
        if id(block) in inside or block is model:
            continue
        if _shares_params_outside(model, block):
            _logger.info(
                "%s shares parameters with other modules: sharded with its parent",
                type(block).__name__,
            )
            continue
        blocks.append(block)
        inside.update(id(m) for m in block.modules())
    return blocks


def _shares_params_outside(model: nn.Module, block: nn.Module) -> bool:
    own = {id(p) for p in block.parameters()}
    inside = {id(m) for m in block.modules()}
    return any(
        id(p) in own
        for m in model.modules()
        if id(m) not in inside
        for p in m.parameters(recurse=False)
    )


def apply_activation_checkpointing(model: nn.Module, blocks: Sequence[nn.Module]) -> None:
    """Recompute activations in backward: the model's own
    ``gradient_checkpointing_enable()`` when it has one (Hugging Face models),
    otherwise checkpointing of every block.

    The composable ``checkpoint`` keeps parameter names unchanged, so
    checkpoints stay loadable with and without it.

    Raises:
        ValueError: the model has neither that method nor any block.
    """
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if callable(enable):
        enable()
        return
    if not blocks:
        raise ValueError(
            f"use_gradient_checkpointing=True but {type(model).__name__} has no "
            "gradient_checkpointing_enable() and no blocks to checkpoint; set "
            "fsdp_block_classes"
        )
    from torch.distributed._composable import checkpoint

    for block in blocks:
        checkpoint(block)


def apply_compile(model: nn.Module, blocks: Sequence[nn.Module], *, required: bool = True) -> None:
    """``torch.compile`` every block in place, before it is sharded or
    checkpointed, as torchtitan does: one compiled graph per block, reused by
    all blocks of the same shape. ``Module.compile()`` keeps parameter names
    (no ``_orig_mod.`` prefix), so checkpoints load with and without it.
    Without blocks and not ``required`` (``compile: auto``) it warns and
    compiles nothing.

    Raises:
        ValueError: no blocks and ``required``: nothing to compile one by one.
    """
    if not blocks:
        message = (
            f"the wrap policy found no blocks in {type(model).__name__} "
            "(no nn.ModuleList children): set fsdp_block_classes to the class names of "
            "its transformer blocks"
        )
        if required:
            raise ValueError(f"compile=True but {message}")
        _logger.warning("compile: auto runs eagerly: %s", message)
        return
    for block in blocks:
        block.compile()


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _shared_parameter_slots(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) registrations of every parameter registered more than once."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            slots.setdefault(id(param), []).append((module, name))
    return [s for s in slots.values() if len(s) > 1]


def materialize_meta_module(
    model: nn.Module, device: torch.device | str, *, buffer_device: torch.device | str | None = None
) -> None:
    """Allocate a meta-device model's (possibly sharded) storage and initialise
    it: the model's ``init_weights()`` when it has one, else every submodule's
    ``reset_parameters()``; then PEFT adapters get PEFT's own initialisation
    (:func:`~ray_fsdp_backend.compat.peft.reset_adapters`).

    Run after sharding, so each rank allocates and initialises only its own
    shard and no rank ever holds the full model. On CPU meshes random fills
    give the values one process would from the same seed
    (:mod:`~ray_fsdp_backend.strategies.cpu_rng`). Parameters go to ``device``
    (the host under CPU offload: FSDP2 moves them per use), buffers to
    ``buffer_device`` (default ``device``): FSDP2 never moves buffers, so they
    live where compute runs. ``init_weights()`` must also recompute
    non-persistent buffers (rotary tables): allocation leaves them garbage.

    Only meta tensors are allocated: tensors that already hold values (a
    partly-meta model) keep them, also through the initialisation.

    Raises:
        ValueError: the model has no ``init_weights()`` and some module holds
            meta parameters or buffers but has no ``reset_parameters()``;
            nothing is allocated.
    """
    init = getattr(model, "init_weights", None)
    if not callable(init):
        _check_resettable(model)
    peft = is_peft_model(model)
    if peft:
        check_meta_initialisable(model)
    tied = _shared_parameter_slots(model)
    real = {name: t.detach().clone() for name, t in _named_tensors(model) if not t.is_meta}
    meta_params = [name for name, p in model.named_parameters() if p.is_meta]
    meta_buffers = [name for name, b in model.named_buffers() if b.is_meta]
    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    # Allocation makes one new tensor per registration, untying shared weights.
    for slots in tied:
        first = getattr(*slots[0])
        for module, name in slots[1:]:
            setattr(module, name, first)
    for name in meta_buffers:
        owner, _, attr = name.rpartition(".")
        buffers = model.get_submodule(owner)._buffers
        buffers[attr] = buffers[attr].to(buffer_device or device)
    with torch.no_grad(), single_process_rng_on_cpu_meshes(device), full_copies_into_shards():
        if callable(init):
            init()
        else:
            for module in model.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
        if peft:  # the model's init gave adapters nn.Linear's; PEFT's starts lora_B at 0
            reset_adapters(model, meta_params)
        note_random_frozen(model, meta_params)  # until load_pretrained fills the base
        current = dict(_named_tensors(model))
        for name, value in real.items():  # values the caller gave win over init
            current[name].copy_(value)


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def _check_resettable(model: nn.Module) -> None:
    """Raise unless every module holding meta tensors can reset them."""
    uninitialisable = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if not callable(getattr(m, "reset_parameters", None))
            and any(t.is_meta for t in [*m.parameters(False), *m.buffers(False)])
        }
    )
    if uninitialisable:
        raise ValueError(
            f"{type(model).__name__} was built on the meta device but has no "
            f"init_weights(), and {uninitialisable} have parameters without "
            "reset_parameters() (or meta buffers nothing would fill): their values "
            "would be uninitialised memory"
        )
