"""A Ray Train backend for PyTorch FSDP2, HSDP, DDP and distributed Muon.

    trainer = TorchTrainer(train_fn, torch_config=FSDPConfig(use_fsdp=True), ...)

    def train_fn(loop_config):
        ctx = get_context()
        model = ctx.wrap(model)

Public names are imported on first use, so that ``ray_fsdp_backend.dmuon`` or
``ray_fsdp_backend.distributed.clip`` can be used in a torchrun job without importing Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "CheckpointMismatchError": "ray_fsdp_backend.checkpoint",
    "FSDPConfig": "ray_fsdp_backend.runtime.backend",
    "FSDPSettings": "ray_fsdp_backend.settings.config",
    "MeshDataConfig": "ray_fsdp_backend.runtime.data_config",
    "ShardingStrategy": "ray_fsdp_backend.settings.config",
    "TrainContext": "ray_fsdp_backend.runtime.context",
    "get_context": "ray_fsdp_backend.runtime.context",
    "grpo_advantages": "ray_fsdp_backend.rl",
    "linear_cross_entropy": "ray_fsdp_backend.ops.loss",
    "linear_token_log_probs": "ray_fsdp_backend.ops.loss",
    "dpo_loss": "ray_fsdp_backend.preference.losses",
    "reward_loss": "ray_fsdp_backend.preference.losses",
    "PreferenceLoss": "ray_fsdp_backend.preference.losses",
    "pair_log_probs": "ray_fsdp_backend.preference.log_probs",
    "PairLogProbs": "ray_fsdp_backend.preference.log_probs",
    "load_pretrained": "ray_fsdp_backend.hf",
    "PretrainedCheckpointError": "ray_fsdp_backend.hf",
    "DDPStrategy": "ray_fsdp_backend.strategies",
    "DistributionStrategy": "ray_fsdp_backend.strategies",
    "FSDPStrategy": "ray_fsdp_backend.strategies",
    "build_strategy": "ray_fsdp_backend.strategies",
    "SFTDataError": "ray_fsdp_backend.sft",
    "check_sft_source": "ray_fsdp_backend.sft",
    "sft_dataset": "ray_fsdp_backend.sft",
    "sft_stats": "ray_fsdp_backend.sft",
    "policy_loss": "ray_fsdp_backend.rl",
    "check_preference_source": "ray_fsdp_backend.preference.dataset",
    "preference_dataset": "ray_fsdp_backend.preference.dataset",
}

__all__ = [
    "CheckpointMismatchError",
    "DDPStrategy",
    "DistributionStrategy",
    "FSDPConfig",
    "FSDPSettings",
    "FSDPStrategy",
    "MeshDataConfig",
    "PairLogProbs",
    "PreferenceLoss",
    "PretrainedCheckpointError",
    "SFTDataError",
    "ShardingStrategy",
    "TrainContext",
    "build_strategy",
    "check_preference_source",
    "check_sft_source",
    "dpo_loss",
    "get_context",
    "grpo_advantages",
    "linear_cross_entropy",
    "linear_token_log_probs",
    "load_pretrained",
    "pair_log_probs",
    "policy_loss",
    "preference_dataset",
    "reward_loss",
    "sft_dataset",
    "sft_stats",
]

if TYPE_CHECKING:
    from ray_fsdp_backend.checkpoint import CheckpointMismatchError
    from ray_fsdp_backend.hf import PretrainedCheckpointError, load_pretrained
    from ray_fsdp_backend.ops.loss import linear_cross_entropy, linear_token_log_probs
    from ray_fsdp_backend.preference.dataset import check_preference_source, preference_dataset
    from ray_fsdp_backend.preference.log_probs import PairLogProbs, pair_log_probs
    from ray_fsdp_backend.preference.losses import PreferenceLoss, dpo_loss, reward_loss
    from ray_fsdp_backend.rl import grpo_advantages, policy_loss
    from ray_fsdp_backend.runtime.backend import FSDPConfig
    from ray_fsdp_backend.runtime.context import TrainContext, get_context
    from ray_fsdp_backend.runtime.data_config import MeshDataConfig
    from ray_fsdp_backend.settings.config import FSDPSettings, ShardingStrategy
    from ray_fsdp_backend.sft import SFTDataError, check_sft_source, sft_dataset, sft_stats
    from ray_fsdp_backend.strategies import (
        DDPStrategy,
        DistributionStrategy,
        FSDPStrategy,
        build_strategy,
    )


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ray_fsdp_backend' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
