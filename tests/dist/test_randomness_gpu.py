"""Randomness on a GPU mesh under ``fsdp_cpu_offload`` (skipped without CUDA).

Two gloo ranks share one GPU (no collective runs on it: the mesh is a
``cuda`` mesh, the offloaded shards live on the CPU and are compared over
gloo). A model built on the meta device and wrapped with CPU offload starts
as the one-process CPU init from the same seed (torch's RNG tracker steps the
GPU generator while FSDP2's offloaded shards fill from the CPU one: each
rank's half used to repeat the first), and the trainer's per-step seeding
gives the dp ranks different dropout masks on the GPU and the ranks of a tp
group the same.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ray_fsdp_backend.distributed.seeding import seed_step
from ray_fsdp_backend.models.decoder import ModelConfig, Transformer
from ray_fsdp_backend.runtime.worker import setup_process_context
from ray_fsdp_backend.settings.config import FSDPSettings
from ray_fsdp_backend.strategies.blocks import materialize_meta_module
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CONFIG = ModelConfig(dim=32, n_layers=2, n_heads=4, seq_len=16)


def _gathered(local: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    return parts


def _checks(rank, world):
    gpu = torch.device("cuda", 0)
    settings = dict(use_fsdp=True, use_mixed_precision=False, fsdp_cpu_offload=True)
    ctx = setup_process_context(FSDPSettings(**settings), gpu)
    torch.manual_seed(11)
    with torch.device("meta"):
        model = Transformer(CONFIG)
    model = ctx.wrap(model)
    init = {}
    for name, p in model.named_parameters():
        local = p.to_local()
        assert local.device.type == "cpu", (name, local.device)  # offloaded
        init[name] = torch.cat(_gathered(local))  # FSDP2 shards dim 0
    seed_step(ctx, seed=11, step=1)
    dp_draws = _gathered(torch.rand(64, device=gpu).cpu())
    ctx = setup_process_context(FSDPSettings(use_fsdp=True, tensor_parallel_size=2), gpu)
    seed_step(ctx, seed=11, step=1)
    tp_draws = _gathered(torch.rand(64, device=gpu).cpu())
    return init, dp_draws, tp_draws


@pytest.fixture(scope="module")
def results():
    return run_ranks(_checks, 2)


def test_offloaded_meta_init_equals_one_process(results):
    init, _, _ = results
    torch.manual_seed(11)
    with torch.device("meta"):
        ref = Transformer(CONFIG)
    materialize_meta_module(ref, "cpu")
    want = dict(ref.named_parameters())
    assert init.keys() == want.keys()
    for name, value in init.items():
        assert torch.equal(value, want[name].detach()), name


def test_dropout_differs_across_dp_ranks_and_matches_across_tp_ranks(results):
    _, dp_draws, tp_draws = results
    assert not torch.equal(dp_draws[0], dp_draws[1])
    assert torch.equal(tp_draws[0], tp_draws[1])
