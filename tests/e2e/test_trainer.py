"""Real TorchTrainer runs with CPU workers on one local Ray cluster."""

from __future__ import annotations

import pytest
import torch
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

import ray_fsdp_backend as rfb
from tests.e2e.train_fns import reference_toy, train_toy

pytestmark = pytest.mark.e2e

STEPS = 3


def _torch_trainer(cfg: rfb.FSDPConfig, **kwargs):
    return TorchTrainer(train_toy, torch_config=cfg, **kwargs)


def _data_parallel_trainer(cfg: rfb.FSDPConfig, **kwargs):
    return DataParallelTrainer(train_toy, backend_config=cfg, **kwargs)


@pytest.mark.parametrize(
    "make_trainer, cfg, strategy",
    [
        (_torch_trainer, rfb.FSDPConfig(use_fsdp=True, use_mixed_precision=False), "FSDPStrategy"),
        (
            _data_parallel_trainer,
            rfb.FSDPConfig(use_fsdp=False, use_mixed_precision=False),
            "DDPStrategy",
        ),
    ],
    ids=["fsdp-TorchTrainer", "ddp-DataParallelTrainer"],
)
def test_trainer_matches_single_process(ray_local, make_trainer, cfg, strategy):
    trainer = make_trainer(
        cfg, train_loop_config={"steps": STEPS}, scaling_config=ScalingConfig(num_workers=2)
    )
    out = trainer.fit().return_value
    assert out["strategy"] == strategy
    want = reference_toy(STEPS)
    for name, value in want.items():
        torch.testing.assert_close(torch.tensor(out["params"][name]), value, atol=1e-5, rtol=1e-5)
    # Both fits run in one driver: the second one proves shutdown released the group.
    assert [r["rank"] for r in out["ranks"]] == [0, 1]
