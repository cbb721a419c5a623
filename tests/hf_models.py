"""Tiny pretrained Hugging Face checkpoints (built here: hub downloads fail)
and the batch every comparison runs."""

from __future__ import annotations

import os

import torch

from ray_fsdp_backend.models.tiny_pretrained import VOCAB, save_tiny_pretrained, tiny_config

__all__ = [
    "VOCAB",
    "fine_tune",
    "input_ids",
    "read_safetensors",
    "save_tiny_pretrained",
    "tiny_config",
]


def input_ids(batch: int = 2, seq: int = 16, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def fine_tune(model, rank: int, world: int, steps: int = 2) -> None:
    """``steps`` AdamW steps (lr 1e-2) of the model's own loss, each rank on
    its two rows of one global batch of :func:`input_ids`."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mine = input_ids(batch=2 * world)[2 * rank : 2 * rank + 2]
    for _ in range(steps):
        opt.zero_grad()
        model(mine, labels=mine).loss.backward()
        opt.step()


def read_safetensors(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face checkpoint directory's safetensors files."""
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, name)))
    return tensors
