"""Real TorchTrainer runs with CPU workers on one local Ray cluster.

The backend through both of Ray Train's entry points, against one process:
``DataParallelTrainer(backend_config=...)`` (DDP) on 2 workers, and
``TorchTrainer(torch_config=...)`` (FSDP2) on 1 (issue 45, the suite's time):
``TorchTrainer`` with an ``FSDPConfig`` on 4 workers, every step against one
process, is tests/e2e/test_ray_data_mesh.py's fit, and FSDP2's numbers at 2
and 4 ranks are tests/dist/test_strategies.py's."""

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
    "make_trainer, cfg, strategy, workers",
    [
        (
            _torch_trainer,
            rfb.FSDPConfig(use_fsdp=True, use_mixed_precision=False),
            "FSDPStrategy",
            1,
        ),
        (
            _data_parallel_trainer,
            rfb.FSDPConfig(use_fsdp=False, use_mixed_precision=False),
            "DDPStrategy",
            2,
        ),
    ],
    ids=["fsdp-TorchTrainer", "ddp-DataParallelTrainer"],
)
def test_trainer_matches_single_process(ray_local, make_trainer, cfg, strategy, workers):
    trainer = make_trainer(
        cfg, train_loop_config={"steps": STEPS}, scaling_config=ScalingConfig(num_workers=workers)
    )
    out = trainer.fit().return_value
    assert out["strategy"] == strategy
    want = reference_toy(STEPS)
    for name, value in want.items():
        torch.testing.assert_close(torch.tensor(out["params"][name]), value, atol=1e-5, rtol=1e-5)
    # Both fits run in one driver: the second one proves shutdown released the group.
    assert [r["rank"] for r in out["ranks"]] == list(range(workers))
