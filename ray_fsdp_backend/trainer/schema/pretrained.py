"""``model: pretrained: <dir or URI>``: fine-tune a Hugging Face causal LM.

The ``model:`` section of a training YAML either describes the example
Transformer (:class:`~ray_fsdp_backend.models.config.ModelConfig`) or names a
pretrained checkpoint directory::

    model:
      pretrained: /data/llama-3-8b      # or s3://bucket/llama-3-8b
      seq_len: 512                       # tokens per training row
      export: /mnt/shared/llama-ft       # HF-layout export after the last step
      lora: {r: 8, target_modules: [q_proj, v_proj]}   # optional: adapters only

The worker builds the model from its ``config.json`` on the meta device,
wraps it, loads the weights shard by shard
(:func:`~ray_fsdp_backend.hf.load_pretrained`:
:mod:`ray_fsdp_backend.trainer.loop.pretrained`) and tokenizes the corpus
with the tokenizer saved beside the weights
(:func:`ray_fsdp_backend.trainer.data.corpus.tokenize_corpus`). With ``lora:`` it trains
LoRA adapters on the frozen base (:mod:`ray_fsdp_backend.trainer.schema.lora`).
``ray-fsdp plan`` counts parameters from a local checkpoint's safetensors
headers (:mod:`~ray_fsdp_backend.hf.shapes`), else on a meta-device model
built from ``config.json``: no weights read.
``transformers`` and torch are imported on use only: reading the section
(``validate``, ``plan`` without a checkpoint to count) imports neither.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from ray_fsdp_backend.models.config import ModelConfig
from ray_fsdp_backend.trainer.schema.lora import LoraOptions

if TYPE_CHECKING:
    from torch import nn

BASE_DTYPES = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2)}
"""``model.base_dtype`` values: the torch dtype's name and its bytes per
value (names, so that reading a config imports no torch)."""
EXPORT_FORMATS = ("hf", "peft")


@dataclass(frozen=True)
class PretrainedModelConfig:
    """The ``model:`` section for a pretrained Hugging Face causal LM."""

    pretrained: str
    """Checkpoint directory (``config.json``, tokenizer, safetensors) or its URI."""
    seq_len: int = 128
    """Tokens per training row."""
    export: str | None = None
    """Directory the fine-tuned model is exported to after the last step (a
    path every worker sees); None: no export."""
    export_overwrite: bool = False
    """Whether the export may replace a non-empty ``export`` directory's
    weights (False: a non-empty one is refused, after training)."""
    export_format: str = "hf"
    """``hf``: Hugging Face layout (with ``lora``: adapters merged into the
    base); ``peft``: the adapters only, as ``PeftModel.from_pretrained`` reads them."""
    lora: LoraOptions | None = None
    """Train LoRA adapters on the frozen base (``r``, ``alpha``, ``dropout``,
    ``target_modules``); None: full fine-tuning."""
    base_dtype: str = "fp32"
    """``fp32`` or ``bf16``: the dtype the (frozen) base is held in; adapters stay fp32."""

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PretrainedModelConfig:
        known = [f.name for f in fields(cls)]
        unknown = ", ".join(f"model.{k}={v!r}" for k, v in values.items() if k not in known)
        if unknown:
            raise ValueError(
                f"{unknown}: not a key next to model.pretrained; valid keys: {', '.join(known)}"
            )
        if not isinstance(values.get("pretrained"), str) or not values["pretrained"]:
            raise ValueError(f"pretrained={values.get('pretrained')!r} must be a path or URI")
        seq_len = values.get("seq_len", 128)
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 2:
            raise ValueError(f"seq_len={seq_len!r} must be an int >= 2")
        if values.get("export") is not None and not isinstance(values["export"], str):
            raise ValueError(f"export={values['export']!r} must be a path or null")
        if not isinstance(values.get("export_overwrite", False), bool):
            raise ValueError(
                f"export_overwrite={values['export_overwrite']!r} must be true or false"
            )
        values = dict(values)
        if values.get("lora") is not None:
            values["lora"] = LoraOptions.from_dict(values["lora"])
        if values.get("base_dtype", "fp32") not in BASE_DTYPES:
            raise ValueError(f"base_dtype={values['base_dtype']!r} is not one of fp32, bf16")
        export_format = values.get("export_format", "hf")
        if export_format not in EXPORT_FORMATS:
            raise ValueError(f"export_format={export_format!r} is not one of hf, peft")
        if export_format == "peft" and values.get("lora") is None:
            raise ValueError("export_format='peft' writes LoRA adapters: it needs model.lora")
        return cls(**values)

    # -- the sizes `ray-fsdp plan` reports (ModelConfig's interface) ----------

    @property
    def n_layers(self) -> int:
        return _sizes(self.pretrained, self.lora)["n_layers"]

    def num_params(self) -> int:
        return _sizes(self.pretrained, self.lora)["num_params"]

    @property
    def vocab_size(self) -> int:
        """Rows of the output head (the loss's vocabulary)."""
        return _sizes(self.pretrained, self.lora)["vocab_size"]

    @property
    def dim(self) -> int:
        """Width of the output head's input."""
        return _sizes(self.pretrained, self.lora)["dim"]

    def block_params(self) -> int:
        return _sizes(self.pretrained, self.lora)["block_params"]

    def embedding_params(self) -> int:
        return _sizes(self.pretrained, self.lora)["embedding_params"]

    def matrix_params(self) -> int:
        return _sizes(self.pretrained, self.lora)["matrix_params"]

    def frozen_params(self) -> int:
        """Parameters without gradients or optimizer state (the base under LoRA)."""
        return _sizes(self.pretrained, self.lora)["frozen_params"]

    @property
    def frozen_dtype_bytes(self) -> float:
        """Bytes per frozen parameter: the base dtype's, or with
        ``lora.base_quantization: nf4`` the mean over NF4 weights (codes and
        scales) and the rest (embeddings, norms, the head) in the base dtype."""
        itemsize = BASE_DTYPES[self.base_dtype][1]
        if self.lora is None or self.lora.base_quantization is None:
            return itemsize
        from ray_fsdp_backend.ops.nf4_shards import nf4_bytes_per_param

        sizes = _sizes(self.pretrained, self.lora)
        nf4, frozen = sizes["nf4_params"], sizes["frozen_params"]
        total = nf4 * nf4_bytes_per_param(itemsize) + (frozen - nf4) * itemsize
        return total / frozen if frozen else itemsize

    def activation_shape(self, micro_batch_size: int):
        """What the activation estimate needs of this model (its config's
        width, heads and vocabulary) and a micro-batch; None when the config
        names no such shape."""
        from ray_fsdp_backend.planning.memory import ActivationShape

        sizes = _sizes(self.pretrained, self.lora)
        if "n_heads" not in sizes:
            return None
        return ActivationShape(
            n_layers=sizes["n_layers"],
            dim=sizes["dim"],
            n_heads=sizes["n_heads"],
            vocab_size=sizes["vocab_size"],
            seq_len=self.seq_len,
            micro_batch_size=micro_batch_size,
        )

    @property
    def base_label(self) -> str:
        """The frozen base's storage, as ``ray-fsdp plan`` names it."""
        if self.lora is None or self.lora.base_quantization is None:
            return self.base_dtype
        return f"nf4 + {self.base_dtype}, {self.frozen_dtype_bytes:.2f} B/param"

    def check(self) -> list[str]:
        """What the workers would refuse, found on the driver: the checkpoint
        not found, an export target that is not empty without
        ``export_overwrite``, LoRA targets matching no linear layer
        (:func:`~ray_fsdp_backend.hf.check.check_pretrained`: ``config.json``
        only, a meta model, no weights)."""
        from ray_fsdp_backend.hf.check import check_pretrained, export_target_errors

        targets = self.lora.target_modules if self.lora is not None else None
        errors = check_pretrained(self.pretrained, lora_targets=targets)
        if self.export is not None:
            errors += export_target_errors(self.export, overwrite=self.export_overwrite)
        return errors


def build_model_section(values: dict[str, Any]):
    """The ``model:`` section: a pretrained checkpoint, or the example model."""
    if "pretrained" in (values or {}):
        return PretrainedModelConfig.from_dict(dict(values))
    return ModelConfig.from_dict(values)


@functools.lru_cache(maxsize=8)
def _sizes(path: str, lora: LoraOptions | None = None) -> dict[str, int]:
    """Parameter counts of the model ``config.json`` describes (with its
    LoRA adapters): from a local checkpoint's safetensors headers where
    :func:`~ray_fsdp_backend.hf.shapes.read_local_shapes` covers it (no
    torch), else :func:`meta_sizes`."""
    from ray_fsdp_backend.hf.shapes import read_local_shapes, shape_sizes

    shapes = read_local_shapes(path)
    return shape_sizes(shapes, lora) if shapes is not None else meta_sizes(path, lora)


def meta_sizes(path: str, lora: LoraOptions | None = None) -> dict[str, int]:
    """:func:`_sizes` from a meta model (nothing allocated, no weights read)."""
    from ray_fsdp_backend.hf.models import build_causal_lm
    from ray_fsdp_backend.ops.quantization import nf4_targets
    from ray_fsdp_backend.trainer.schema.lora import apply_lora

    model = build_causal_lm(path)
    if lora is not None:
        model = apply_lora(model, lora)
    blocks = _layer_lists(model)
    block = max((_count(b) for b in blocks), default=0)
    in_blocks = sum(_count(b) for b in blocks)
    matrices = sum(
        p.numel() for b in blocks for p in b.parameters() if p.ndim >= 2 and p.requires_grad
    )
    total = _count(model)
    vocab, dim = model.get_output_embeddings().weight.shape
    return dict(
        vocab_size=vocab,
        dim=dim,
        n_layers=len(blocks),
        num_params=total,
        block_params=block,
        embedding_params=total - in_blocks,
        matrix_params=matrices,
        frozen_params=sum(p.numel() for p in model.parameters() if not p.requires_grad),
        nf4_params=sum(math.prod(t.shape) for t in nf4_targets(model)),
        **_attention_heads(getattr(model, "config", None)),
    )


def _attention_heads(config) -> dict[str, int]:
    """Attention heads of a transformers config (the activation estimate's
    input beside the head's width and vocabulary); empty when missing."""
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    heads = getattr(config, "num_attention_heads", None)
    return {"n_heads": heads} if isinstance(heads, int) else {}


def _layer_lists(model: nn.Module) -> list[nn.Module]:
    from torch import nn

    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # a tied weight counts once
