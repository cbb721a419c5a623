"""Tiny pretrained Hugging Face checkpoints (built here: hub downloads fail)
and the batch every comparison runs."""

from __future__ import annotations

import torch

from ray_fsdp_backend.trainer.tiny_pretrained import VOCAB, save_tiny_pretrained, tiny_config

__all__ = ["VOCAB", "input_ids", "save_tiny_pretrained", "tiny_config"]


def input_ids(batch: int = 2, seq: int = 16, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)
