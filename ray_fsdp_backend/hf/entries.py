"""Where a model tensor's bytes are in a safetensors checkpoint (pure data)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorEntry:
    """One checkpoint tensor: ``file`` (a path on the filesystem), its key
    there, dtype, shape and absolute byte range."""

    file: str
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class ExpertsEntry:
    """A fused experts tensor ``[E, ...]`` read from per-expert tensors:
    ``parts[e]`` are expert ``e``'s tensors, concatenated along dim 0."""

    parts: tuple[tuple[TensorEntry, ...], ...]
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def file(self) -> str:
        return self.parts[0][0].file


Entry = TensorEntry | ExpertsEntry
