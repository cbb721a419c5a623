"""FSDPConfig: defaults, parsing, and every validation error path (no cluster)."""

from __future__ import annotations

import pytest
from ray.train.torch import TorchConfig

from ray_fsdp_backend import FSDPConfig, ShardingStrategy


def test_defaults_are_the_seeds():
    cfg = FSDPConfig()
    assert isinstance(cfg, TorchConfig)
    assert (cfg.use_fsdp, cfg.fsdp_sharding_strategy, cfg.fsdp_hsdp_replicate_size) == (
        False,
        "full_shard",
        None,
    )
    assert (cfg.use_mixed_precision, cfg.bf16, cfg.fsdp_reduce_dtype) == (True, True, "bf16")
    assert (cfg.find_unused_parameters, cfg.broadcast_buffers, cfg.bucket_cap_mb) == (
        False,
        True,
        25,
    )
    assert cfg.backend is None and cfg.timeout_s == 1800


def test_backend_cls_is_ours_and_backend_stays_assignable():
    from ray_fsdp_backend.runtime.backend import FSDPBackend

    cfg = FSDPConfig(use_fsdp=True)
    assert cfg.backend_cls is FSDPBackend
    cfg.backend = "gloo"  # what Ray's TorchTrainer does
    assert cfg.backend == "gloo"


def test_zero2_alias_and_enum():
    cfg = FSDPConfig(use_fsdp=True, fsdp_sharding_strategy="hybrid_shard_zero2")
    assert cfg.fsdp_sharding_strategy == "_hybrid_shard_zero2"
    assert cfg.sharding_strategy is ShardingStrategy.HYBRID_SHARD_ZERO2
    assert cfg.sharding_strategy.is_hybrid and not cfg.sharding_strategy.reshard_after_forward
    assert ShardingStrategy.FULL_SHARD.reshard_after_forward
    assert not ShardingStrategy.SHARD_GRAD_OP.reshard_after_forward


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"fsdp_sharding_strategy": "fullshard"},
            "fsdp_sharding_strategy='fullshard' is not one of full_shard, shard_grad_op, "
            "hybrid_shard, _hybrid_shard_zero2",
        ),
        ({"use_fsdp": "yes"}, "use_fsdp='yes' has type str; expected bool"),
        ({"timeout_s": True}, "timeout_s=True has type bool; expected int"),
        ({"timeout_s": 0}, "timeout_s=0 must be a positive"),
        ({"bucket_cap_mb": -1}, "bucket_cap_mb=-1 must be positive"),
        ({"fsdp_reduce_dtype": "fp16"}, "fsdp_reduce_dtype='fp16' is not one of bf16, fp32"),
        ({"backend": "mpi"}, "backend='mpi' is not one of nccl, gloo"),
        ({"init_method": "file"}, "init_method='file' is not one of env, tcp"),
        (
            {"use_fsdp": True, "fsdp_hsdp_replicate_size": 2},
            "fsdp_hsdp_replicate_size=2 needs use_fsdp=true and fsdp_sharding_strategy hybrid",
        ),
        (
            {
                "use_fsdp": True,
                "fsdp_sharding_strategy": "hybrid_shard",
                "fsdp_hsdp_replicate_size": 0,
            },
            "fsdp_hsdp_replicate_size=0 must be a positive int",
        ),
        ({"fsdp_cpu_offload": True}, "fsdp_cpu_offload=True needs use_fsdp=true"),
        ({"bf16": False}, "bf16=False with use_mixed_precision=True asks for fp16 compute"),
        ({"use_dmuon": True}, "use_dmuon=True needs use_fsdp=true"),
        ({"nccl_env": {"OMP_NUM_THREADS": "1"}}, "nccl_env key 'OMP_NUM_THREADS' must start"),
        ({"fsdp_block_classes": "Block"}, "fsdp_block_classes='Block' must be a list"),
        ({"fsdp_block_classes": ["Block", ""]}, "every entry must be a non-empty string"),
    ],
)
def test_bad_values_name_key_value_and_rule(kwargs, message):
    with pytest.raises(ValueError) as err:
        FSDPConfig(**kwargs)
    assert message in str(err.value)


def test_unknown_key_suggests_closest():
    with pytest.raises(
        ValueError,
        match=r"unknown distributed config key 'fsdp_sharding_stratgy'; "
        r"did you mean 'fsdp_sharding_strategy'\?",
    ):
        FSDPConfig.from_dict({"use_fsdp": True, "fsdp_sharding_stratgy": "full_shard"})
    with pytest.raises(ValueError, match="'zzz'; valid keys: backend"):
        FSDPConfig.from_dict({"zzz": 1})


def test_yaml_round_trip(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(
        "model: {dim: 8}\n"
        "distributed:\n"
        "  use_fsdp: true\n"
        "  fsdp_sharding_strategy: hybrid_shard\n"
        "  fsdp_hsdp_replicate_size: 2\n"
        "  fsdp_block_classes: [Block]\n"
    )
    cfg = FSDPConfig.from_yaml(path)
    assert cfg.fsdp_hsdp_replicate_size == 2 and cfg.fsdp_block_classes == ("Block",)
    assert FSDPConfig.from_dict(cfg.to_dict()) == cfg


def test_yaml_without_distributed_section(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("model: {dim: 8}\n")
    with pytest.raises(ValueError, match="no 'distributed:' section"):
        FSDPConfig.from_yaml(path)


def test_bad_config_fails_before_any_cluster_work():
    """The trainer is never built: the error comes from constructing the config."""
    with pytest.raises(ValueError, match="fsdp_sharding_strategy='zero3'"):
        FSDPConfig.from_dict({"use_fsdp": True, "fsdp_sharding_strategy": "zero3"})


def test_get_context_outside_a_worker_is_a_clear_error():
    import ray_fsdp_backend as rfb

    with pytest.raises(RuntimeError, match="only available inside train_loop_per_worker"):
        rfb.get_context()


def test_tensor_parallel_keys_are_checked_by_name():
    cfg = FSDPConfig(use_fsdp=True, tensor_parallel_size=2)
    assert cfg.sequence_parallel_enabled and not FSDPConfig().sequence_parallel_enabled
    assert not FSDPConfig(
        use_fsdp=True, tensor_parallel_size=2, sequence_parallel=False
    ).sequence_parallel_enabled
    with pytest.raises(ValueError, match="tensor_parallel_size=0 must be a positive int"):
        FSDPConfig(use_fsdp=True, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs use_fsdp=true"):
        FSDPConfig(tensor_parallel_size=2)
    # DMuon under tp: tests/dist/test_dmuon_model_parallel.py
    assert FSDPConfig(use_fsdp=True, use_dmuon=True, tensor_parallel_size=2).use_dmuon
    with pytest.raises(ValueError, match="loss_parallel=True needs tensor_parallel_size > 1"):
        FSDPConfig(use_fsdp=True, loss_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel=True needs tensor_parallel_size > 1"):
        FSDPConfig(use_fsdp=True, sequence_parallel=True)
    with pytest.raises(ValueError, match="tensor_parallel_size='2' has type str"):
        FSDPConfig.from_dict({"use_fsdp": True, "tensor_parallel_size": "2"})
