"""Pure strategy decisions: the fully_shard policy and which modules are blocks."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from ray_fsdp_backend import FSDPConfig
from ray_fsdp_backend.strategies.blocks import find_blocks, materialize_meta_module
from ray_fsdp_backend.strategies.fsdp import resolve_fsdp_policy
from tests.models import Block, ToyNet

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


def test_mixed_precision_from_bf16_and_reduce_dtype():
    p = resolve_fsdp_policy(FSDPConfig(use_fsdp=True), CPU).mp_policy
    assert (p.param_dtype, p.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    p = resolve_fsdp_policy(FSDPConfig(use_fsdp=True, fsdp_reduce_dtype="fp32"), CPU).mp_policy
    assert (p.param_dtype, p.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_no_mixed_precision_means_full_fp32():
    # The seed asserted that a mixed-precision policy exists.
    p = resolve_fsdp_policy(FSDPConfig(use_fsdp=True, use_mixed_precision=False), CPU).mp_policy
    assert p.param_dtype is None and p.reduce_dtype is None


def test_offload_is_cpu_offload_policy_on_gpu_and_skipped_on_cpu():
    cfg = FSDPConfig(use_fsdp=True, fsdp_cpu_offload=True)
    gpu = resolve_fsdp_policy(cfg, GPU)
    # The seed built OffloadPolicy(pin_memory=True), which raises TypeError.
    assert isinstance(gpu.offload_policy, CPUOffloadPolicy) and gpu.offload_policy.pin_memory
    assert gpu.offloads
    cpu = resolve_fsdp_policy(cfg, CPU)
    assert type(cpu.offload_policy) is OffloadPolicy and not cpu.offloads


@pytest.mark.parametrize(
    "name, reshard",
    [
        ("full_shard", True),
        ("shard_grad_op", False),
        ("hybrid_shard", True),
        ("_hybrid_shard_zero2", False),
    ],
)
def test_reshard_after_forward_false_only_for_zero2(name, reshard):
    cfg = FSDPConfig(use_fsdp=True, fsdp_sharding_strategy=name)
    assert resolve_fsdp_policy(cfg, CPU).reshard_after_forward is reshard


def test_default_blocks_are_module_list_children():
    model = ToyNet(n_layers=3)
    assert find_blocks(model) == list(model.layers)


def test_configured_block_classes_and_unknown_class():
    model = ToyNet()
    assert find_blocks(model, ["Block"]) == list(model.layers)
    # Outermost only: a Linear inside a Block is not a second unit.
    assert find_blocks(model, ["Block", "LayerNorm"]) == list(model.layers)
    with pytest.raises(ValueError, match=r"no module of class \['Blok'\] in ToyNet"):
        find_blocks(model, ["Blok"])


def test_tied_weights_stay_in_one_group():
    model = ToyNet(dim_in=16, dim_out=16, tied=True)
    blocks = find_blocks(model, ["Linear"])
    assert model.inp not in blocks and model.head not in blocks
    assert all(isinstance(b, nn.Linear) for b in blocks) and len(blocks) == 2  # the blocks' fc


def test_meta_model_without_an_initialiser_is_refused():
    class Raw(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))

    with torch.device("meta"):
        model = nn.Sequential(Block(4), Raw())
    with pytest.raises(ValueError, match=r"\['Raw'\] have parameters without reset_parameters"):
        materialize_meta_module(model, CPU)
    assert model[0].fc.weight.is_meta  # nothing was allocated


def test_ddp_autocast_forward_covers_any_forward_and_ends_with_it():
    from ray_fsdp_backend.strategies.ddp import autocast_forward

    model = nn.Linear(4, 4)
    model.forward = lambda x: nn.functional.linear(x, model.weight)  # an instance forward
    autocast_forward(model, "cpu", torch.bfloat16)
    assert model(torch.randn(2, 4)).dtype == torch.bfloat16
    assert model.weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")

    class Failing(nn.Module):
        def forward(self, x):
            raise RuntimeError("bad batch")

    failing = Failing()
    autocast_forward(failing, "cpu", torch.bfloat16)
    with pytest.raises(RuntimeError, match="bad batch"):
        failing(torch.ones(1))
    assert not torch.is_autocast_enabled("cpu")  # the failed forward left autocast off
