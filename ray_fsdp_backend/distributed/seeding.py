"""Each rank's randomness: one seed per step and data coordinate.

``ray-fsdp train`` calls it every step, and ``ctx.seed_step(seed, step)`` gives a
loop of your own the same seeding. The model is initialised from the run seed
alone, equal on every rank (the strategies make a sharded initialisation equal
one process's). From the first step on, every rank reseeds its generators at
every step from the run seed, the step and its data-parallel,
context-parallel and pipeline coordinates (:func:`step_seed`), so dropout
draws are independent where ranks hold different tokens or different layers
(pipeline stages: Megatron adds the pipeline rank too), equal across a
tensor-parallel group (whose activations outside the split layers are the same), and
reproducible across restarts and elastic resizes. Dropout on activations a
tensor-parallel rank holds alone (its attention heads) draws from a stream of
its own (:mod:`ray_fsdp_backend.strategies.tp_dropout`).
"""

from __future__ import annotations

import hashlib

import torch


def seed_step(ctx, seed: int, step: int) -> None:
    """Seed this rank's generators for ``step`` (dropout, LoRA dropout): see
    :func:`step_seed`. The model's initialisation uses ``seed`` alone, equal
    on every rank, before the first step."""
    torch.manual_seed(step_seed(seed, step, ctx.dp_rank, ctx.cp_rank, ctx.pp_rank))


def step_seed(seed: int, step: int, dp_rank: int, cp_rank: int, pp_rank: int) -> int:
    """The seed of one rank's randomness at ``step``, a function of the run
    seed, the step and the rank's data-parallel, context-parallel and
    pipeline coordinates: ranks that hold different tokens (dp, cp) or
    different layers of one micro-batch (pp: every stage of it would
    otherwise draw the same masks for its layers) draw independent masks,
    the ranks of one tp group (the same tokens, split matrices) draw the
    same ones, and a resumed or resized run draws at step ``k`` what an
    uninterrupted run does at the same coordinates (seeding every step makes
    that independent of the restored generator state)."""
    key = f"{seed}/{step}/{dp_rank}/{cp_rank}/{pp_rank}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
