"""Dropout under tensor parallelism in a user's loop, on 4 gloo ranks (dp 2 x tp 2).

Every rank is seeded alike (``torch.manual_seed(0)``, as torch examples do)
and calls ``ctx.seed_step(seed, step)``; the same rows go to every rank, so
masks differ only where the seeding makes them. The masks each dropout draws
(``bernoulli_``) are recorded in one forward:

- Qwen3 (heads split over tp, ``attention_dropout=0.5``): head ``h`` of tp
  rank 0 and head ``h`` of tp rank 1 (the model's heads ``h`` and
  ``h + H/tp``) agree on about half the weights, as two heads of one rank do;
- Phi-3 (``resid_pdrop=0.5``; its fused qkv output is gathered, so every tp
  rank computes every head and its attention dropout, 0.5 too, must agree):
  residual and attention masks equal across a tp group, different across dp
  ranks, and the same step reseeded draws the same masks again.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ray_fsdp_backend.runtime.worker import setup_process_context
from ray_fsdp_backend.settings.config import FSDPSettings
from tests.dist.harness import run_ranks
from tests.zoo_families import SEQ, VOCAB, build_family


class DropoutMasks(TorchDispatchMode):
    """Records the keep-mask of every dropout (torch's CPU dropout fills a
    noise tensor with ``bernoulli_``), in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.bernoulli_.float:
            self.masks.append(out.detach() != 0)
        return out


def _masks(ctx, family: str, **overrides) -> list[torch.Tensor]:
    model = ctx.wrap(build_family(family, **overrides))
    model.train()
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    runs = []
    for _ in range(2):  # the same step twice: the same masks
        ctx.seed_step(1234, 7)
        with DropoutMasks() as record:
            model(input_ids=ids)
        runs.append(record.masks)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    return runs[0]


def _job(rank, world) -> dict:
    settings = FSDPSettings(use_fsdp=True, use_mixed_precision=False, tensor_parallel_size=2)
    ctx = setup_process_context(settings, torch.device("cpu"))
    mine = {
        "coords": (ctx.dp_rank, ctx.tp_rank),
        "qwen3": _masks(ctx, "qwen3", attention_dropout=0.5),
        "phi3": _masks(ctx, "phi3", attention_dropout=0.5, resid_pdrop=0.5),
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return {r["coords"]: r for r in everyone}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_job, 4)


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a == b).float().mean())


def test_attention_dropout_is_independent_across_tp_heads(ranks):
    for dp in (0, 1):
        tp0, tp1 = ranks[(dp, 0)]["qwen3"], ranks[(dp, 1)]["qwen3"]
        attention = [m for m in tp0 if m.ndim == 4]
        assert len(attention) == 2  # one per layer, [rows, heads per tp rank, seq, seq]
        for a, b in zip(tp0, tp1, strict=True):
            across = _agreement(a[:, 0], b[:, 0])  # heads 0 and 2 of the model
            within = _agreement(a[:, 0], a[:, 1])  # heads 0 and 1
            assert abs(across - 0.5) < 0.05 and abs(within - 0.5) < 0.05, (across, within)


def test_replicated_dropout_is_alike_across_tp_and_apart_across_dp(ranks):
    masks = {coords: r["phi3"] for coords, r in ranks.items()}
    assert {m.ndim for m in masks[(0, 0)]} == {3, 4}  # residual and (gathered) attention
    for dp in (0, 1):
        for a, b in zip(masks[(dp, 0)], masks[(dp, 1)], strict=True):
            assert torch.equal(a, b)
    for a, b in zip(masks[(0, 0)], masks[(1, 0)], strict=True):
        assert abs(_agreement(a, b) - 0.5) < 0.05
