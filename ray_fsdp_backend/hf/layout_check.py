"""What a pretrained model's shapes refuse in a layout, found from its
``config.json`` before any worker starts: :func:`model_layout_errors`.

``validate``, ``plan`` and ``train`` run it through the spec's static check
(``plan`` again with its own node counts). Each rule is the one the workers
apply, run on a meta model (no weights): the expert count against
``expert_parallel_size`` (:func:`~ray_fsdp_backend.strategies.expert_parallel.resolve_ep_plan`),
the tensor-parallel plan's heads and widths against ``tensor_parallel_size``
(:func:`~ray_fsdp_backend.strategies.tensor_parallel.check_tp_divisibility`),
and every NF4 weight's shard against NF4's blocks
(:func:`~ray_fsdp_backend.ops.quantization.nf4_shard_problems`). Messages are one
a line, each naming the key; a rule repeated on every layer is said once
(``model.layers.*.mlp``).
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a rule needs the meta model
    from torch import nn


def model_layout_errors(
    model: nn.Module, *, ep: int = 1, tp: int = 1, nf4_shards: int | None = None
) -> list[str]:
    """Every refusal of ``model`` (a meta model) at expert-parallel size
    ``ep``, tensor-parallel size ``tp`` and, with ``nf4_shards``, an NF4 base
    sharded over that many ranks; empty: none."""
    errors = expert_errors(model, ep) if ep > 1 else []
    errors += tensor_parallel_shape_errors(model, tp) if tp > 1 else []
    errors += nf4_errors(model, nf4_shards) if nf4_shards else []
    return errors


def pretrained_layout_errors(model_cfg, dist, node_counts: list[list[int]]) -> list[str]:
    """:func:`model_layout_errors` for a ``model.pretrained`` section under the
    ``distributed`` section, for each cluster in ``node_counts`` (workers per
    node; ``validate`` and ``train`` pass ``[[n]]`` for each worker count
    ``n``, ``plan`` its nodes). Each message is said once."""
    from ray_fsdp_backend.distributed.mesh import resolve_layout
    from ray_fsdp_backend.hf.shapes import read_local_shapes
    from ray_fsdp_backend.planning.topology import CP_AXIS, SHARD_AXIS, topology_from_node_counts

    quantized = model_cfg.lora is not None and model_cfg.lora.base_quantization is not None
    ep, tp = dist.expert_parallel_size, dist.tensor_parallel_size
    if ep == 1 and tp == 1 and not quantized:
        return []
    # The expert and NF4 rules need shapes alone: a local checkpoint's headers
    # (a dense model under ep > 1 is refused naming its class: the meta model's)
    shapes = read_local_shapes(model_cfg.pretrained) if tp == 1 else None
    if shapes is not None and ep > 1 and not shapes.expert_layers():
        shapes = None
    model = meta_model(model_cfg.pretrained) if shapes is None else None
    errors: list[str] = []
    for counts in node_counts:
        shards = None
        if quantized and dist.use_fsdp:
            try:
                layout = resolve_layout(dist, topology_from_node_counts(counts))
            except ValueError:  # the layout's own error is reported by its check
                continue
            shards = layout.size((SHARD_AXIS, CP_AXIS))
        if shapes is not None:
            found = expert_count_errors(shapes.expert_layers(), ep) if ep > 1 else []
            found += nf4_weight_errors(shapes.nf4_weights(), shards) if shards else []
        else:
            found = model_layout_errors(model, ep=ep, tp=tp, nf4_shards=shards)
        errors += [e for e in found if e not in errors]
    return errors


@functools.lru_cache(maxsize=4)
def meta_model(path: str) -> nn.Module:
    """The checkpoint's model on the meta device (``config.json`` only), built
    once per path in this process; read, never changed."""
    from ray_fsdp_backend.hf.models import build_causal_lm

    return build_causal_lm(path)


def expert_errors(model: nn.Module, ep: int) -> list[str]:
    """``ep`` against every MoE layer's expert count (one line per count)."""
    from ray_fsdp_backend.strategies.expert_parallel import DISPATCH_STYLE, resolve_ep_plan

    key = f"distributed.expert_parallel_size={ep}"
    try:
        plan = resolve_ep_plan(model, 1)
    except ValueError as exc:
        return [f"{key}: {str(exc).split(': ', 1)[-1]}"]
    experts = {
        name: model.get_submodule(name).num_experts
        for name, style in plan.items()
        if style == DISPATCH_STYLE
    }
    return expert_count_errors(experts, ep)


def expert_count_errors(experts: dict[str, int], ep: int) -> list[str]:
    """``ep`` against the expert count of each MoE layer (experts module
    name -> count; one line per count that ``ep`` does not divide)."""
    key = f"distributed.expert_parallel_size={ep}"
    layers: dict[int, list[str]] = {}
    for name, count in experts.items():
        layers.setdefault(count, []).append(name)
    return [
        f"{key} does not divide the {count} experts of {_collapse(names)} "
        f"({len(names)} MoE layer{'s' * (len(names) > 1)}): every ep rank holds the same number "
        f"of experts; use an expert_parallel_size that divides {count}"
        for count, names in sorted(layers.items())
        if count % ep
    ]


def tensor_parallel_shape_errors(model: nn.Module, tp: int) -> list[str]:
    """The tensor-parallel plan of ``model`` against ``tp``: a refused family,
    no plan, or heads and split widths ``tp`` does not divide (one line)."""
    from ray_fsdp_backend.strategies import tensor_parallel as tpmod

    key = f"distributed.tensor_parallel_size={tp}"
    try:
        tpmod.check_tp_family(model)
        matched = tpmod.match_plan(model, tpmod.resolve_tp_plan(model, None))
        tpmod.check_tp_divisibility(model, matched, tp)
    except ValueError as exc:
        message = _collapse_text(str(exc))
        if message.startswith(f"tensor_parallel_size={tp} "):
            return [f"distributed.{message}"]
        return [f"{key}: {message}"]
    return []


def nf4_errors(model: nn.Module, shards: int) -> list[str]:
    """Every linear weight NF4 would quantise (all but the output head), its
    shard over ``shards`` FSDP ranks against NF4's blocks: the loader's rule."""
    from torch import nn

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weights = [
        (f"{name}.weight", tuple(module.weight.shape))
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module is not head and module.weight.ndim == 2
    ]
    return nf4_weight_errors(weights, shards)


def nf4_weight_errors(weights: list[tuple[str, tuple[int, ...]]], shards: int) -> list[str]:
    """:func:`nf4_errors` for the 2-D weights (name, shape) NF4 would quantise."""
    from ray_fsdp_backend.ops.nf4_shards import Target, nf4_shard_problems

    targets = []
    for name, (rows, cols) in weights:
        shard = (rows // shards if rows % shards == 0 else rows, cols)
        targets.append(Target(name, (rows, cols), shard, shards))
    problems = sorted(set(_collapse_text(p) for p in nf4_shard_problems(targets)))
    return [
        f"model.lora.base_quantization='nf4' over {shards} FSDP shard(s): {p}" for p in problems
    ]


def _collapse(names: list[str]) -> str:
    """Layer names with their numbers as ``*`` when there are several."""
    unique = sorted({re.sub(r"\.\d+\.", ".*.", n) for n in names})
    return ", ".join(unique) if len(names) > 1 else names[0]


def _collapse_text(text: str) -> str:
    """Layer numbers as ``*`` and the repeats that leaves removed (in order)."""
    text = re.sub(r"\.\d+\.", ".*.", text)
    head, sep, rest = text.partition(" does not divide ")
    if not sep:
        return text
    items, tail = rest.split(" of ", 1) if " of " in rest else (rest, "")
    unique = list(dict.fromkeys(items.split(", ")))
    return f"{head}{sep}{', '.join(unique)}" + (f" of {tail}" if tail else "")
