"""Cut a decoder down to one pipeline stage's modules, on any device (meta
included), keeping every parameter's ORIGINAL name (as torchtitan's
``pipeline_llm`` does): the layers a stage holds stay ``layers.<i>`` with
their index in the whole model, and the modules it does not hold are removed
(set to None), so DCP checkpoints and HF exports of the stages reshard by name.

Supported: the built-in decoder (:class:`~ray_fsdp_backend.models.decoder.Transformer`)
and transformers' Llama-style causal LMs (``model.embed_tokens``,
``model.layers``, ``model.rotary_emb``, ``model.norm``, ``lm_head``) of the
families in :data:`HF_FAMILIES` (dense, Gemma and mixture-of-experts; what
differs per family: :mod:`.families`). Tied input and output embeddings span
the first and last stage and are refused.
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch
from torch import nn

from ray_fsdp_backend.compat.peft import is_peft_model
from ray_fsdp_backend.pipeline import families
from ray_fsdp_backend.pipeline.families import HF_FAMILIES
from ray_fsdp_backend.planning.pipeline_layout import StagePlan, plan_stages, tied_embeddings_error
from ray_fsdp_backend.strategies.blocks import STAGE_MODULES, pipeline_roots


class StageLayers(nn.ModuleList):
    """The layers one stage holds, registered under their index in the whole
    model (``layers.5`` stays ``layers.5``); iterates in order, and an int
    index is a position in this stage."""

    def __init__(self, layers: dict[int, nn.Module] | None = None) -> None:
        super().__init__()
        for index, layer in (layers or {}).items():
            self.add_module(str(index), layer)

    def __getitem__(self, idx):
        values = list(self._modules.values())
        return values[idx] if isinstance(idx, int) else nn.ModuleList(values[idx])


def split_for_stage(
    model: nn.Module, stage: int, stages: int, split: Sequence[int] | str | None = None
) -> nn.Module:
    """``model`` cut in place to stage ``stage`` of ``stages`` (layers by
    :func:`~ray_fsdp_backend.planning.pipeline_layout.plan_stages`; ``split``:
    layer counts per stage, or None / ``"auto"``: balanced), its ``forward``
    replaced by the stage's: token ids in on the first stage, hidden states
    between stages, logits out of the last.

    Raises:
        ValueError: a model that is neither the built-in decoder nor a
            supported transformers family, tied embeddings, or more stages
            than layers.
    """
    owner, parts = _decoder_parts(model)
    embed, layers_name, norm, head = parts
    _refuse_tied(model, getattr(owner, embed), _head(model, owner, head))
    layers = getattr(owner, layers_name)
    plan = plan_stages(len(layers), stages, split)[stage]
    setattr(owner, layers_name, StageLayers({i: layers[i] for i in plan.layers}))
    if not plan.first:
        setattr(owner, embed, None)
    if not plan.last:
        setattr(owner, norm, None)
        _drop_head(model, owner, head)
    forward = _builtin_forward if owner is model else _hf_forward
    model.forward = types.MethodType(forward, model)
    model.pipeline_plan = plan
    return model


def split_for_stages(
    model: nn.Module,
    indices: Sequence[int],
    stages: int,
    split: Sequence[int] | str | None = None,
) -> nn.Module:
    """``model`` cut in place to the union of stages ``indices`` of ``stages``
    (virtual stages: a rank holding several), under the original names, with
    one module per stage in ``model.pipeline_stage_modules``: a shallow clone
    of the model sharing the stage's layers (and the embedding, final norm,
    head and buffers) with ``model``, cut by :func:`split_for_stage` and run
    by the schedule. The clones are not submodules of ``model``, so its
    ``named_parameters`` (checkpoints, exports, the optimizer) see each
    parameter once. One index: :func:`split_for_stage` itself.

    Raises:
        ValueError: as :func:`split_for_stage`, for any of the stages.
    """
    if len(indices) == 1:
        return split_for_stage(model, indices[0], stages, split)
    clones = [split_for_stage(_shallow_clone(model), i, stages, split) for i in indices]
    owner, (embed, layers_name, norm, head) = _decoder_parts(model)
    layers = getattr(owner, layers_name)
    keep = sorted(i for clone in clones for i in clone.pipeline_plan.layers)
    setattr(owner, layers_name, StageLayers({i: layers[i] for i in keep}))
    if 0 not in indices:
        setattr(owner, embed, None)
    if stages - 1 not in indices:
        setattr(owner, norm, None)
        _drop_head(model, owner, head)
    model.forward = types.MethodType(_run_by_stages, model)
    model.pipeline_plan = tuple(clone.pipeline_plan for clone in clones)
    model.__dict__[STAGE_MODULES] = clones
    return model


def _shallow_clone(model: nn.Module) -> nn.Module:
    """A new module object over the same submodules, parameters and buffers
    (their dicts shared, so materialising ``model`` fills the clone), with its
    own module table and hooks; the module holding the layers cloned too."""
    owner, _ = _decoder_parts(model)
    clone = _clone_one(model)
    if owner is not model:
        name = next(n for n, m in model.named_children() if m is owner)
        clone._modules[name] = _clone_one(owner)
    return clone


def _clone_one(module: nn.Module) -> nn.Module:
    clone = object.__new__(type(module))
    shared = ("_parameters", "_buffers", "_non_persistent_buffers_set")
    clone.__dict__.update(
        {
            k: v if k in shared or not isinstance(v, dict | set) else type(v)(v)
            for k, v in module.__dict__.items()
        }
    )
    return clone


def _run_by_stages(self, *args, **kwargs):
    raise RuntimeError(
        "a model holding several pipeline stages (pipeline_virtual_stages > 1) runs through "
        "ctx.pipeline_step / pipeline_eval, which call its stages' modules"
    )


def _decoder_parts(model: nn.Module) -> tuple[nn.Module, tuple[str, str, str, str]]:
    """The module holding the layers, and the names of embedding, layers,
    final norm and head."""
    from ray_fsdp_backend.models.decoder import Transformer

    if isinstance(model, Transformer):
        return model, ("tok_embeddings", "layers", "norm", "output")
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    inner = getattr(model, "model", None)
    if family in HF_FAMILIES and hasattr(model, "lm_head") and hasattr(inner, "layers"):
        families.check_family(model)
        return inner, ("embed_tokens", "layers", "norm", "lm_head")
    if is_peft_model(model):  # its model_type is the base model's, which may be supported
        raise ValueError(
            f"pipeline_parallel_size > 1 does not split a peft {type(model).__name__} "
            f"(adapters on a model_type={family!r} base, which is supported without "
            "adapters): train the adapters without pipeline parallelism"
        )
    raise ValueError(
        f"pipeline_parallel_size > 1 splits the built-in decoder or a transformers causal LM "
        f"of model_type {', '.join(HF_FAMILIES)}; got {type(model).__name__} "
        f"(model_type={family!r})"
    )


def _head(model: nn.Module, owner: nn.Module, name: str) -> nn.Module:
    return getattr(owner if owner is model else model, name)


def _drop_head(model: nn.Module, owner: nn.Module, name: str) -> None:
    setattr(owner if owner is model else model, name, None)


def _refuse_tied(model: nn.Module, embed: nn.Module, head: nn.Module) -> None:
    if embed.weight is head.weight:
        raise ValueError(tied_embeddings_error(type(model).__name__))


def _builtin_forward(
    self, x: torch.Tensor, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """A built-in decoder stage: ids (first stage) or hidden states in;
    ``position_ids`` (every stage gets the micro-batch's: packed rows restart
    them per document, and attention then stays inside each document)."""
    from ray_fsdp_backend.models.decoder import rotary_angles

    if self.tok_embeddings is not None:
        x = self.tok_embeddings(x)
    rope = rotary_angles(self.rope_cos, self.rope_sin, x.shape[1], position_ids)
    for block in self.layers:
        x = block(x, rope, position_ids)
    if self.output is not None:
        x = self.output(self.norm(x))
    return x


def _hf_forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """A transformers decoder stage, as its ``model.forward`` (and the causal
    LM's head) without a cache: ``position_ids`` (default ``0 .. S-1``; packed
    rows restart them) give the rotary angles and, through transformers' mask
    builders, the document-boundary (and sliding-window) masks, per layer
    type; per-family parts in :mod:`.families`."""
    inner, config = self.model, self.config
    if inner.embed_tokens is not None:
        x = inner.embed_tokens(x)  # Gemma's sqrt(hidden) scale is inside the module
    positions = position_ids
    if positions is None:
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    kinds = {name: families.layer_type(config, int(name)) for name in inner.layers._modules}
    masks = families.stage_masks(config, set(kinds.values()), x, positions)
    rope = families.stage_rotary(inner, config, set(kinds.values()), x, positions)
    for name, layer in inner.layers._modules.items():
        kind = kinds[name]
        x = layer(
            x, attention_mask=masks[kind], position_embeddings=rope[kind], position_ids=positions
        )
    if self.lm_head is not None:
        x = families.final_logits(config, self.lm_head(inner.norm(x)))
    return x


__all__ = [
    "HF_FAMILIES",
    "StageLayers",
    "StagePlan",
    "pipeline_roots",
    "split_for_stage",
    "split_for_stages",
]
