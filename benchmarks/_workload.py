"""The training workload every step-time comparison runs: the example decoder,
AdamW, gradient accumulation and clipping, on this rank's own batches."""

from __future__ import annotations

import torch

from ray_fsdp_backend.models.decoder import ModelConfig, Transformer

MAX_NORM = 1.0
LR = 1e-3


def build_model(model: dict, seed: int = 0) -> Transformer:
    """The example decoder, identically initialised on every call and rank."""
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**model))


def make_batches(model: dict, batch: int, accum: int, rank: int) -> list[tuple]:
    """``accum`` (tokens, targets) micro-batches, different on every rank."""
    cfg = ModelConfig(**model)
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(accum):
        seq = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # foreach=False: the same per-parameter kernels on every path, whatever
    # torch's default picks for DTensor and plain parameters.
    return torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)


def loss_fn(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy through ``model(tokens)`` (so that DDP's forward
    runs too; ``Transformer.loss`` would bypass the DDP wrapper)."""
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
