"""Reporting stays off the training path: with ``log_every: 1`` every step
is logged to the trainer's own sinks, while Ray hears only with a checkpoint
(each ``ray.train.report`` can wait up to 2 s for Ray 2.60's controller;
docs/monitoring.md). ``python -m benchmarks.reporting`` holds the timing;
this counts the calls."""

from __future__ import annotations

from pathlib import Path

import pytest
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from ray_fsdp_backend.trainer.schema.spec import apply_overrides, build_spec, load_yaml
from tests.e2e.reporting_fns import train_counting_reports

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cpu_tiny.yaml"


def test_every_step_logged_ray_hears_only_with_checkpoints(ray_local, tmp_path):
    overrides = ["train.steps=12", "train.log_every=1", "train.checkpoint_every=5"]
    overrides += ["train.micro_batch_size=2", "model.seq_len=32"]
    spec = build_spec(apply_overrides(load_yaml(EXAMPLE), overrides))
    result = TorchTrainer(
        train_counting_reports,
        train_loop_config=spec.raw,
        torch_config=spec.distributed,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="reporting", storage_path=str(tmp_path)),
    ).fit()
    out = result.return_value
    assert out["logged"] == list(range(1, 13))  # every step reached the trainer's sinks
    assert out["reported"] == [5, 10]  # the two checkpoints: 2 reports for 12 logged steps
    assert result.metrics["step"] == 10 and result.checkpoint is not None
