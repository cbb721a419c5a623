"""``model:`` for the example decoder: :class:`ModelConfig` and its presets.

Plain data and arithmetic (parameter counts, the activation estimate's
shape), apart from the ``nn.Module`` in :mod:`ray_fsdp_backend.models.decoder`
so that ``ray-fsdp plan`` and ``validate`` read a config without importing
torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from ray_fsdp_backend.planning.memory import ActivationShape


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder. Every field is a YAML key under ``model:``."""

    vocab_size: int = 256
    """Byte-level tokens: 256."""

    dim: int = 128
    """Width of the residual stream."""

    n_layers: int = 4
    """Number of transformer blocks."""

    n_heads: int = 4
    """Attention heads; ``dim`` must be a multiple."""

    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means ``n_heads``."""

    ffn_hidden: int | None = None
    """SwiGLU hidden width; None means Llama's ``8/3 * dim`` rounded up to 64."""

    seq_len: int = 128
    """Longest sequence (length of the rotary tables)."""

    tie_embeddings: bool = True
    """Share the embedding and output-head weight."""

    rope_theta: float = 10000.0
    """Rotary base frequency."""

    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"model.{name}={value!r} must be a positive int")
        if self.dim % self.n_heads:
            raise ValueError(
                f"model.dim={self.dim} is not a multiple of model.n_heads={self.n_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"model.dim / model.n_heads = {self.head_dim} must be even (rotary)")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} is not a multiple of "
                f"model.n_kv_heads={self.n_kv_heads}"
            )
        if self.ffn_hidden is not None and self.ffn_hidden <= 0:
            raise ValueError(f"model.ffn_hidden={self.ffn_hidden!r} must be a positive int")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return 64 * math.ceil(8 * self.dim / 3 / 64)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """Build from the ``model:`` section; a ``preset`` key starts from a preset."""
        values = dict(values or {})
        base = PRESETS[values.pop("preset")] if "preset" in values else {}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown model config key(s) {unknown}; valid keys: {', '.join(sorted(known))}"
            )
        return cls(**{**base, **values})

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        if name not in PRESETS:
            raise ValueError(f"model.preset={name!r} is not one of {', '.join(PRESETS)}")
        return cls(**PRESETS[name])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # -- parameter counts (pure arithmetic, used by the memory estimate) ----

    def block_params(self) -> int:
        """Parameters of one transformer block."""
        d, kv = self.dim, self.kv_heads * self.head_dim
        attention = d * d + 2 * d * kv + d * d  # wq, wk, wv, wo
        mlp = 3 * d * self.hidden  # w1 (gate), w3 (up), w2 (down)
        return attention + mlp + 2 * d  # two RMSNorm weights

    def embedding_params(self) -> int:
        """Embedding, final norm and (untied) head: the root FSDP group."""
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.dim + head

    def num_params(self) -> int:
        return self.n_layers * self.block_params() + self.embedding_params()

    def matrix_params(self) -> int:
        """Parameters in the blocks' 2-D weights: those Muon orthogonalises."""
        return self.n_layers * (self.block_params() - 2 * self.dim)

    def parameter_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Name and shape of every parameter of
        :class:`~ray_fsdp_backend.models.decoder.Transformer`, in its
        ``named_parameters()`` order (a tied head once, as the embedding):
        what ``plan`` chooses DMuon's owners from without building it."""
        d, kv, h = self.dim, self.kv_heads * self.head_dim, self.hidden
        block = [
            ("attention_norm.weight", (d,)),
            *((f"attention.{w}.weight", (n, d)) for w, n in (("wq", d), ("wk", kv), ("wv", kv))),
            ("attention.wo.weight", (d, d)),
            ("ffn_norm.weight", (d,)),
            ("feed_forward.w1.weight", (h, d)),
            ("feed_forward.w3.weight", (h, d)),
            ("feed_forward.w2.weight", (d, h)),
        ]
        layers = [(f"layers.{i}.{n}", s) for i in range(self.n_layers) for n, s in block]
        head = [] if self.tie_embeddings else [("output.weight", (self.vocab_size, d))]
        return [
            ("tok_embeddings.weight", (self.vocab_size, d)),
            *layers,
            ("norm.weight", (d,)),
            *head,
        ]

    def activation_shape(self, micro_batch_size: int) -> ActivationShape:
        """What the activation estimate needs of this model and a micro-batch."""
        return ActivationShape(
            n_layers=self.n_layers,
            dim=self.dim,
            n_heads=self.n_heads,
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            micro_batch_size=micro_batch_size,
        )

    def flops_per_token(self) -> int:
        """Training FLOPs per token (6N plus attention), for throughput figures."""
        attention = 12 * self.n_layers * self.dim * self.seq_len
        return 6 * self.num_params() + attention


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(dim=128, n_layers=4, n_heads=4, seq_len=128),
    "small": dict(dim=512, n_layers=8, n_heads=8, seq_len=512),
    "350m": dict(dim=1024, n_layers=24, n_heads=16, seq_len=1024),
    "1b": dict(dim=2048, n_layers=22, n_heads=16, n_kv_heads=8, seq_len=2048),
}
"""Named sizes for ``model.preset``; explicit ``model:`` keys override them."""
