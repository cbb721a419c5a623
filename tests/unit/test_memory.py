"""The pure per-GPU memory estimate, against the formulas in its docstring."""

from __future__ import annotations

import pytest

from ray_fsdp_backend.models.decoder import ModelConfig
from ray_fsdp_backend.planning.memory import (
    ModelSize,
    compute_optimizer_state_bytes,
    estimate_memory,
    format_bytes,
)
from ray_fsdp_backend.settings.config import ShardingStrategy

N, U, M = 1_000_000, 100_000, 800_000
SIZE = ModelSize(num_params=N, largest_unit_params=U, matrix_params=M)


def test_ddp_holds_everything_on_every_gpu():
    est = estimate_memory(SIZE, None, shard_size=8)
    assert (est.params, est.grads, est.optimizer, est.transient) == (4 * N, 4 * N, 8 * N, 4 * N)
    assert est.total == 20 * N


@pytest.mark.parametrize("shard", [1, 2, 8])
def test_full_shard_divides_state_by_the_shard_size(shard):
    est = estimate_memory(SIZE, ShardingStrategy.FULL_SHARD, shard)
    assert est.params == est.grads == 4 * N // shard
    assert est.optimizer == 8 * N // shard
    assert est.transient == 2 * 2 * U + 2 * U  # two bf16 units gathered, one bf16 reduce


def test_hybrid_shard_uses_only_the_shard_axis():
    hsdp = estimate_memory(SIZE, ShardingStrategy.HYBRID_SHARD, shard_size=8)
    fsdp = estimate_memory(SIZE, ShardingStrategy.FULL_SHARD, shard_size=8)
    assert hsdp == fsdp


def test_zero2_keeps_the_whole_model_unsharded_between_forward_and_backward():
    est = estimate_memory(SIZE, ShardingStrategy.SHARD_GRAD_OP, shard_size=4)
    assert est.transient == 2 * N + 2 * U
    full = estimate_memory(SIZE, ShardingStrategy.HYBRID_SHARD_ZERO2, 4, mixed_precision=False)
    assert full.transient == 4 * N + 4 * U


def test_fp32_reduction_and_full_precision():
    est = estimate_memory(SIZE, ShardingStrategy.FULL_SHARD, 2, reduce_fp32=True)
    assert est.transient == 2 * 2 * U + 4 * U
    est = estimate_memory(SIZE, ShardingStrategy.FULL_SHARD, 2, mixed_precision=False)
    assert est.transient == 2 * 4 * U + 4 * U


def test_cpu_offload_moves_sharded_state_to_the_host():
    on_gpu = estimate_memory(SIZE, ShardingStrategy.FULL_SHARD, 4)
    offloaded = estimate_memory(SIZE, ShardingStrategy.FULL_SHARD, 4, cpu_offload=True)
    assert offloaded.params == offloaded.grads == offloaded.optimizer == 0
    assert offloaded.host == on_gpu.params + on_gpu.grads + on_gpu.optimizer
    assert offloaded.transient == on_gpu.transient


def test_muon_keeps_one_buffer_for_matrices_and_adamw_for_the_rest():
    assert compute_optimizer_state_bytes(SIZE, "adamw") == 8 * N
    assert compute_optimizer_state_bytes(SIZE, "muon") == 4 * M + 8 * (N - M)
    with pytest.raises(ValueError, match="train.optimizer='sgd'"):
        compute_optimizer_state_bytes(SIZE, "sgd")
    with pytest.raises(ValueError, match="shard_size=0"):
        estimate_memory(SIZE, ShardingStrategy.FULL_SHARD, 0)


def test_a_billion_parameters_fit_sharded_over_eight_gpus():
    cfg = ModelConfig.preset("1b")
    size = ModelSize(cfg.num_params(), cfg.block_params(), cfg.matrix_params())
    ddp = estimate_memory(size, None, 8)
    fsdp = estimate_memory(size, ShardingStrategy.FULL_SHARD, 8)
    assert ddp.total > 16 * cfg.num_params()
    assert fsdp.total < ddp.total / 5


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 1024**3) == "3.0 GiB"


def test_unsharded_accumulation_adds_the_full_gradient():
    size = ModelSize(num_params=1_000_000, largest_unit_params=100_000, matrix_params=900_000)
    base = estimate_memory(size, ShardingStrategy.FULL_SHARD, 8)
    unsharded = estimate_memory(size, ShardingStrategy.FULL_SHARD, 8, accumulate_unsharded=True)
    assert unsharded.transient - base.transient == 2 * 1_000_000  # bf16 reduce dtype, all N
    assert (unsharded.params, unsharded.grads) == (base.params, base.grads)
