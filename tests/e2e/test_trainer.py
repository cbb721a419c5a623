"""Real TorchTrainer runs with CPU workers on one local Ray cluster."""

from __future__ import annotations

import pytest
import torch
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer

import ray_fsdp_backend as rfb
from tests.e2e.train_fns import reference_toy, train_toy

pytestmark = pytest.mark.e2e

STEPS = 3


def _fit(cfg: rfb.FSDPConfig, num_workers: int = 2):
    trainer = TorchTrainer(
        train_toy,
        train_loop_config={"steps": STEPS},
        torch_config=cfg,
        scaling_config=ScalingConfig(num_workers=num_workers),
    )
    return trainer.fit().return_value


@pytest.mark.parametrize(
    "cfg, strategy",
    [
        (rfb.FSDPConfig(use_fsdp=True, use_mixed_precision=False), "FSDPStrategy"),
        (rfb.FSDPConfig(use_fsdp=False), "DDPStrategy"),
    ],
    ids=["fsdp", "ddp"],
)
def test_trainer_matches_single_process(ray_local, cfg, strategy):
    out = _fit(cfg)
    assert out["strategy"] == strategy
    want = reference_toy(STEPS)
    for name, value in want.items():
        torch.testing.assert_close(torch.tensor(out["params"][name]), value, atol=1e-5, rtol=1e-5)
    # Both fits run in one driver: the second one proves shutdown released the group.
    assert [r["rank"] for r in out["ranks"]] == [0, 1]
