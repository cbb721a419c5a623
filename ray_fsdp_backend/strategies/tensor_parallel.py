"""Tensor parallelism: split each layer over the ``tp`` mesh axis before FSDP2.

A plan maps module names to how each is split, in transformers' vocabulary
(``{"layers.*.self_attn.q_proj": "colwise", ...}``, ``*`` standing for one
name component). It comes from ``ctx.wrap(model, tp_plan=...)``, else from
the model: a transformers model's ``_tp_plan`` (its class's ``lm_head`` entry
merged with ``config.base_model_tp_plan``), or the example decoder's own
``_tp_plan``. Every entry becomes a ``torch.distributed.tensor.parallel``
style and :func:`parallelize_module` applies them (torchtitan's order: TP,
then activation checkpointing, compile, ``fully_shard`` on the dp sub-mesh).

Parameters the plan does not split (norms, biases of unplanned modules)
become ``Replicate`` DTensors on the tp mesh, so every parameter lives on the
same root mesh and ``foreach`` optimizers and the global clip see no mixed
meshes (pytorch#134212).

The module that holds column-wise layers (attention, MLP) turns its input
into one ``Replicate`` DTensor that they all take (torchtitan's
``PrepareModuleInput`` with ``use_local_output=False``): their input
gradients are reduced once per module, not once per layer.

Sequence parallel (``sequence_parallel``) keeps the residual stream split
along the sequence between the planned layers: the embedding reduce-scatters
its output, norms run on their sequence shard (``SequenceParallel``), the
module that holds column-wise layers all-gathers its input once (and
reduce-scatters its gradient), and row-wise outputs are reduce-scattered. It needs a model that does
not read the sequence length off its hidden states: the example decoder
declares ``supports_sequence_parallel``; transformers models derive position
ids from the embedding output's length, so they run without it.

Loss parallel (``loss_parallel``) keeps the output head's logits split over
the vocabulary (a ``Shard(-1)`` DTensor); the cross-entropy and its backward
then run inside ``ctx.loss_parallel()`` (torch's ``loss_parallel``) without
gathering the logits.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ray_fsdp_backend.strategies.tp_dropout import apply_sharded_dropout

_logger = logging.getLogger(__name__)

COLWISE = ("colwise", "colwise_rep", "colwise_gather_output", "local_colwise")
ROWWISE = ("rowwise", "rowwise_rep", "local_rowwise", "rowwise_split_input")
EMBEDDING = ("embedding_rowwise",)
GATHER_OUTPUT = ("colwise_rep", "colwise_gather_output")
SPLIT_INPUT = ("rowwise_rep", "rowwise_split_input")
GRAD_ALLREDUCE = "replicated_with_grad_allreduce"
STYLE_NAMES = COLWISE + ROWWISE + EMBEDDING + ("sequence_parallel", "replicate", GRAD_ALLREDUCE)
"""The plan values understood (transformers 5.23's names). The fused
projections of Phi-3 (``qkv_proj``, ``gate_up_proj``) and OLMo 2's q/k/v
use ``colwise_gather_output`` (split, then all-gathered, so the fused
output is whole) followed by ``rowwise_split_input`` (a replicated input
sliced locally). transformers' ``packed_*`` / ``moe_tp_experts`` /
``mla_kv_a_proj`` / ``local_params`` styles split expert or latent
weights and are refused by name."""


REFUSED_FAMILIES = {
    "gpt_oss": (
        "its attention holds a sinks parameter used on activations passed as keyword "
        "arguments, which the replicated style cannot turn into DTensors (aten.cat of a "
        "DTensor and a tensor); transformers 5.23's own gpt-oss plan splits only the "
        "embedding (experts go by expert parallelism). Use FSDP2 or context parallelism"
    ),
}
"""transformers ``model_type`` values tensor parallelism refuses, and why."""


def check_tp_family(model: nn.Module) -> None:
    """Refuse a family tensor parallelism cannot run, by name, before any
    weight moves.

    Raises:
        ValueError: ``config.model_type`` is in :data:`REFUSED_FAMILIES`.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in REFUSED_FAMILIES:
        raise ValueError(
            f"tensor_parallel_size > 1 is refused for {type(model).__name__} "
            f"(model_type={model_type!r}): {REFUSED_FAMILIES[model_type]}"
        )


@dataclass(frozen=True)
class TPOptions:
    """How the plan's styles are built."""

    sequence_parallel: bool
    loss_parallel: bool


def resolve_tp_plan(model: nn.Module, tp_plan: Mapping[str, object] | None) -> dict:
    """The plan to apply: ``tp_plan`` if given, else the model's ``_tp_plan``.

    Raises:
        ValueError: no plan anywhere, or a style name not in ``STYLE_NAMES``.
    """
    plan = tp_plan if tp_plan is not None else getattr(model, "_tp_plan", None)
    if not plan:
        raise ValueError(
            f"tensor_parallel_size > 1 but {type(model).__name__} has no tensor-parallel plan "
            "(no _tp_plan, no config.base_model_tp_plan): pass ctx.wrap(model, tp_plan={...}) "
            "mapping module names to 'colwise' / 'rowwise' / 'colwise_gather_output' / "
            "'embedding_rowwise'"
        )
    for name, style in plan.items():
        if not isinstance(style, ParallelStyle) and style not in STYLE_NAMES:
            raise ValueError(
                f"tp_plan[{name!r}]={style!r} is not one of {', '.join(STYLE_NAMES)} "
                "(or a torch ParallelStyle)"
            )
    return dict(plan)


def match_plan(model: nn.Module, plan: Mapping[str, object]) -> dict[str, object]:
    """``{module name: style}`` for every module a plan pattern names."""
    patterns = [(re.compile(_pattern_regex(p)), style) for p, style in plan.items()]
    matched = {}
    for name, _ in model.named_modules():
        for regex, style in patterns:
            if name and regex.fullmatch(name):
                matched[name] = style
    return matched


def _pattern_regex(pattern: str) -> str:
    return r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split("."))


def check_tp_divisibility(model: nn.Module, matched: Mapping[str, object], tp: int) -> None:
    """Refuse, with the numbers, a model whose heads or split dimensions
    ``tp`` does not divide. Reads shapes only: works on a meta model.

    Raises:
        ValueError: naming every dimension that does not divide.
    """
    problems = [f"{k}={v}" for k, v in model_head_counts(model).items() if v % tp]
    modules = dict(model.named_modules())
    for name, style in matched.items():
        size = _split_size(modules[name], style)
        if size is not None and size[1] % tp:
            problems.append(f"{name}.{size[0]}={size[1]}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide {', '.join(problems)} of "
            f"{type(model).__name__}: every split dimension and head count must be a multiple of "
            "the tp size"
        )


def _split_size(module: nn.Module, style) -> tuple[str, int] | None:
    if isinstance(module, nn.Embedding) and style in EMBEDDING:
        return "num_embeddings", module.num_embeddings
    if isinstance(module, nn.Linear) and style in COLWISE:
        return "out_features", module.out_features
    if isinstance(module, nn.Linear) and style in ROWWISE:
        return "in_features", module.in_features
    return None


def model_head_counts(model: nn.Module) -> dict[str, int]:
    """Attention head counts from a transformers ``config`` or the example
    decoder's ``cfg`` (those a tp group splits)."""
    config = getattr(model, "config", None) or getattr(model, "cfg", None)
    keys = ("num_attention_heads", "num_key_value_heads", "n_heads", "kv_heads")
    counts = {}
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            counts[key] = value
    return counts


def build_styles(matched: Mapping[str, object], options: TPOptions) -> dict[str, ParallelStyle]:
    """The torch style for every matched module name. The output head is the
    last module (in module order) with a gathered-output style: only it
    keeps its logits split under ``loss_parallel`` (Phi-3 and OLMo 2 gather
    the outputs of inner layers with the same style name)."""
    heads = [name for name, style in matched.items() if style in GATHER_OUTPUT]
    head = heads[-1] if heads else None
    return {name: _style(style, options, name == head) for name, style in matched.items()}


def _style(style, options: TPOptions, output_head: bool = False) -> ParallelStyle:
    if isinstance(style, ParallelStyle):
        return style
    sp = options.sequence_parallel
    seq = Shard(1)
    if style in GATHER_OUTPUT:
        split_logits = output_head and options.loss_parallel
        head = _OutputHeadParallel if output_head else ColwiseParallel
        return head(
            input_layouts=seq if sp and output_head else Replicate(),
            output_layouts=Shard(-1) if split_logits else Replicate(),
            use_local_output=not split_logits,
        )
    if style in COLWISE:
        return ColwiseParallel()
    if style in ROWWISE:
        inputs = Replicate() if style in SPLIT_INPUT else Shard(-1)
        return RowwiseParallel(input_layouts=inputs, output_layouts=seq if sp else Replicate())
    if style in EMBEDDING:
        return _EmbeddingParallel(output_layouts=seq if sp else Replicate())
    if style == "sequence_parallel":
        return SequenceParallel(use_local_output=True)
    if style == GRAD_ALLREDUCE:
        # transformers' ReplicatedWithGradAllReduce: a replicated weight (a
        # per-head q/k norm) applied to this rank's heads, its gradient summed
        # over tp. The input declared Shard(0) over tp says exactly that (the
        # norm reduces over the last dim only, so any other dim would do):
        # DTensor then all-reduces the weight's Partial gradient and leaves
        # the input's gradient local, whatever the family's head layout.
        return SequenceParallel(sequence_dim=0, use_local_output=True)
    return _ReplicateStyle()


class _EmbeddingParallel(RowwiseParallel):
    """The input embedding split over the vocabulary, its output plain.

    Its all-reduced output is an ``AsyncCollectiveTensor`` (funcol): under
    torch 2.13, one reaching a ``torch.compile``-d block is unwrapped off the
    autograd graph by AOT autograd, and the embedding's gradient is lost
    (zero untied, 0.68x tied; grad norm 0.861 vs 1.149 at step 1). A clone
    waits for the collective and returns a plain tensor on the graph."""

    def __init__(self, *, output_layouts) -> None:
        super().__init__(input_layouts=Replicate(), output_layouts=output_layouts)

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        outputs = RowwiseParallel._prepare_output_fn(
            output_layouts, use_local_output, mod, outputs, device_mesh
        )
        return outputs.clone() if isinstance(outputs, AsyncCollectiveTensor) else outputs


class _OutputHeadParallel(ColwiseParallel):
    """The output head split over the vocabulary, its gathered logits a
    tensor of their own.

    ``DTensor.to_local`` returns a view (``view_as``, torch 2.13), and the
    head's output is the model's: FSDP2 hooks its pre-backward all-gather on
    the root's outputs and warns that an in-place op on a view ("returned a
    view tensor ... will silently drop the pre-backward hook") loses it. A
    clone (one copy of the logits; the gathered one is freed at once) is a
    tensor the hook stays on. Split logits (``loss_parallel``) stay DTensors."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        outputs = ColwiseParallel._prepare_output_fn(
            output_layouts, use_local_output, mod, outputs, device_mesh
        )
        return outputs.clone() if outputs._base is not None else outputs


class _ReplicateStyle(ParallelStyle):
    """Parameters ``Replicate`` on the tp mesh; plain tensors in and out."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            input_fn=lambda _m, inputs, mesh: tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            ),
            output_fn=lambda _m, out, _mesh: out.to_local() if isinstance(out, DTensor) else out,
        )


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, object], options: TPOptions
) -> nn.Module:
    """Split ``model`` over ``tp_mesh`` by ``plan`` in place (meta or real
    weights: each rank keeps its slice) and return it.

    Unplanned parameters become replicated on ``tp_mesh``; with sequence
    parallelism those outside column-wise parents (the norms) run on
    sequence shards. Weights tied before (an output head that is the
    embedding) are tied again when both halves end up with the same layout,
    and untied with a warning otherwise.

    Raises:
        ValueError: a plan that names no module of ``model``, or a head
            count or split dimension ``tp`` does not divide.
    """
    check_tp_family(model)
    matched = match_plan(model, plan)
    if not matched:
        raise ValueError(
            f"the tensor-parallel plan matched no module of {type(model).__name__} "
            f"(patterns {sorted(plan)[:4]}...): nothing would be split. For a model of your "
            "own, pass ctx.wrap(model, tp_plan=...) with its module names"
        )
    check_tp_divisibility(model, matched, tp_mesh.size())
    ties = _tied_parameters(model)
    styles = build_styles(matched, options)
    parents = sorted({n.rpartition(".")[0] for n, s in matched.items() if s in COLWISE})
    parents = [p for p in parents if p and p not in matched]
    for name in _unplanned_parameter_modules(model, matched):
        inside = any(name.startswith(p + ".") for p in parents)
        sp_norm = options.sequence_parallel and not inside
        styles[name] = SequenceParallel(use_local_output=True) if sp_norm else _ReplicateStyle()
    parallelize_module(model, tp_mesh, styles)
    apply_sharded_dropout(model, matched, parents, tp_mesh.get_local_rank())
    modules = dict(model.named_modules())
    for name in parents:
        modules[name].register_forward_pre_hook(
            _block_input_hook(tp_mesh, options.sequence_parallel), with_kwargs=True
        )
    _retie(model, ties)
    return model


def _unplanned_parameter_modules(model: nn.Module, matched) -> list[str]:
    """Modules holding parameters directly that no plan entry (or an
    ancestor's) covers."""
    out = []
    for name, module in model.named_modules():
        covered = any(name == m or name.startswith(m + ".") for m in matched)
        if not covered and any(True for _ in module.parameters(recurse=False)):
            out.append(name)
    return out


def _block_input_hook(tp_mesh: DeviceMesh, sequence_parallel: bool):
    """Forward pre-hook of a module holding column-wise layers (attention,
    MLP): its hidden states (the first positional tensor, or
    ``hidden_states=``) become one ``Replicate`` DTensor that every
    column-wise layer inside takes as is (torchtitan's ``PrepareModuleInput``
    with ``use_local_output=False``).

    Their input gradients (``Partial`` over tp) then add up as DTensors and
    are reduced once for the whole module, where the DTensor was made:
    reduce-scattered back to the sequence shards with sequence parallelism
    (whose forward all-gathers them here), all-reduced without. Plain inputs
    would make each column-wise layer all-reduce its own (q, k, v, gate, up:
    five per block instead of two)."""
    layout = Shard(1) if sequence_parallel else Replicate()

    def prepare(x: torch.Tensor) -> DTensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, tp_mesh, [layout], run_check=False)
        return x.redistribute(tp_mesh, [Replicate()])

    def hook(_module, args, kwargs):
        if args and isinstance(args[0], torch.Tensor):
            return (prepare(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": prepare(kwargs["hidden_states"])}
        return None

    return hook


def _tied_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) that share one parameter."""
    by_id: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module.named_parameters(recurse=False):
            by_id.setdefault(id(p), []).append((module, attr))
    return [group for group in by_id.values() if len(group) > 1]


def _retie(model: nn.Module, ties) -> None:
    for group in ties:
        first = getattr(*group[0])
        for module, attr in group[1:]:
            other = getattr(module, attr)
            same = getattr(first, "placements", None) == getattr(other, "placements", None)
            if same and first.shape == other.shape:
                setattr(module, attr, first)
            else:
                _logger.warning(
                    "tensor parallel: %s.%s was tied but is split differently (%s vs %s); "
                    "it is trained untied",
                    type(module).__name__,
                    attr,
                    getattr(first, "placements", None),
                    getattr(other, "placements", None),
                )
