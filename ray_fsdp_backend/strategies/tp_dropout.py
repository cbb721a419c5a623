"""Dropout on tensor-parallel shards: independent across tp ranks, alike elsewhere.

Every rank of a tp group holds the same tokens and, outside the split layers,
the same activations, so its generators are seeded alike (``ctx.seed_step``)
and a residual dropout drops the same features on every tp rank, as one
process would. Between a column-wise layer and the next row-wise one a rank
holds its own slice (its attention heads, its part of the MLP's hidden
units): drawn from the same generator, head ``h`` of rank 0 and head
``h + H/tp`` of rank 1 would drop the same attention weights (agreement
1.000 measured on Qwen3 at tp 2, against 0.5 between two heads of one rank).

Megatron-LM runs that region under a per-tp-rank RNG state (its
``get_cuda_rng_tracker().fork()``). Here a block's hooks do the same
without a tracker of their own: after a column-wise child whose output is
split, the block forks this rank's generators (CPU, and the current CUDA
device's) to a seed drawn from the shared generator and mixed with the tp
rank; before a child whose input is replicated and after a child whose
output is replicated (and when the block returns) the shared state is put
back. The draw advances the shared generator alike on every tp rank, the
forked draws never touch it, and activation checkpointing, which replays
the shared state, replays the same forks. Blocks without dropout get no
hooks; in compiled blocks the fork and join are graph breaks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from torch import nn

SPLIT_OUTPUT = ("colwise", "local_colwise")
"""Styles whose output a tp rank holds alone: the fork starts after them."""


class ShardedDropoutRNG:
    """This tp rank's forked generator state for the split region of the
    blocks it hooks (one instance per model)."""

    def __init__(self, tp_rank: int) -> None:
        self.tp_rank = tp_rank
        self._shared: tuple[torch.Tensor, torch.Tensor | None] | None = None

    @torch.compiler.disable  # generator state is host-side: a graph break, not a trace
    def fork(self) -> None:
        """Enter this rank's stream (a no-op when already in it)."""
        if self._shared is not None:
            return
        seed = int(torch.randint(2**62, (1,)))  # the shared CPU generator: alike on tp ranks
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        self._shared = (torch.get_rng_state(), cuda)
        mixed = tp_seed(seed, self.tp_rank)
        torch.random.default_generator.manual_seed(mixed)
        if cuda is not None:
            torch.cuda.manual_seed(mixed)

    @torch.compiler.disable
    def join(self) -> None:
        """Back to the shared state (a no-op when not forked)."""
        if self._shared is None:
            return
        cpu, cuda = self._shared
        self._shared = None
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)


def tp_seed(seed: int, tp_rank: int) -> int:
    """PURE: the seed of ``tp_rank``'s stream forked from ``seed``."""
    digest = hashlib.blake2b(f"{seed}/tp{tp_rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def apply_sharded_dropout(
    model: nn.Module, styles: Mapping[str, object], blocks: list[str], tp_rank: int
) -> None:
    """Hook ``blocks`` (the parents of column-wise layers) and their planned
    children (``styles``: module name to plan style name) so randomness
    between a split-output child and the next replicated input draws from
    this tp rank's own stream (module docstring)."""
    modules = dict(model.named_modules())
    if not any(has_dropout(modules[name]) for name in blocks):
        return  # nothing random in the split region: no hooks (compiled blocks stay whole)
    rng = ShardedDropoutRNG(tp_rank)
    for name in blocks:
        modules[name].register_forward_hook(lambda *_: rng.join(), always_call=True)
    for name, style in styles.items():
        if not any(name.startswith(block + ".") for block in blocks):
            continue
        if style in SPLIT_OUTPUT:
            modules[name].register_forward_pre_hook(lambda *_: rng.join())
            modules[name].register_forward_hook(lambda *_: rng.fork(), always_call=True)
        elif isinstance(style, str) and style.startswith(("colwise", "rowwise")):
            # a replicated input (gathered-output / split-input styles) or a
            # replicated output (row-wise): the shared stream, as one process
            modules[name].register_forward_pre_hook(_join_unless_sharded_input(rng, style))
            modules[name].register_forward_hook(lambda *_: rng.join(), always_call=True)


def has_dropout(block: nn.Module) -> bool:
    """Whether ``block`` may draw random numbers: a dropout module with
    ``p > 0``, or an attention whose ``attention_dropout`` (transformers'
    attribute, passed to its attention function in train mode) is not 0."""
    return any(
        isinstance(m, nn.Dropout) and m.p > 0 or bool(getattr(m, "attention_dropout", 0.0))
        for m in block.modules()
    )


def _join_unless_sharded_input(rng: ShardedDropoutRNG, style: str):
    """A row-wise layer on a split input keeps the fork for its input (a
    LoRA dropout there acts on this rank's slice); others join."""
    sharded_input = style in ("rowwise", "local_rowwise")

    def hook(*_):
        if not sharded_input:
            rng.join()

    return hook
