"""apply_fsdp on a one-rank gloo group: a model without blocks is warned about."""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ray_fsdp_backend import FSDPSettings
from ray_fsdp_backend.strategies.blocks import find_blocks
from ray_fsdp_backend.strategies.fsdp import apply_fsdp, resolve_fsdp_policy


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _wrap(model, mesh):
    policy = resolve_fsdp_policy(FSDPSettings(use_fsdp=True), mesh.device_type)
    return apply_fsdp(model, find_blocks(model), mesh, policy)


def test_a_model_without_blocks_is_warned_as_one_unit(one_rank, caplog):
    with caplog.at_level(logging.WARNING):
        _wrap(nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)]), one_rank)
    assert "ONE FSDP unit" in caplog.text and "Sequential" in caplog.text


def test_a_model_with_blocks_is_not(one_rank, caplog):
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    with caplog.at_level(logging.WARNING):
        _wrap(model, one_rank)
    assert "ONE FSDP unit" not in caplog.text
