"""PEFT models (a frozen base with trainable adapters) under every strategy.

A ``peft`` model needs no wrapping of its own: FSDP2 (torch 2.13) checks that
the *trainable* parameters of a unit share one dtype and all-gathers a unit
whose parameters mix dtypes as bytes, so a bf16 frozen base and fp32 LoRA
adapters live in the same per-block unit (one all-gather per block, as for
the full model); frozen parameters get no gradient, so reduce-scatter and
the gradient buffers cover the adapters only. DDP leaves frozen parameters
out of its reducer. What this module adds:

- :func:`reset_adapters`: PEFT's own adapter initialisation, run after a
  meta-built model is materialised (the model's ``init_weights()`` would give
  ``lora_B`` a random ``nn.Linear`` init; PEFT gives it zeros, so the model
  starts as the base model).
- a record of models whose frozen base was materialised at random and not
  yet loaded (:func:`note_random_frozen`, :func:`note_frozen_loaded`,
  :func:`frozen_is_random`): restoring adapters onto such a base is refused.
- :func:`adapter_layout`: the adapters' ranks and target modules read off
  tensor shapes, to name what differs when a checkpoint does not fit.

``peft`` is never imported here: a model can only hold PEFT layers when the
caller imported ``peft``, so ``sys.modules`` says whether to look for them.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable, Mapping

from torch import nn

# Adapter initialisations that need no base weight (the rest, such as
# "pissa", "olora", "loftq", "eva", "corda" and DoRA, derive the adapters
# from the pretrained weights, which a meta-built model does not have yet).
_META_SAFE_LORA_INITS = (True, False, "gaussian")

_RANDOM_FROZEN: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def tuner_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every PEFT adapter layer (``BaseTunerLayer``) in ``model``."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` (or the module a DDP wrapper holds) has PEFT adapter layers."""
    return bool(tuner_layers(unwrap(model)))


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (FSDP2 shards in place: the model itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def peft_base(model: nn.Module) -> nn.Module:
    """The model a ``PeftModel`` wraps (with its adapters injected), for its
    class and config; any other module as it is."""
    if "peft" in sys.modules:
        from peft import PeftModel

        if isinstance(model, PeftModel):
            return model.get_base_model()
    return model


def has_frozen_parameters(model: nn.Module) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def peft_configs(model: nn.Module) -> Mapping[str, object]:
    """Adapter name -> its PEFT config (``PeftModel.peft_config``, or the
    ``peft_config`` that ``inject_adapter_in_model`` leaves on the model)."""
    configs = getattr(unwrap(model), "peft_config", None)
    return configs if isinstance(configs, Mapping) else {}


def check_meta_initialisable(model: nn.Module) -> None:
    """Raise ``ValueError`` for adapters whose PEFT initialisation reads the
    base weights (PiSSA, OLoRA, LoftQ, EVA, CorDA, DoRA): on a meta-built
    model those weights do not exist until ``load_pretrained``."""
    for adapter, config in peft_configs(model).items():
        init = getattr(config, "init_lora_weights", True)
        if init not in _META_SAFE_LORA_INITS:
            raise ValueError(
                f"peft adapter {adapter!r}: init_lora_weights={init!r} derives the adapter "
                "from the base weights, which a model built on the meta device does not "
                "have; use True or 'gaussian', or build the model with its weights"
            )
        if getattr(config, "use_dora", False):
            raise ValueError(
                f"peft adapter {adapter!r}: use_dora=True initialises the magnitude from "
                "the base weights, which a model built on the meta device does not have"
            )


def reset_adapters(model: nn.Module, names: Iterable[str] | None = None) -> None:
    """Re-run PEFT's initialisation of the adapters (LoRA: ``lora_A`` as PEFT
    initialises it, ``lora_B`` zeros; LoHa/LoKr/IA3 through their own reset).
    ``names``: only layers owning one of these parameter names (those that
    were on the meta device); None: all. Call under ``torch.no_grad()``."""
    wanted = None if names is None else set(names)
    configs = peft_configs(model)
    for layer_name, layer in tuner_layers(model):
        prefix = f"{layer_name}." if layer_name else ""
        own = {f"{prefix}{n}" for n, _ in layer.named_parameters()}
        if wanted is not None and not own & wanted:
            continue
        for adapter in _adapters_of(layer):
            _reset_layer(layer, adapter, configs.get(adapter))


def _adapters_of(layer: nn.Module) -> list[str]:
    names: set[str] = set()
    for attr in layer.adapter_layer_names:
        names.update(getattr(layer, attr).keys())
    return sorted(names)


def _reset_layer(layer: nn.Module, adapter: str, config) -> None:
    reset = getattr(layer, "reset_lora_parameters", None)
    if callable(reset):
        reset(adapter, getattr(config, "init_lora_weights", True))
        return
    for method in ("reset_adapter_parameters", "reset_ia3_parameters"):  # LoHa/LoKr, IA3
        reset = getattr(layer, method, None)
        if callable(reset):
            reset(adapter)
            return
    raise ValueError(
        f"{type(layer).__name__} was built on the meta device but has no PEFT reset "
        "method to initialise its adapters; build it with its weights"
    )


def refuse_tied_adapters(model: nn.Module) -> None:
    """Raise ``ValueError`` when a PEFT adapter layer's base weight is shared
    with another module (LoRA on ``lm_head`` with ``tie_word_embeddings``):
    the merged export keeps one copy of a tied weight, so the adapter's delta
    would be lost or land on the embedding too (peft warns of the same), and
    a model built on the meta device cannot be re-tied through the adapter."""
    owners: dict[int, list[str]] = {}
    for name, p in unwrap(model).named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    for layer_name, layer in tuner_layers(model):
        base = getattr(getattr(layer, "base_layer", None), "weight", None)
        others = [n for n in owners.get(id(base), []) if not n.startswith(f"{layer_name}.")]
        if base is not None and others:
            raise ValueError(
                f"peft adapter on {layer_name!r}: its base weight is tied to {others[0]!r} "
                "(tie_word_embeddings=True); LoRA on a tied weight is not supported (the "
                "merged export keeps one copy of it); leave that module out of "
                "target_modules, or untie the weights"
            )


# -- whether the frozen base holds real weights ----------------------------


def note_random_frozen(model: nn.Module, meta_names: Iterable[str]) -> None:
    """Record that ``model``'s frozen parameters among ``meta_names`` were
    just materialised with a random initialisation."""
    meta = set(meta_names)
    if any(n in meta and not p.requires_grad for n, p in model.named_parameters()):
        _RANDOM_FROZEN.add(unwrap(model))


def note_frozen_loaded(model: nn.Module) -> None:
    """Record that ``model``'s frozen base now holds loaded weights."""
    _RANDOM_FROZEN.discard(unwrap(model))


def frozen_is_random(model: nn.Module) -> bool:
    """Whether ``model``'s frozen base was materialised at random and never loaded."""
    return unwrap(model) in _RANDOM_FROZEN


# -- adapter layout from shapes (PURE) -------------------------------------


def adapter_layout(shapes: Mapping[str, tuple | None]) -> dict[str, list[int]]:
    """Target module kind (``q_proj``) -> sorted LoRA ranks, read off the
    ``lora_A`` entries of a name -> shape mapping (model or checkpoint keys)."""
    layout: dict[str, set[int]] = {}
    for key, shape in shapes.items():
        head, sep, _ = key.partition(".lora_A.")
        if sep and shape:
            layout.setdefault(head.rsplit(".", 1)[-1], set()).add(shape[0])
    return {target: sorted(ranks) for target, ranks in sorted(layout.items())}


def describe_layout(layout: Mapping[str, list[int]]) -> str:
    if not layout:
        return "no LoRA adapters"
    return ", ".join(f"{t} r={'/'.join(map(str, r))}" for t, r in layout.items())
