"""A local checkpoint's parameters as ``ray-fsdp plan`` counts them, read
without torch or ``transformers``: :func:`read_local_shapes`, :func:`shape_sizes`.

``plan`` and ``validate`` of a ``model.pretrained`` directory need its
parameter names and shapes and a few ``config.json`` fields, not a model:
the names, shapes and dtypes come from the safetensors headers
(``safetensors.safe_open`` with ``framework="numpy"``: headers only, no
tensor read), the architecture from ``config.json``. Building the meta model
instead imports torch and ``transformers`` (about 7 s on a quiet machine).

Covered are the families in :data:`SHAPE_FAMILIES`, whose checkpoint keys are
the model's parameter names (a MoE layer's per-expert keys aside, which the
model holds fused in two 3-D stacks: the same elements, neither of them an
``nn.Linear``), and whose output head is ``lm_head`` (tied: the embedding).
Anything else (another family, an object store URI, a directory without
safetensors) returns None and the caller builds the meta model as before;
``tests/unit/test_checkpoint_shapes.py`` holds each covered family's counts
equal to the meta model's.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass

SHAPE_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"})
"""``model_type`` values whose parameters are read from the checkpoint
(decoders under ``model.layers``, ``nn.Linear`` projections, ``lm_head``)."""
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
HEAD = "lm_head"
EMBEDDING = "model.embed_tokens"
_BLOCK = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_ROUTER = ".mlp.gate.weight"
"""A MoE router's weight: a router module, not ``nn.Linear`` (nor are the
per-expert keys, :data:`_EXPERT`, fused into 3-D stacks in the model)."""


@dataclass(frozen=True)
class ParamShape:
    """One checkpoint tensor: its key (the model's parameter name), its
    shape, and whether its module is an ``nn.Linear`` (LoRA and NF4 targets)."""

    name: str
    shape: tuple[int, ...]
    linear: bool

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]


@dataclass(frozen=True)
class CheckpointShapes:
    """A local checkpoint's ``config.json`` and its tensors (key order)."""

    config: dict
    params: tuple[ParamShape, ...]

    @property
    def head(self) -> ParamShape:
        """The output head's weight (tied: the input embedding's)."""
        by_name = {p.name: p for p in self.params}
        return by_name.get(f"{HEAD}.weight") or by_name[f"{EMBEDDING}.weight"]

    @property
    def model_class(self) -> str:
        """The causal LM class ``config.json`` names (its ``model_type`` if none)."""
        names = self.config.get("architectures") or [self.config["model_type"]]
        return str(names[0])

    def nf4_weights(self) -> list[tuple[str, tuple[int, ...]]]:
        """Name and shape of every linear weight NF4 quantises (all but the head)."""
        return [(p.name, p.shape) for p in self.params if p.linear and p.module != HEAD]

    def expert_layers(self) -> dict[str, int]:
        """Each MoE layer's experts module (``model.layers.0.mlp.experts``) and
        its expert count, from the per-expert keys; empty for a dense model."""
        experts: dict[str, set[int]] = {}
        for p in self.params:
            found = _EXPERT.search(p.name)
            if found is not None:
                experts.setdefault(p.name[: found.start()] + ".experts", set()).add(
                    int(found.group(1))
                )
        return {name: len(ids) for name, ids in experts.items()}

    def linear_names(self) -> set[str]:
        """Last name part of every ``nn.Linear`` module (``lm_head`` included
        when tied: the module is there, its weight is the embedding's)."""
        return {p.module.rsplit(".", 1)[-1] for p in self.params if p.linear} | {HEAD}


@functools.lru_cache(maxsize=8)
def read_local_shapes(path: str) -> CheckpointShapes | None:
    """The checkpoint at local directory ``path`` (its safetensors headers and
    ``config.json``), or None where the plan needs the meta model: a URI, no
    safetensors, a config that is not JSON or of a family outside
    :data:`SHAPE_FAMILIES`."""
    if "://" in path or not os.path.isdir(path):
        return None
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("model_type") not in SHAPE_FAMILIES:
        return None
    files = _safetensors_files(path)
    if not files:
        return None
    from safetensors import safe_open

    params = []
    for file in files:
        with safe_open(os.path.join(path, file), framework="numpy") as f:
            for key in f.keys():
                shape = tuple(f.get_slice(key).get_shape())
                linear = key.endswith(".weight") and len(shape) == 2
                linear = linear and key != f"{EMBEDDING}.weight" and not key.endswith(_ROUTER)
                linear = linear and not _EXPERT.search(key)
                params.append(ParamShape(key, shape, linear))
    return CheckpointShapes(config, tuple(params))


def _safetensors_files(path: str) -> list[str]:
    """The weight files the index names (each once, in order), or the single file."""
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            return list(dict.fromkeys(json.load(f)["weight_map"].values()))
    return [SINGLE_NAME] if os.path.isfile(os.path.join(path, SINGLE_NAME)) else []


def shape_sizes(ckpt: CheckpointShapes, lora=None) -> dict[str, int]:
    """The counts
    :class:`~ray_fsdp_backend.trainer.schema.pretrained.PretrainedModelConfig`
    reports, from
    shapes: the model's (a tied head counted once), with LoRA adapters of
    rank ``lora.r`` on every linear module whose name ends in a target (as
    peft matches them: ``r x (in + out)`` each, the base frozen)."""
    targets = tuple(lora.target_modules) if lora is not None else ()
    blocks: dict[int, list[int]] = {}  # block -> [its params, its trainable matrix params]
    total = nf4 = 0
    for p in ckpt.params:
        adapter = 0
        if p.linear and any(p.module == t or p.module.endswith("." + t) for t in targets):
            adapter = lora.r * (p.shape[0] + p.shape[1])
        total += p.numel + adapter
        nf4 += p.numel if lora is not None and p.linear and p.module != HEAD else 0
        found = _BLOCK.match(p.name)
        if found is None:
            continue
        block = blocks.setdefault(int(found.group(1)), [0, 0])
        block[0] += p.numel + adapter
        block[1] += adapter if lora is not None else (p.numel if len(p.shape) >= 2 else 0)
    in_blocks = sum(b[0] for b in blocks.values())
    vocab, dim = ckpt.head.shape
    heads = ckpt.config.get("num_attention_heads")
    frozen = sum(p.numel for p in ckpt.params) if lora is not None else 0
    return dict(
        vocab_size=vocab,
        dim=dim,
        n_layers=len(blocks),
        num_params=total,
        block_params=max((b[0] for b in blocks.values()), default=0),
        embedding_params=total - in_blocks,
        matrix_params=sum(b[1] for b in blocks.values()),
        frozen_params=frozen,
        nf4_params=nf4,
        **({"n_heads": heads} if isinstance(heads, int) else {}),
    )
