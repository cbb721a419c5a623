"""Expert parallelism for transformers mixture-of-experts models.

Each MoE layer's experts are split along the expert dim over the mesh's
``ep`` axis (ep rank r holds experts ``[r*N/ep, (r+1)*N/ep)``) and the
(token, expert) pairs its router picks travel to the expert's rank and back
by two all-to-alls, in forward and backward. The experts are then FSDP2
sharded over ``efsdp`` (the ranks holding the same experts); the dense
modules are untouched and sharded by the caller as without EP.

The split and the dispatch are transformers' own (5.23,
``transformers.distributed.expert_parallel``), applied by the model's
``base_model_ep_plan``: ``grouped_gemm`` makes ``experts.gate_up_proj`` /
``down_proj`` ``Shard(0)`` DTensors on ``ep`` and sets the module's
``num_experts`` to the local count; ``ep_dispatch_experts`` replaces
``mlp.experts.forward`` by ``AllToAllEP`` (split sizes read to the host once
per layer; a rank that receives no token still runs both exchanges and
joins FSDP's reduce-scatter). The module layout is kept: ``mlp.gate`` is
called and drives the dispatch, ``mlp.experts`` is called as a module
holding ``gate_up_proj`` / ``down_proj``. Only the plan's expansion (the
names are matched under any prefix, so a PEFT-wrapped model is found) and
the FSDP2 divide factor are written here.
"""

from __future__ import annotations

import re

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from ray_fsdp_backend.compat.peft import tuner_layers
from ray_fsdp_backend.distributed.mesh import EXPERT_BATCH_AXIS, slice_flattened
from ray_fsdp_backend.planning.experts import EXPERT_COUNT_KEYS
from ray_fsdp_backend.planning.topology import EP_AXIS

DISPATCH_STYLE = "ep_dispatch_experts"
"""The plan style of a module whose forward becomes the token dispatch."""


def resolve_ep_plan(model: nn.Module, expert_parallel_size: int) -> dict[str, str]:
    """The model's ``base_model_ep_plan`` expanded to its module and parameter
    names (``model.layers.0.mlp.experts.gate_up_proj``: ``grouped_gemm``).

    Raises:
        ValueError: the model has no experts (no plan, or a plan matching
            nothing; a mixture-of-experts class without a plan, Llama 4, is
            named as such), a PEFT adapter wraps the experts, or an expert
            count not divisible by ``expert_parallel_size``.
    """
    resolved = expand_ep_plan(model)
    if DISPATCH_STYLE not in resolved.values():
        raise ValueError(_no_plan_message(model, expert_parallel_size))
    refuse_expert_adapters(model, resolved, expert_parallel_size)
    for name in _dispatch_modules(resolved):
        experts = model.get_submodule(name).num_experts
        if experts % expert_parallel_size:
            raise ValueError(
                f"expert_parallel_size={expert_parallel_size} must divide the expert count of "
                f"{name} ({experts} experts): each ep rank holds the same number of experts"
            )
    return resolved


def expand_ep_plan(model: nn.Module) -> dict[str, str]:
    """PURE: the model's ``base_model_ep_plan`` matched against its module and
    parameter names under any prefix (empty for a model without a plan)."""
    config = getattr(model, "config", None)
    plan = dict(getattr(config, "base_model_ep_plan", None) or {})
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    resolved = {}
    for pattern, style in plan.items():
        regex = re.compile(r"(?:.*\.)?" + re.escape(pattern).replace(r"\*", r"\d+"))
        resolved.update({name: style for name in names if regex.fullmatch(name)})
    return resolved


def experts_modules(model: nn.Module) -> list[str]:
    """Names of the experts modules the model's expert-parallel plan
    dispatches to (one per MoE layer; none for a dense model)."""
    return _dispatch_modules(expand_ep_plan(model))


def _no_plan_message(model: nn.Module, ep: int) -> str:
    """Why ``model`` cannot be split: a mixture-of-experts whose transformers
    class ships no ``base_model_ep_plan`` (Llama 4), or a dense model."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    count = next((getattr(config, k) for k in EXPERT_COUNT_KEYS if getattr(config, k, 0)), 0)
    if count:
        return (
            f"expert_parallel_size={ep}: {type(model).__name__} is a mixture-of-experts model "
            f"({count} experts) whose transformers class declares no expert-parallel plan "
            "(config.base_model_ep_plan), so its experts cannot be split over ep; "
            "set expert_parallel_size: 1 (its experts are then FSDP-sharded like dense layers)"
        )
    return (
        f"expert_parallel_size={ep}: {type(model).__name__} has no experts to split (no "
        "base_model_ep_plan with an ep_dispatch_experts module); set expert_parallel_size: 1 "
        "for a dense model"
    )


def refuse_expert_adapters(model: nn.Module, plan: dict[str, str], ep: int) -> None:
    """Raise ``ValueError`` when a PEFT adapter wraps an experts module of
    the plan (LoRA ``target_parameters`` on ``mlp.experts.*``): the dispatch
    would be installed on PEFT's wrapper and the adapters never split with
    the experts, so ranks would compute different, wrong updates."""
    dispatch = _dispatch_modules(plan)
    for layer, _ in tuner_layers(model):
        hit = next((d for d in dispatch if layer == d or layer.startswith(d + ".")), None)
        if hit is not None:
            raise ValueError(
                f"expert_parallel_size={ep}: a peft adapter wraps the experts {hit!r} "
                "(LoRA target_parameters on mlp.experts.*): adapters on experts are not "
                "split over ep; target the attention or dense layers, or set "
                "expert_parallel_size: 1"
            )


def _dispatch_modules(plan: dict[str, str]) -> list[str]:
    return [name for name, style in plan.items() if style == DISPATCH_STYLE]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, ep: int) -> list[nn.Module]:
    """Split ``model``'s experts over ``mesh["ep"]`` and install the
    all-to-all dispatch (transformers' ``apply_expert_parallelism``);
    returns the experts modules, for :func:`shard_experts`. Must run before
    activation checkpointing or compile wrap the blocks (the plan names
    modules by their unwrapped paths)."""
    from ray_fsdp_backend.compat.transformers import apply_expert_parallelism

    plan = resolve_ep_plan(model, ep)
    ep_mesh, batch_mesh = (slice_flattened(mesh, a) for a in (EP_AXIS, EXPERT_BATCH_AXIS))
    apply_expert_parallelism(model, ep_mesh, batch_mesh, plan, "all_to_all")
    return [model.get_submodule(name) for name in _dispatch_modules(plan)]


def shard_experts(
    experts: list[nn.Module], mesh: DeviceMesh, divide_factor: float, **fsdp_kwargs
) -> None:
    """``fully_shard`` each experts module over ``mesh`` (``efsdp``, or
    ``(dp_replicate, efsdp)``), before its block is sharded.

    An expert's gradient sums the tokens of every data-parallel rank (the ep
    group's by the exchange, the other ep groups' by the reduce-scatter over
    efsdp and the HSDP all-reduce), so it is divided by ``divide_factor``,
    the dense modules' divisor (the data-parallel size, or 1 when gradients
    are summed), not by the efsdp size FSDP2 would use. FSDP2 applies such a
    factor through ``PREMUL_SUM``, which gloo lacks (torch 2.13): the
    reduction is a forced sum divided locally, except without a
    reduce-scatter (efsdp 1), where FSDP2 divides the local gradient itself
    and a forced sum would divide twice (transformers' fsdp.py does the
    same).
    """
    shard_ranks = mesh.size(mesh.ndim - 1)
    for module in experts:
        fully_shard(module, mesh=mesh, **fsdp_kwargs)
        module.set_gradient_divide_factor(float(divide_factor))
        if shard_ranks > 1:
            module.set_force_sum_reduction_for_comms(True)
