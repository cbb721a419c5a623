"""A small Llama-style decoder in plain PyTorch: RMSNorm, rotary attention, SwiGLU.

The example model that ``ray-fsdp train`` trains. It is sized entirely by
:class:`ModelConfig`, from a few hundred thousand parameters (CPU quick start)
to about a billion (``ModelConfig.preset("1b")``), and is written so the
backend can shard it without adapters:

- the transformer blocks sit in one ``nn.ModuleList`` named ``layers``, the
  backend's default per-block ``fully_shard`` unit;
- a tied output head *is* the embedding weight (one parameter), so it stays in
  the root FSDP group together with the embedding;
- ``init_weights()`` initialises every parameter and recomputes the
  non-persistent rotary tables, so a model built under ``torch.device("meta")``
  and materialised with ``to_empty`` is complete.

Build on meta, let the backend wrap and materialise::

    with torch.device("meta"):
        model = Transformer(ModelConfig(dim=128, n_layers=4, n_heads=4))
    model = ctx.wrap(model)          # to_empty + init_weights + fully_shard
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ray_fsdp_backend.context_parallel.attention import ContextParallelAttention

# The config is plain data in its own module (plan / validate import no torch);
# it is re-exported here, beside the model it sizes.
from ray_fsdp_backend.models.config import PRESETS, ModelConfig  # noqa: F401
from ray_fsdp_backend.ops.head import capture_head_input
from ray_fsdp_backend.ops.loss import linear_cross_entropy


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))  # host: moved with the module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the compute dtype: bf16 loses the mean square.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


def compute_rotary_tables(
    head_dim: int, seq_len: int, theta: float, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape ``(seq_len, head_dim // 2)``."""
    exponent = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


Rope = tuple[torch.Tensor, torch.Tensor]
"""cos and sin of every token's rotary angles, broadcastable to
``(batch, heads, seq, head_dim // 2)``."""


def rotary_angles(
    cos: torch.Tensor, sin: torch.Tensor, seq: int, position_ids: torch.Tensor | None = None
) -> Rope:
    """The tables' rows for each token: ``0 .. seq-1``, or the positions in
    ``position_ids`` (``[batch or 1, seq]``: packed documents, cp shards)."""
    if position_ids is None:
        return cos[:seq], sin[:seq]
    return cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)


def apply_rotary(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate pairs of channels of ``x`` (batch, heads, seq, head_dim)."""
    cos, sin = (t.to(x.dtype) for t in rope)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2)


class Attention(ContextParallelAttention):
    """Grouped-query rotary attention; the kernel is ``self.attention_fn``
    (causal, document-masked for packed rows; Ulysses or ring under context
    parallelism, set by ``ctx.wrap``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: Rope, position_ids: torch.Tensor | None = None):
        # Heads as -1: under tensor parallelism this rank holds n_heads / tp of them.
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        out = self.attention_fn(q, k, v, position_ids=position_ids)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block: the unit that FSDP shards and checkpointing recomputes."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: Rope, position_ids: torch.Tensor | None = None):
        x = x + self.attention(self.attention_norm(x), rope, position_ids)
        return x + self.feed_forward(self.ffn_norm(x))


def _normal(module: nn.Module | None, std: float, shape, device) -> None:
    """``normal_`` on ``module.weight``; a throwaway tensor of ``shape`` when
    the module is absent or on meta (another pipeline stage's), so the
    random stream advances as in the whole model."""
    if module is None or module.weight.is_meta:
        torch.empty(shape, device=device).normal_(std=std)
    else:
        nn.init.normal_(module.weight, std=std)


def _init_block(block: Block, residual_std: float, device) -> None:
    """A block's initialisation (a meta block: its draws only)."""
    std = 0.02
    if not block.attention_norm.weight.is_meta:
        block.attention_norm.init_weights()
        block.ffn_norm.init_weights()
    attention, ffn = block.attention, block.feed_forward
    for linear, scale in (
        (attention.wq, std),
        (attention.wk, std),
        (attention.wv, std),
        (ffn.w1, std),
        (ffn.w3, std),
        (attention.wo, residual_std),
        (ffn.w2, residual_std),
    ):
        _normal(linear, scale, tuple(linear.weight.shape), device)


class Transformer(nn.Module):
    """Decoder-only language model: ``forward(tokens) -> logits``, ``loss(tokens, targets)``."""

    _tp_plan = {
        "tok_embeddings": "embedding_rowwise",
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "output": "colwise_gather_output",
    }
    """How tensor parallelism splits it (transformers' style names)."""

    supports_sequence_parallel = True
    """Nothing reads the sequence length off the hidden states between the
    embedding and the head, so they may stay split along the sequence."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Derived from the config, not learned: non-persistent, so checkpoints
        # skip them and init_weights() must rebuild them after to_empty().
        cos, sin = compute_rotary_tables(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not self.tok_embeddings.weight.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter and recompute the rotary tables in place.

        Safe to call on a model materialised from meta with ``to_empty`` and
        on an FSDP-sharded model (DTensor parameters are filled shard-wise).
        Residual output projections get the GPT-2 ``1/sqrt(2 * n_layers)`` scale.
        """
        if self.cfg.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            # Plain Module.to_empty() gives each module its own new Parameter,
            # silently untying the head (FSDP2's fully_shard keeps the tie).
            # Same failure: github.com/Modalities/modalities/issues/357
            self.output.weight = self.tok_embeddings.weight
        device = buffer_device or self.rope_cos.device
        cos, sin = compute_rotary_tables(
            self.cfg.head_dim, self.cfg.seq_len, self.cfg.rope_theta, device
        )
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        std = 0.02
        # A pipeline stage (pipeline/split.py) lacks some modules: their draws
        # go to throwaway tensors, so every stage gets one process's weights.
        _normal(self.tok_embeddings, std, (self.cfg.vocab_size, self.cfg.dim), device)
        if not self.cfg.tie_embeddings:
            _normal(self.output, std, (self.cfg.vocab_size, self.cfg.dim), device)
        if self.norm is not None:
            self.norm.init_weights()
        held = dict(self.layers.named_children())
        for index in range(self.cfg.n_layers):
            block = held.get(str(index))
            if block is None:
                with torch.device("meta"):
                    block = Block(self.cfg)
            _init_block(block, std / math.sqrt(2 * self.cfg.n_layers), device)

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        loss_chunk_tokens: int | None = None,
    ) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]``, or with ``targets`` (shifted, -100
        none) their token-sum cross-entropy computed chunk by chunk without
        the whole logits (:func:`~ray_fsdp_backend.ops.loss.linear_cross_entropy`,
        ``loss_chunk_tokens`` a chunk), inside the forward so that FSDP's
        gathered head weight serves it. ``position_ids`` (``[batch or 1, seq]``)
        give each token's position in its document: packed rows restart them
        per document (attention never crosses documents), and a context-parallel
        shard passes its tokens' true positions."""
        if tokens.shape[1] > self.cfg.seq_len:
            raise ValueError(
                f"sequence of {tokens.shape[1]} tokens exceeds model.seq_len={self.cfg.seq_len}"
            )
        x = self.tok_embeddings(tokens)
        rope = rotary_angles(self.rope_cos, self.rope_sin, tokens.shape[1], position_ids)
        for block in self.layers:
            x = block(x, rope, position_ids)
        if targets is None:
            return self.output(self.norm(x))
        with capture_head_input(self.output) as captured:
            self.output(self.norm(x))  # the head's own hooks (tp) shape its input
        return linear_cross_entropy(
            captured.hidden, self.output.weight, targets, chunk_size=loss_chunk_tokens
        )

    def get_output_embeddings(self) -> nn.Linear:
        """The output head (transformers' name for it)."""
        return self.output

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over the valid targets (-100: none),
        in fp32, without the whole logits."""
        return self(tokens, targets=targets) / (targets != -100).sum()
