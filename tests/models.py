"""Small models shared by the tests: blocks in an nn.ModuleList, like a transformer."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class ToyNet(nn.Module):
    """Input projection, a ModuleList of blocks, output head. ``tied=True``
    makes the head reuse the input projection's weight (needs square dims)."""

    def __init__(
        self,
        dim_in: int = 8,
        dim: int = 16,
        n_layers: int = 2,
        dim_out: int = 8,
        tied: bool = False,
    ):
        super().__init__()
        self.inp = nn.Linear(dim_in, dim, bias=False)
        self.layers = nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.head = nn.Linear(dim, dim_out, bias=False)
        if tied:
            self.head.weight = self.inp.weight

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def make_batch(n: int = 16, dim_in: int = 8, dim_out: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim_in, generator=g), torch.randn(n, dim_out, generator=g)


def reference_model(seed: int = 0, **kwargs) -> ToyNet:
    torch.manual_seed(seed)
    return ToyNet(**kwargs)
