"""A Ray Train backend for PyTorch FSDP2, HSDP, DDP and distributed Muon.

trainer = TorchTrainer(train_fn, torch_config=FSDPConfig(use_fsdp=True), ...)

def train_fn(loop_config):
    ctx = get_context()
    model = ctx.wrap(model)
"""

from ray_fsdp_backend.config import FSDPConfig, ShardingStrategy
from ray_fsdp_backend.context import TrainContext, get_context
from ray_fsdp_backend.strategies import (
    DDPStrategy,
    DistributionStrategy,
    FSDPStrategy,
    build_strategy,
)

__all__ = [
    "DDPStrategy",
    "DistributionStrategy",
    "FSDPConfig",
    "FSDPStrategy",
    "ShardingStrategy",
    "TrainContext",
    "build_strategy",
    "get_context",
]
